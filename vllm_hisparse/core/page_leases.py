"""The device and host leases a request's pages and hot region hold, and the page rules.

Page moves (docs/core.md, "Page rules"):

* **add** new pages: one device block (the pool's or the engine's) and one host block each,
  all or nothing;
* **release** a pinned page: its lease is dropped but the block stays readable until the
  device pool hands it out again (then the page points at its host copy);
* **re-pin** a released page that was not reused (no copy);
* **mark clean** a page whose every row is on the host (and publish its prefix identity);
* **settle** a parked request's page once its written rows are on the host.

Requirement R1.a (docs/core.md): a prefilling request never releases a page.
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.errors import DevicePoolExhausted, HostPoolExhausted
from vllm_hisparse.core.outcome import Outcome
from vllm_hisparse.core.page_table import releasable_mask
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.request_table import Request, RequestStatus
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES


class PageLeases:
    """Lease moves of pages and hot regions, on the page tables and both pools."""

    def __init__(self, state: PolicyState) -> None:
        self.state = state
        self.released_owner: dict[int, list[tuple[int, int, int]]] = {}
        """Released device block -> ``[(row, serial, page)]`` whose copy it still holds."""
        self.num_hot_blocks_leased = 0
        """Device blocks every hot region lease holds together."""

    # -- growth -----------------------------------------------------------------------
    def add_pages(self, req: Request, num_new_pages: int, device_block_ids) -> Outcome:
        """Back ``num_new_pages`` new pages with a device block (``device_block_ids``, the
        engine's, one lease taken over each; else the pool's) and a host block. All or
        nothing: WAIT_DEVICE / WAIT_HOST leave everything as it was."""
        if device_block_ids is None and num_new_pages > self.state.device_pool.get_num_free_blocks():
            self.state.stats.num_device_backpressure += 1
            return Outcome.WAIT_DEVICE
        try:
            host = self.state.host_pool.allocate(num_new_pages)
        except HostPoolExhausted:
            self.state.stats.num_host_backpressure += 1
            return Outcome.WAIT_HOST
        if device_block_ids is None:
            try:
                device = self.state.device_pool.get_new_blocks(num_new_pages)
            except DevicePoolExhausted:  # pragma: no cover - checked above
                self.state.host_pool.free(host)
                self.state.stats.num_device_backpressure += 1
                return Outcome.WAIT_DEVICE
        else:
            device = [int(b) for b in device_block_ids]
        t = self.state.tables
        row = req.row
        old_pages = int(t.num_pages[row])
        pages = slice(old_pages, old_pages + num_new_pages)
        t.device_block[row, pages] = device
        t.pinned[row, pages] = True
        t.host_block[row, pages] = host
        t.num_pages[row] = old_pages + num_new_pages
        t.num_pinned[row] += num_new_pages
        for i in range(num_new_pages):
            self.state.steps.emit_page(row, old_pages + i, device[i], host[i])
        return Outcome.OK

    # -- release and re-pin -----------------------------------------------------------
    def try_release(self, req: Request, page: int) -> bool:
        """Release a page of a MIXED/NONE request if the rules allow it."""
        t = self.state.tables
        row = req.row
        if (
            req.prefilling  # R1.a: a prefilling request keeps every page
            or page < 0
            or page >= t.num_pages[row] - ACTIVE_TAIL_PAGES
            or not t.pinned[row, page]
            or not t.host_valid[row, page]
            or t.pending[row, page] >= 0
            or t.mirror_inflight[row, page] > 0
        ):
            return False
        self.release_page(req, page)
        return True

    def release_all_releasable(self, req: Request) -> list[int]:
        """Release every clean, idle, non-tail pinned page of a MIXED/NONE request (or of
        one being demoted); returns the released pages."""
        t = self.state.tables
        row = req.row
        limit = int(t.num_pages[row]) - ACTIVE_TAIL_PAGES
        if limit <= 0 or req.prefilling:  # R1.a: a prefilling request keeps every page
            return []
        pages = np.nonzero(releasable_mask(t, row, limit))[0].tolist()
        for page in pages:
            self.release_page(req, page)
        return pages

    def undo_release(self, req: Request, pages: list[int]) -> None:
        """Re-pin ``pages`` just released by :meth:`release_all_releasable` (nothing was
        allocated in between, so no block was reused), leaving no trace in the counters."""
        for page in pages:
            self.repin_page(req, page)
        self.state.stats.num_pages_released -= len(pages)
        self.state.stats.num_pages_repinned -= len(pages)

    def release_page(self, req: Request, page: int) -> None:
        """Drop the page's device lease, keeping the block readable until reused."""
        t = self.state.tables
        row = req.row
        block = int(t.device_block[row, page])
        t.pinned[row, page] = False
        t.num_pinned[row] -= 1
        if t.host_valid[row, page]:
            t.num_clean_pinned[row] -= 1
        self.released_owner.setdefault(block, []).append((row, req.serial, page))
        self.state.device_pool.release_readable([block], self._on_block_reused)
        self.state.stats.num_pages_released += 1

    def repin_page(self, req: Request, page: int) -> None:
        """Take a lease again on a released page whose block was not reused."""
        t = self.state.tables
        row = req.row
        block = int(t.device_block[row, page])
        self._forget_released(block, (row, req.serial, page))
        self.state.device_pool.touch([block])
        t.pinned[row, page] = True
        t.num_pinned[row] += 1
        if t.host_valid[row, page]:
            t.num_clean_pinned[row] += 1
        self.state.stats.num_pages_repinned += 1

    def _forget_released(self, block: int, owner: tuple[int, int, int]) -> None:
        owners = self.released_owner.get(block)
        if owners is not None:
            owners.remove(owner)
            if not owners:
                del self.released_owner[block]

    def _on_block_reused(self, block: int) -> None:
        """Device pool callback: a released block was handed out again."""
        owners = self.released_owner.pop(block, None)
        if not owners:
            return
        t = self.state.tables
        for row, serial, page in owners:
            if t.serial[row] == serial and t.device_block[row, page] == block and not t.pinned[row, page]:
                t.device_block[row, page] = -1
                self.state.steps.emit_page(row, page, -1, int(t.host_block[row, page]))
                self.state.stats.num_pages_reused += 1

    # -- host copies ------------------------------------------------------------------
    def mark_clean(self, req: Request, page: int) -> None:
        """Every row of the page is on the host: it is clean from now on."""
        t = self.state.tables
        row = req.row
        t.host_valid[row, page] = True
        t.mirror_failed[row, page] = False
        if t.pinned[row, page]:
            t.num_clean_pinned[row] += 1
        block_hash = req.hash_of(page)
        if block_hash is not None:
            if self.state.host_pool.publish(int(t.host_block[row, page]), block_hash):
                self.state.stats.num_published_pages += 1
        if req.status == RequestStatus.PARKED:
            self.settle_parked_page(req, page)
        elif req.residency != Residency.FULL and not req.promoting:
            self.try_release(req, page)

    def settle_parked_page(self, req: Request, page: int) -> bool:
        """Release a parked request's pinned page once its written rows are on the host.
        True when the page holds no device lease any more."""
        t = self.state.tables
        row = req.row
        if not t.pinned[row, page]:
            return True
        if t.pending[row, page] >= 0 or t.mirror_inflight[row, page] > 0:
            return False
        if not t.host_covers_written(row, page):
            return False
        self.release_page(req, page)
        return True

    # -- hot regions ------------------------------------------------------------------
    def lease_hot(self, req: Request) -> None:
        """Lease the request's hot region (``req.hot_blocks`` device blocks)."""
        req.hot_block_ids = self.state.device_pool.get_new_blocks(req.hot_blocks)
        self.num_hot_blocks_leased += len(req.hot_block_ids)
        self.state.steps.emit_hot_lease(req.row, list(req.hot_block_ids))

    def resize_hot(self, req: Request, num_blocks: int) -> None:
        """Grow (new blocks from the pool, appended) or shrink (the last blocks given back)
        the request's hot region to ``num_blocks`` blocks; the worker keeps the slots of
        the blocks kept. A grow needs the blocks free (``DevicePoolExhausted`` otherwise)."""
        old = req.hot_block_ids
        if num_blocks > len(old):
            ids = old + self.state.device_pool.get_new_blocks(num_blocks - len(old))
            self.state.stats.num_hot_grows += 1
        else:
            self.state.device_pool.free_blocks(old[num_blocks:])
            ids = old[:num_blocks]
            self.state.stats.num_hot_shrinks += 1
        self.num_hot_blocks_leased += len(ids) - len(old)
        req.hot_block_ids = ids
        self.state.requests.set_hot_blocks(req, num_blocks)
        self.state.steps.emit_hot_lease(req.row, list(ids), resize=True)

    def drop_hot_lease(self, req: Request) -> None:
        if req.hot_block_ids:
            self.state.device_pool.free_blocks(req.hot_block_ids)
            self.num_hot_blocks_leased -= len(req.hot_block_ids)
            req.hot_block_ids = []
            self.state.steps.emit_hot_lease(req.row, [])

    def finish_promotion_if_complete(self, req: Request) -> None:
        """A promoting request whose pages are all pinned returns its hot lease: FULL."""
        t = self.state.tables
        if req.num_restores_inflight or t.num_pinned[req.row] != t.num_pages[req.row]:
            return
        req.promoting = False
        self.drop_hot_lease(req)
        self.state.requests.set_residency(req, Residency.FULL)

    # -- end of a request -------------------------------------------------------------
    def return_all(self, req: Request) -> None:
        """Give back every lease of an ended request: pinned pages, host pages, hot region;
        forget its released copies."""
        t = self.state.tables
        row, serial = req.row, req.serial
        n = int(t.num_pages[row])
        pinned_blocks = [int(b) for b in t.device_block[row, :n][t.pinned[row, :n]]]
        if pinned_blocks:
            self.state.device_pool.free_blocks(pinned_blocks)
        for page in np.nonzero(~t.pinned[row, :n] & (t.device_block[row, :n] >= 0))[0]:
            self._forget_released(int(t.device_block[row, page]), (row, serial, int(page)))
        host_blocks = [int(b) for b in t.host_block[row, :n] if b >= 0]
        if host_blocks:
            self.state.host_pool.free(host_blocks)
        self.drop_hot_lease(req)
