"""The step's transfers: planning MIRROR / SPILL / RESTORE, and applying the worker's acks.

Planning opens a :class:`Transaction` (leases on what it reads and writes), marks the
pages it covers (``pending`` / ``mirror_inflight``) and adds its :class:`TransferSpec` to
the step. An ack batch is validated as a whole before any of it is applied
(:meth:`TransferPlanner.check_acks`); completion then marks host rows valid or pages
resident, and drops the leases (docs/core.md, "Transactions").

The mirror and its completion are vectorised over the scheduled rows; Python only visits
the pages that became clean, and (when a scheduled row is PARKED or MIXED/NONE) those that
may now be settled or released.
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.core.commands import Residency, TransferKind, TransferSpec, WorkerAcks
from vllm_hisparse.core.errors import ProtocolError
from vllm_hisparse.core.page_leases import PageLeases
from vllm_hisparse.core.page_table import range_mask, range_masks
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.request_table import Request, RequestStatus
from vllm_hisparse.core.transactions import Transaction, TransactionTable, TransferPhase
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES


class TransferPlanner:
    """Open transfers, the spill queue and the activations whose tail restore must be retried."""

    def __init__(self, state: PolicyState, leases: PageLeases) -> None:
        self.state = state
        self.leases = leases
        self.txns = TransactionTable()
        # Pages that need a whole-page spill: (row, serial, page) in insertion order.
        self._spill_queue: dict[tuple[int, int, int], None] = {}
        self._tail_retry_rows: set[int] = set()
        # Scratch for the duplicate-row check of a step's mirror (see _rows_unique).
        n = state.tables.num_rows
        self._row_scratch = np.zeros(n, dtype=np.int64)
        self._row_arange = np.arange(n, dtype=np.int64)

    def queue_spill(self, row: int, serial: int, page: int) -> None:
        self._spill_queue[(row, serial, page)] = None

    def forget_row(self, row: int) -> None:
        """The row's request ended (its queued spills are dropped when planned)."""
        self._tail_retry_rows.discard(row)

    # =====================================================================================
    # Planning
    # =====================================================================================
    def plan_step(self) -> None:
        """Plan this step's mirror (or sealed-page spills), tail restore retries and spills."""
        self._plan_mirror_or_seal()
        self._retry_tail_restores()
        self._plan_spills()

    def _plan_mirror_or_seal(self) -> None:
        """Turn this step's written ranges into a MIRROR (eager) or queue sealed pages."""
        written = self.state.steps.written_ranges()
        if written is None:
            return
        rows, starts, ends, serials = written
        t = self.state.tables
        bs = self.state.block_size
        keep = (t.serial[rows] == serials) & (ends > starts)
        if np.count_nonzero(keep) != keep.shape[0]:
            rows, starts, ends, serials = rows[keep], starts[keep], ends[keep], serials[keep]
        n = rows.shape[0]
        if n == 0:
            return
        first = t.page_of(starts)
        last = t.page_of(ends - 1)
        if np.count_nonzero(first != last) == 0:
            # Every range stays inside one page (decode): one entry per range.
            pr, pp, ps = rows, first, serials
            base = first * bs
            lo = starts - base
            hi = ends - base
        else:
            span = last - first + 1
            total = int(span.sum())
            pr = np.repeat(rows, span)
            ps = np.repeat(serials, span)
            offsets = np.arange(total) - np.repeat(np.cumsum(span) - span, span)
            pp = np.repeat(first, span) + offsets
            lo = np.maximum(np.repeat(starts, span), pp * bs) - pp * bs
            hi = np.minimum(np.repeat(ends, span), (pp + 1) * bs) - pp * bs
        if not self.state.config.eager_host_mirror:
            for i in np.nonzero(hi == bs)[0]:
                self.queue_spill(int(pr[i]), int(ps[i]), int(pp[i]))
            return
        # A row's ranges cover distinct pages, so (row, page) pairs repeat only if a row
        # was scheduled twice this step; then the unbuffered np.add.at is needed.
        unique = n <= t.num_rows and self._rows_unique(rows)
        flat = t.flat_index(pr, pp)
        txn = self.txns.open(
            TransferKind.MIRROR, self.state.steps.step_id,
            rows=pr, serials=ps, pages=pp, starts=lo, ends=hi, flat=flat, unique_pages=unique,
        )
        if unique:
            t.flat_mirror_inflight[flat] += 1
        else:
            np.add.at(t.mirror_inflight, (pr, pp), 1)
        self.state.steps.add_transfer(
            TransferSpec(
                transfer_id=txn.transfer_id,
                kind=int(TransferKind.MIRROR),
                after_forward=True,
                mirror_rows=rows.tolist(),
                mirror_starts=starts.tolist(),
                mirror_ends=ends.tolist(),
            )
        )

    def _rows_unique(self, rows: np.ndarray) -> bool:
        """True when no row appears twice (``len(rows) <= num_rows``)."""
        n = rows.shape[0]
        idx = self._row_arange[:n]
        self._row_scratch[rows] = idx
        return bool(np.array_equal(self._row_scratch[rows], idx))

    def _plan_spills(self) -> None:
        """Plan one SPILL transaction for queued pages that are ready, within the budget."""
        if not self._spill_queue:
            return
        t = self.state.tables
        budget = self.state.config.max_spill_pages_per_step
        rows, serials, pages, device, host, copied = [], [], [], [], [], []
        for key in list(self._spill_queue):
            if len(pages) >= budget:
                break
            row, serial, page = key
            if t.serial[row] != serial or page >= t.num_pages[row]:
                del self._spill_queue[key]
                continue
            if t.host_valid[row, page] or not t.pinned[row, page]:
                del self._spill_queue[key]
                continue
            if t.pending[row, page] >= 0 or t.mirror_inflight[row, page] > 0:
                continue  # wait for the transfer in flight
            req = self.state.requests.at(row)
            written = t.rows_written(row, page)
            if written < self.state.block_size and req.status != RequestStatus.PARKED:
                continue  # not sealed yet: the forward is still filling it
            del self._spill_queue[key]
            if t.host_covers_written(row, page):
                self.leases.settle_parked_page(req, page)
                continue
            rows.append(row)
            serials.append(serial)
            pages.append(page)
            device.append(int(t.device_block[row, page]))
            host.append(int(t.host_block[row, page]))
            copied.append(written)
        if not pages:
            return
        txn = self.txns.open(
            TransferKind.SPILL,
            self.state.steps.step_id,
            rows=np.array(rows, dtype=np.int64),
            serials=np.array(serials, dtype=np.int64),
            pages=np.array(pages, dtype=np.int64),
            device_blocks=np.array(device, dtype=np.int64),
            host_blocks=np.array(host, dtype=np.int64),
            num_rows_copied=np.array(copied, dtype=np.int64),
        )
        # Source and destination pinned for the life of the transfer.
        self.state.device_pool.touch(device)
        self.state.host_pool.touch(host)
        txn.held_device_until_enqueued = list(device)
        txn.held_host_until_done = list(host)
        t.pending[txn.rows, txn.pages] = txn.transfer_id
        self.state.stats.num_spill_pages += len(pages)
        self.state.steps.add_transfer(
            TransferSpec(
                transfer_id=txn.transfer_id,
                kind=int(TransferKind.SPILL),
                after_forward=True,
                device_blocks=device,
                host_blocks=host,
            )
        )

    def plan_restore(self, req: Request, pages: list[int]) -> None:
        """Allocate device blocks for host-only pages and plan their H2D restore."""
        device = self.state.device_pool.get_new_blocks(len(pages))
        host = [int(self.state.tables.host_block[req.row, p]) for p in pages]
        txn = self.open_restore(req, pages, device, host, into_pinned=False)
        # The new device blocks belong to the transfer until it completes.
        txn.held_device_until_done = list(device)
        req.num_restores_inflight += len(pages)

    def open_restore(self, req: Request, pages: list[int], device: list[int], host: list[int],
                     *, into_pinned: bool) -> Transaction:
        """One RESTORE (host → device, before the forward) of ``pages`` of ``req``: holds its
        host sources until done, marks the pages pending, queues the worker's spec."""
        self.state.host_pool.touch(host)
        txn = self.txns.open(
            TransferKind.RESTORE,
            self.state.steps.step_id,
            rows=np.full(len(pages), req.row, dtype=np.int64),
            serials=np.full(len(pages), req.serial, dtype=np.int64),
            pages=np.array(pages, dtype=np.int64),
            device_blocks=np.array(device, dtype=np.int64),
            host_blocks=np.array(host, dtype=np.int64),
            into_pinned=into_pinned,
        )
        txn.held_host_until_done = list(host)
        self.state.tables.pending[req.row, pages] = txn.transfer_id
        self.state.stats.num_restore_pages += len(pages)
        self.state.steps.add_transfer(
            TransferSpec(
                transfer_id=txn.transfer_id,
                kind=int(TransferKind.RESTORE),
                after_forward=False,
                device_blocks=list(device),
                host_blocks=list(host),
                # only a host-prefix load fills pages this step's forward reads; the others
                # are shown to the worker after their ack
                forward_reads=into_pinned,
            )
        )
        return txn

    def _retry_tail_restores(self) -> None:
        for row in list(self._tail_retry_rows):
            req = self.state.requests.at(row)
            if req is None or not req.needs_tail_restore_retry or req.status != RequestStatus.ACTIVATING:
                self._tail_retry_rows.discard(row)
                continue
            t = self.state.tables
            n = int(t.num_pages[row])
            missing = [p for p in range(max(0, n - ACTIVE_TAIL_PAGES), n)
                       if t.device_block[row, p] < 0 and t.pending[row, p] < 0]
            if len(missing) > self.state.device_pool.get_num_free_blocks():
                continue
            req.needs_tail_restore_retry = False
            self._tail_retry_rows.discard(row)
            if missing:
                self.plan_restore(req, missing)
            elif req.num_restores_inflight == 0:
                self.state.requests.set_status(req, RequestStatus.ACTIVE)

    # =====================================================================================
    # Requests that end with transfers in flight
    # =====================================================================================
    def take_over_ended(self, req: Request, publish: bool) -> None:
        """``req`` ends now: mirrors in flight over its row take leases on what they still
        touch, and (``publish``) pages whose host copy is on its way are published when it
        completes. Call before the request's own leases are returned."""
        t = self.state.tables
        row, serial = req.row, req.serial
        n = int(t.num_pages[row])
        mirrors_of_page: dict[int, list[tuple[Transaction, int]]] = {}
        for txn in self.txns.values():
            if txn.kind != TransferKind.MIRROR:
                continue
            hits = np.nonzero((txn.rows == row) & (txn.serials == serial))[0]
            for i in hits:
                page = int(txn.pages[i])
                mirrors_of_page.setdefault(page, []).append((txn, int(i)))
                if txn.phase == TransferPhase.PLANNED and t.pinned[row, page]:
                    block = int(t.device_block[row, page])
                    self.state.device_pool.touch([block])
                    txn.held_device_until_enqueued.append(block)
                host_block = int(t.host_block[row, page])
                self.state.host_pool.touch([host_block])
                txn.held_host_until_done.append(host_block)
        if not publish or not req.block_hashes:
            return
        # Publish durable pages; pages whose spill is in flight publish on completion.
        for page in range(min(n, len(req.block_hashes))):
            host_block = int(t.host_block[row, page])
            block_hash = req.block_hashes[page]
            if host_block < 0 or block_hash is None:
                continue
            if t.host_valid[row, page]:
                self._publish(host_block, block_hash)
            elif t.pending[row, page] >= 0 and t.pending[row, page] in self.txns:
                txn = self.txns.get(int(t.pending[row, page]))
                if txn.kind == TransferKind.SPILL:
                    txn.publish_on_completion[host_block] = block_hash
            elif len(mirrors_of_page.get(page, ())) == 1:
                # The page's last rows are on their way (the request ended right after
                # writing them): publish if that one mirror completes the page.
                txn, i = mirrors_of_page[page][0]
                rows = range_mask(int(txn.starts[i]), int(txn.ends[i]), t.num_mask_words)
                if np.all((t.host_mask[row, page] | rows) == t.full_mask):
                    txn.publish_on_completion[host_block] = block_hash

    def num_device_blocks_pending_release(self) -> int:
        """See :meth:`ResidencyPolicy.num_device_blocks_pending_release`."""
        if not len(self.txns):
            return 0
        t = self.state.tables
        requests = self.state.requests
        count = 0
        non_full = requests.non_full_rows
        if non_full:
            rows = np.fromiter(non_full, dtype=np.int64, count=len(non_full))
            status = requests.status[rows]
            parked = status == RequestStatus.PARKED
            promoting = np.fromiter(
                (requests.at(r).promoting for r in rows.tolist()), dtype=bool, count=rows.shape[0]
            )
            running = ((status == RequestStatus.ACTIVE) | (status == RequestStatus.ACTIVATING)) & ~promoting
            num_pages = t.num_pages[rows]
            sealed = np.minimum(num_pages - ACTIVE_TAIL_PAGES, t.num_tokens[rows] // self.state.block_size)
            limit = np.where(parked, num_pages, np.where(running, sealed, 0))
            width = int(limit.max()) if limit.shape[0] else 0
            if width > 0:
                cols = slice(0, width)
                in_range = np.arange(width)[None, :] < limit[:, None]
                inflight = (t.pending[rows, cols] >= 0) | (
                    (t.mirror_inflight[rows, cols] > 0) & ~t.mirror_failed[rows, cols]
                )
                count += int(
                    np.count_nonzero(in_range & t.pinned[rows, cols] & ~t.host_valid[rows, cols] & inflight)
                )
        orphaned: set[int] = set()
        for txn in self.txns.values():
            if txn.kind == TransferKind.MIRROR:
                # A mirror holds device leases only for requests that ended under it.
                orphaned.update(txn.held_device_until_enqueued)
                continue
            held = txn.held_device_until_enqueued if txn.kind == TransferKind.SPILL else txn.held_device_until_done
            if held:
                dead = ~self.live(txn)
                orphaned.update(txn.device_blocks[dead].tolist())
        return count + len(orphaned)

    def revoke_publication(self, transfer_id: int, host_block: int) -> None:
        """Transfer ``transfer_id`` (if still open) no longer publishes ``host_block``."""
        if transfer_id in self.txns:
            self.txns.get(transfer_id).publish_on_completion.pop(int(host_block), None)

    # =====================================================================================
    # Acknowledgements
    # =====================================================================================
    def check_acks(self, acks: WorkerAcks) -> None:
        """Raise ``ProtocolError`` (changing nothing) if any id of the batch cannot be
        applied in order: enqueued ids must be open and not enqueued before, completed and
        failed ids open and reported once."""
        enqueued: set[int] = set()
        for tid in acks.enqueued:
            tid = int(tid)
            txn = self.txns.get(tid)
            if txn.phase == TransferPhase.ENQUEUED or tid in enqueued:
                raise ProtocolError(f"transfer {tid} reported enqueued twice")
            enqueued.add(tid)
        closed: set[int] = set()
        for tid in list(acks.completed) + list(acks.failed):
            tid = int(tid)
            if tid in closed:
                raise ProtocolError(f"transfer {tid} is unknown or already finished")
            self.txns.get(tid)
            closed.add(tid)

    def apply_acks(self, acks: WorkerAcks) -> None:
        """Apply a checked batch: enqueued first, then completed, then failed."""
        for tid in acks.enqueued:
            txn = self.txns.mark_enqueued(int(tid))
            self._release_enqueued_leases(txn)
        for tid in acks.completed:
            txn = self.txns.close(int(tid))
            if txn.phase == TransferPhase.PLANNED:
                self._release_enqueued_leases(txn)
            self._on_completed(txn)
            self._release_done_leases(txn)
        for tid in acks.failed:
            txn = self.txns.close(int(tid))
            if txn.phase == TransferPhase.PLANNED:
                self._release_enqueued_leases(txn)
            self.state.stats.num_failed_transfers += 1
            self._on_failed(txn)
            self._release_done_leases(txn)

    def _release_enqueued_leases(self, txn: Transaction) -> None:
        if txn.held_device_until_enqueued:
            self.state.device_pool.free_blocks(txn.held_device_until_enqueued)
            txn.held_device_until_enqueued = []

    def _release_done_leases(self, txn: Transaction) -> None:
        if txn.held_device_until_done:
            self.state.device_pool.free_blocks(txn.held_device_until_done)
            txn.held_device_until_done = []
        if txn.held_host_until_done:
            self.state.host_pool.free(txn.held_host_until_done)
            txn.held_host_until_done = []

    def live(self, txn: Transaction) -> np.ndarray:
        """Mask of the transaction's entries whose request incarnation still owns the row."""
        return self.state.tables.serial[txn.rows] == txn.serials

    def _publish(self, host_block: int, block_hash) -> None:
        if self.state.host_pool.publish(host_block, block_hash):
            self.state.stats.num_published_pages += 1

    def _on_completed(self, txn: Transaction) -> None:
        t = self.state.tables
        leases = self.leases
        live = self.live(txn)
        if txn.kind == TransferKind.MIRROR:
            if txn.unique_pages:
                self._on_mirror_completed(txn, live)
            else:
                self._on_mirror_completed_repeated(txn, live)
            # Pages of requests that ended while this mirror completed them.
            for host_block, block_hash in txn.publish_on_completion.items():
                self._publish(host_block, block_hash)
            return
        for i in np.nonzero(live)[0]:
            row, page = int(txn.rows[i]), int(txn.pages[i])
            if t.pending[row, page] != txn.transfer_id:
                continue
            t.pending[row, page] = -1
            req = self.state.requests.at(row)
            if txn.kind == TransferKind.SPILL:
                t.host_mask[row, page] |= range_mask(0, int(txn.num_rows_copied[i]), t.num_mask_words)
                if not t.host_valid[row, page] and np.all(t.host_mask[row, page] == t.full_mask):
                    leases.mark_clean(req, page)
                elif req.status == RequestStatus.PARKED:
                    leases.settle_parked_page(req, page)
                elif t.host_valid[row, page] and req.residency != Residency.FULL and not req.promoting:
                    leases.try_release(req, page)
            elif txn.into_pinned:  # a host-prefix load: the page already owns its block
                if req.status == RequestStatus.PARKED:
                    leases.settle_parked_page(req, page)
            else:  # RESTORE: the transfer's device lease becomes the page's.
                block = int(txn.device_blocks[i])
                txn.held_device_until_done.remove(block)
                t.device_block[row, page] = block
                t.pinned[row, page] = True
                t.num_pinned[row] += 1
                if t.host_valid[row, page]:
                    t.num_clean_pinned[row] += 1
                self.state.steps.emit_page(row, page, block, int(t.host_block[row, page]))
                req.num_restores_inflight -= 1
                if req.status == RequestStatus.PARKED:
                    leases.settle_parked_page(req, page)
                elif req.residency != Residency.FULL and not req.promoting:
                    leases.try_release(req, page)
                self._after_restores(req)
        if txn.kind == TransferKind.SPILL and txn.publish_on_completion:
            # Pages of ended requests: the copy is durable now, so the prefix may be shared,
            # but only if the spill copied a whole page (a preempted request spills partial
            # pages, and the request may have sealed the page after the spill was planned).
            for i, host_block in enumerate(txn.host_blocks.tolist()):
                block_hash = txn.publish_on_completion.get(host_block)
                if block_hash is None or txn.num_rows_copied[i] != self.state.block_size:
                    continue
                self._publish(host_block, block_hash)

    def _on_mirror_completed(self, txn: Transaction, live: np.ndarray) -> None:
        """MIRROR completion when no (row, page) repeats: plain gathers and scatters over
        the flat views, and Python only for pages that became clean or may be released."""
        t = self.state.tables
        requests = self.state.requests
        if np.count_nonzero(live) == live.shape[0]:
            r, p, flat, lo, hi = txn.rows, txn.pages, txn.flat, txn.starts, txn.ends
        else:
            r, p, flat = txn.rows[live], txn.pages[live], txn.flat[live]
            lo, hi = txn.starts[live], txn.ends[live]
        if r.shape[0] == 0:
            return
        inflight = t.flat_mirror_inflight[flat] - 1
        t.flat_mirror_inflight[flat] = inflight
        merged = t.flat_host_mask[flat] | range_masks(lo, hi, t.num_mask_words)
        t.flat_host_mask[flat] = merged
        valid = t.flat_host_valid[flat]
        if t.num_mask_words == 1:
            full = (merged[:, 0] == t.full_mask[0]) & ~valid
        else:
            full = np.all(merged == t.full_mask, axis=1) & ~valid
        for i in full.nonzero()[0].tolist():
            self.leases.mark_clean(requests.at(int(r[i])), int(p[i]))
        # The rest only concerns parked or MIXED/NONE requests (none in a FULL steady state).
        # Their pages' host_valid and mirror counts are as gathered above: marking other
        # pages clean, settling or releasing pages changes neither.
        if np.count_nonzero(requests.watch[r]) == 0:
            return
        parked = requests.status[r] == RequestStatus.PARKED
        non_full = requests.residency[r] != Residency.FULL
        # Pages of parked requests may now be released, and pages that were waiting for
        # this mirror to end may now be released or spilled.
        for i in (parked & ~full).nonzero()[0].tolist():
            self.leases.settle_parked_page(requests.at(int(r[i])), int(p[i]))
        # Clean pages of MIXED/NONE requests that only waited for this mirror to end.
        waiting = non_full & ~full & ~parked & valid & (inflight == 0)
        for i in waiting.nonzero()[0].tolist():
            req = requests.at(int(r[i]))
            if req.status == RequestStatus.ACTIVE and not req.promoting:
                self.leases.try_release(req, int(p[i]))

    def _on_mirror_completed_repeated(self, txn: Transaction, live: np.ndarray) -> None:
        """MIRROR completion when a (row, page) may repeat (a row scheduled twice in the
        planning step): unbuffered ``ufunc.at`` updates, then per-entry handling."""
        t = self.state.tables
        requests = self.state.requests
        r, p = txn.rows[live], txn.pages[live]
        if r.shape[0] == 0:
            return
        np.subtract.at(t.mirror_inflight, (r, p), 1)
        masks = range_masks(txn.starts[live], txn.ends[live], t.num_mask_words)
        np.bitwise_or.at(t.host_mask, (r, p), masks)
        full = np.all(t.host_mask[r, p] == t.full_mask, axis=1) & ~t.host_valid[r, p]
        for i in np.nonzero(full)[0]:
            row, page = int(r[i]), int(p[i])
            if not t.host_valid[row, page]:  # a repeated entry is marked clean once
                self.leases.mark_clean(requests.at(row), page)
        parked = requests.status[r] == RequestStatus.PARKED
        for i in np.nonzero(parked & ~full)[0]:
            self.leases.settle_parked_page(requests.at(int(r[i])), int(p[i]))
        waiting = (
            ~full
            & ~parked
            & t.host_valid[r, p]
            & (t.mirror_inflight[r, p] == 0)
            & (requests.residency[r] != Residency.FULL)
        )
        for i in np.nonzero(waiting)[0]:
            req = requests.at(int(r[i]))
            if req.status == RequestStatus.ACTIVE and not req.promoting:
                self.leases.try_release(req, int(p[i]))

    def _on_failed(self, txn: Transaction) -> None:
        t = self.state.tables
        live = self.live(txn)
        if txn.kind == TransferKind.MIRROR:
            r, p, s = txn.rows[live], txn.pages[live], txn.serials[live]
            if txn.unique_pages:
                t.flat_mirror_inflight[txn.flat[live]] -= 1
            else:
                np.subtract.at(t.mirror_inflight, (r, p), 1)
            t.mirror_failed[r, p] = True
            for i in (~t.host_valid[r, p]).nonzero()[0].tolist():
                self.queue_spill(int(r[i]), int(s[i]), int(p[i]))
            return
        for i in np.nonzero(live)[0]:
            row, page = int(txn.rows[i]), int(txn.pages[i])
            if t.pending[row, page] != txn.transfer_id:
                continue
            t.pending[row, page] = -1
            req = self.state.requests.at(row)
            if txn.kind == TransferKind.SPILL:
                # A failed copy may have scribbled over the host page: trust none of its rows.
                # The page keeps its resident copy; try again later.
                if not t.host_valid[row, page]:
                    t.host_mask[row, page] = 0
                self.queue_spill(row, req.serial, page)
            elif txn.into_pinned:
                # A host-prefix load the forward already read: the engine learns of it from
                # the same ack (it fails the request); the host copy itself is still good.
                self.state.stats.num_failed_prefix_load_pages += 1
            else:
                req.num_restores_inflight -= 1
                if req.promoting:
                    # Give up this promotion (it may be chosen again later) and hand back the
                    # pages it had re-pinned.
                    req.promoting = False
                    if req.status == RequestStatus.ACTIVE:
                        self.leases.release_all_releasable(req)
                if req.status == RequestStatus.ACTIVATING:
                    req.needs_tail_restore_retry = True
                    self._tail_retry_rows.add(row)

    def _after_restores(self, req: Request) -> None:
        if req.num_restores_inflight:
            return
        if req.status == RequestStatus.ACTIVATING and not req.needs_tail_restore_retry:
            self.state.requests.set_status(req, RequestStatus.ACTIVE)
        if req.promoting:
            self.leases.finish_promotion_if_complete(req)
