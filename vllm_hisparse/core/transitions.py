"""Residency transitions: FULL → MIXED (demotion) and MIXED/NONE → FULL (promotion).

Once per step (:meth:`ResidencyTransitions.apply_pressure`, from ``build_step``):

* requests whose page count first crossed the admission window are demoted when that
  gains blocks (more non-tail pages of their own, not shared with another request, than
  the hot region; a prefilling one waits for its prompt to complete: R1.a);
* under pressure (free device blocks below the low watermark, or unmet demand this step)
  requests are demoted in the order of :func:`pressure.demotion_candidates` until the
  deficit is covered;
* otherwise, with free blocks at or above the high watermark, at most every
  ``min_steps_between_transitions`` steps, requests are promoted in the order of
  :func:`pressure.promotion_candidates`.

A step never both demotes and promotes. A prefilling MIXED/NONE request is promoted at once,
whatever the watermarks (:meth:`ResidencyTransitions.prepare_prefill`, R1.b).
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.outcome import Outcome
from vllm_hisparse.core.page_leases import PageLeases
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.pressure import (
    blocks_freed_by_release,
    demotion_candidates,
    exclusive_pinned_pages,
    promotion_candidates,
)
from vllm_hisparse.core.request_table import Request, RequestStatus
from vllm_hisparse.core.transfer_planner import TransferPlanner
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES


class ResidencyTransitions:
    """Demotions and promotions, the admission-window rule and this step's unmet demand."""

    def __init__(self, state: PolicyState, leases: PageLeases, planner: TransferPlanner) -> None:
        self.state = state
        self.leases = leases
        self.planner = planner
        self.low_watermark_blocks, self.high_watermark_blocks = state.config.watermarks(state.device_pool.num_blocks)
        self.unmet_device_blocks = 0
        """Device blocks requested this step and not granted (reset by each build)."""
        # Rows whose FULL request first crossed the admission window this step, and rows
        # that crossed it while prefilling: demoted once the prompt is complete (R1.a).
        self._window_candidates: set[int] = set()
        self._window_waiting: set[int] = set()
        self._next_promotion_check_step = 0

    # -- admission window -------------------------------------------------------------
    def note_growth(self, req: Request, old_pages: int, new_pages: int) -> None:
        """A FULL request grew from ``old_pages`` by ``new_pages`` pages."""
        # Only the first crossing of the window counts (pages only grow), so a request
        # promoted back to FULL later is not flipped again by the window rule.
        window = self.state.config.admission_window_pages
        if window is not None and old_pages <= window < old_pages + new_pages:
            # R1.a: a prefilling request is demoted when its prompt completes.
            (self._window_waiting if req.prefilling else self._window_candidates).add(req.row)

    def note_prefilling(self, req: Request) -> None:
        """The request's prefilling flag changed: move its window crossing along."""
        row = req.row
        if req.prefilling:
            if row in self._window_candidates:
                self._window_candidates.discard(row)
                self._window_waiting.add(row)
        elif row in self._window_waiting:
            self._window_waiting.discard(row)
            self._window_candidates.add(row)

    def is_window_pending(self, row: int) -> bool:
        """True when ``row`` waits for a demotion by the admission window."""
        return row in self._window_candidates or row in self._window_waiting

    def forget_row(self, row: int) -> None:
        self._window_candidates.discard(row)
        self._window_waiting.discard(row)

    # -- parking and activation -------------------------------------------------------
    def park(self, req: Request) -> None:
        """A running request is preempted: NONE, PARKED, no hot region; pages whose written
        rows are on the host are released, the others spilled (released once spilled)."""
        self.leases.drop_hot_lease(req)
        req.promoting = False
        req.needs_tail_restore_retry = False
        self.state.requests.set_status(req, RequestStatus.PARKED)
        self.state.requests.set_residency(req, Residency.NONE)
        row = req.row
        t = self.state.tables
        for page in np.nonzero(t.pinned[row, : t.num_pages[row]])[0]:
            page = int(page)
            if not self.leases.settle_parked_page(req, page):
                if t.pending[row, page] < 0 and t.mirror_inflight[row, page] == 0:
                    self.planner.queue_spill(row, req.serial, page)

    def activate(self, req: Request) -> Outcome:
        """A PARKED request becomes NONE with its tail pages resident (re-pinned, or restored:
        ACTIVATING until done) and a hot region leased; FULL if every page is still pinned.
        WAIT_DEVICE (unmet demand noted) when the pool cannot take it now."""
        row = req.row
        t = self.state.tables
        num_pages = int(t.num_pages[row])
        if t.num_pinned[row] == num_pages:
            self.state.requests.set_status(req, RequestStatus.ACTIVE)
            self.state.requests.set_residency(req, Residency.FULL)
            return Outcome.OK
        tail = range(max(0, num_pages - ACTIVE_TAIL_PAGES), num_pages)
        repin = [p for p in tail if not t.pinned[row, p] and t.device_block[row, p] >= 0]
        # Tail pages with a restore already in flight (resumed while activating) just wait.
        restore = [p for p in tail if t.device_block[row, p] < 0 and t.pending[row, p] < 0]
        needed = req.hot_blocks + len(repin) + len(restore)
        if needed > self.state.device_pool.get_num_free_blocks():
            self.state.stats.num_device_backpressure += 1
            self.unmet_device_blocks += needed
            return Outcome.WAIT_DEVICE
        for page in repin:
            self.leases.repin_page(req, page)
        self.leases.lease_hot(req)
        self.state.requests.set_residency(req, Residency.NONE)
        if restore:
            self.planner.plan_restore(req, restore)
        if req.num_restores_inflight:
            self.state.requests.set_status(req, RequestStatus.ACTIVATING)
            return Outcome.WAIT_TRANSFER
        self.state.requests.set_status(req, RequestStatus.ACTIVE)
        return Outcome.OK

    # -- the step ---------------------------------------------------------------------
    def apply_pressure(self) -> None:
        demoted = False
        if self._window_candidates:
            for row in list(self._window_candidates):
                req = self.state.requests.at(row)
                if req is None:
                    continue
                if req.prefilling:  # R1.a: wait for the prompt to complete
                    self._window_waiting.add(row)
                elif (req.residency == Residency.FULL and req.status == RequestStatus.ACTIVE
                      and self._window_gain(req) > 0):
                    demoted |= self.demote(req)
            self._window_candidates.clear()
        free = self.state.device_pool.get_num_free_blocks()
        if free < self.low_watermark_blocks or self.unmet_device_blocks:
            self._demote_for_pressure(free)
        elif (
            not demoted
            and free >= self.high_watermark_blocks
            and self.state.requests.non_full_rows
            and self.state.steps.step_id >= self._next_promotion_check_step
        ):
            # Re-evaluated at most every min_steps_between_transitions steps, so a step with
            # no pressure costs O(1) even when many requests stay MIXED.
            gap = max(1, self.state.config.min_steps_between_transitions)
            self._next_promotion_check_step = self.state.steps.step_id + gap
            self._promote_some(free)
        self.unmet_device_blocks = 0

    def _window_gain(self, req: Request) -> int:
        """Blocks a window demotion of ``req`` frees, net of its hot region: its pages that
        no other request pins (a shared prefix frees nothing), less the tail. A hot region
        as large as that would cost the pool and add host reads."""
        rows = np.array([req.row], dtype=np.int64)
        own = int(exclusive_pinned_pages(self.state.tables, rows, clean=False)[0])
        return own - ACTIVE_TAIL_PAGES - req.hot_blocks

    def _demote_for_pressure(self, free: int) -> None:
        need = self.high_watermark_blocks + self.unmet_device_blocks - free
        if need <= 0:
            return
        state = self.state
        rows, net = demotion_candidates(
            state.requests, state.tables, state.steps.step_id, state.config.min_steps_between_transitions
        )
        gained = 0
        for row, gain in zip(rows.tolist(), net.tolist()):
            if gained >= need:
                break
            if self.demote(state.requests.at(row)):
                gained += gain

    def demote(self, req: Request) -> bool:
        """FULL → MIXED: lease a hot region and release every releasable page.

        When the pool is too short for the hot region, which is when demotions are needed
        most, the request's clean pages are released first if that frees enough: they are
        on the host, so the hot region may take their blocks at once (those pages then
        read from the host). The tables predict what a release frees, but a block may be
        held by a reference they do not see (vLLM's own: an unmanaged request or a prefix
        hit outside the policy); if the pool is still short after the release, the pages
        are re-pinned and the demotion waits (back-pressure)."""
        free = self.state.device_pool.get_num_free_blocks()
        if req.hot_blocks > free:
            if req.hot_blocks > free + blocks_freed_by_release(self.state.tables, req.row):
                self.state.stats.num_device_backpressure += 1
                return False
            released = self.leases.release_all_releasable(req)
            if req.hot_blocks > self.state.device_pool.get_num_free_blocks():
                self.leases.undo_release(req, released)
                self.state.stats.num_device_backpressure += 1
                return False
        self.leases.lease_hot(req)
        self.state.requests.set_residency(req, Residency.MIXED)
        self.state.stats.num_demotions += 1
        self.leases.release_all_releasable(req)
        return True

    def _promote_some(self, free: int) -> None:
        state = self.state
        t = state.tables
        rows, cost = promotion_candidates(
            state.requests, t, state.steps.step_id, state.config.min_steps_between_transitions
        )
        started = 0
        restore_budget = state.config.max_restore_pages_per_step
        for row, c in zip(rows.tolist(), cost.tolist()):
            if started >= state.config.max_promotions_per_step:
                break
            req = state.requests.at(row)
            if req.promoting:
                continue
            if free - c < self.high_watermark_blocks:
                break
            host_only = int(np.count_nonzero(t.device_block[row, : t.num_pages[row]] < 0))
            if host_only > restore_budget:
                continue
            self._promote(req)
            restore_budget -= host_only
            free -= c
            started += 1

    def _promote(self, req: Request) -> None:
        """Start MIXED/NONE → FULL: re-pin released pages, restore host-only ones."""
        t = self.state.tables
        row = req.row
        n = int(t.num_pages[row])
        req.promoting = True
        self.state.requests.mark_transition(req)
        self.state.stats.num_promotions += 1
        for page in np.nonzero(~t.pinned[row, :n] & (t.device_block[row, :n] >= 0))[0]:
            self.leases.repin_page(req, int(page))
        host_only = [int(p) for p in np.nonzero((t.device_block[row, :n] < 0) & (t.pending[row, :n] < 0))[0]]
        if host_only:
            self.planner.plan_restore(req, host_only)
        self.leases.finish_promotion_if_complete(req)

    def prepare_prefill(self, req: Request) -> Outcome:
        """R1.b: make every page of a prefilling MIXED/NONE request resident (a forced
        promotion, whatever the watermarks). OK once FULL; WAIT_TRANSFER while restores are
        in flight (a restore completes, and its page reaches the worker's tables, before
        the request may prefill); WAIT_DEVICE (unmet demand noted) when the pool cannot
        take the restores now."""
        if req.residency == Residency.FULL:
            return Outcome.OK
        if req.promoting:
            return Outcome.WAIT_TRANSFER
        t = self.state.tables
        row = req.row
        n = int(t.num_pages[row])
        device = t.device_block[row, :n]
        num_released = int(np.count_nonzero(~t.pinned[row, :n] & (device >= 0)))
        num_restore = int(np.count_nonzero((device < 0) & (t.pending[row, :n] < 0)))
        # Re-pinning takes released (free-counted) blocks out of the pool first.
        if num_restore > self.state.device_pool.get_num_free_blocks() - num_released:
            self.state.stats.num_device_backpressure += 1
            self.unmet_device_blocks += num_restore
            return Outcome.WAIT_DEVICE
        self._promote(req)
        if req.residency == Residency.FULL:
            return Outcome.OK
        return Outcome.WAIT_TRANSFER
