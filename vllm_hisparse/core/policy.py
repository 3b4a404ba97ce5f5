"""The residency policy: which pages of which request live where, and the transfers that move them.

State machine per request (``Residency``)::

              free blocks < low watermark (chosen by the selection rule)
              or pages > admission window (once the prompt is complete)
      FULL  ---------------------------------------------->  MIXED
        ^   <----------------------------------------------    |
        |     free blocks >= high watermark after the move,     |
        |     restores completed, hot lease returned            |
        |                                                       |
        +---- (same promotion path) ----  NONE  <--- import / resume / host prefix hit

Request status (``RequestStatus``): ACTIVE (schedulable) · ACTIVATING (tail restores in
flight) · PARKED (host-backed, no hot region: preempted, or waiting for device blocks after
an import or host prefix hit) · IMPORTING (host blocks handed to an external writer).

Selection rule for FULL → MIXED (under pressure): among ACTIVE FULL requests that have not
changed state in the last ``min_steps_between_transitions`` steps, score each by
``reclaimable / hot_blocks`` where ``reclaimable = num_clean_pinned - ACTIVE_TAIL_PAGES``
(clean pages that could be released at once; the tail estimate is conservative), keep only
those with ``reclaimable > hot_blocks`` (a net gain), and take them in descending score until
the summed net gain reaches ``high_watermark - free``. Never every request: only as many as
the deficit needs, and never one whose move would cost blocks.

Requirement R1 (docs/core.md): a prefilling request (``set_prefilling``) is never demoted
and never releases a page; one that is MIXED/NONE is promoted at once and is not
schedulable (``WAIT_TRANSFER``) until every page is resident in the worker's tables.

Promotion MIXED/NONE → FULL (hysteresis): when free blocks are at or above the high watermark,
take non-FULL requests cheapest first (``num_pages - num_pinned`` blocks to re-pin or restore)
while ``free - cost >= high_watermark``. Released-but-unreused pages are re-pinned without a
copy; host-only pages are restored; the hot lease is returned once every page is pinned.

All per-step work is proportional to what changed: scheduling, mirroring and their
acknowledgements are vectorised over the scheduled rows; Python loops only run over pages
that crossed a boundary (new, sealed, clean, released, reused) and over requests that change
state. Pressure selection is a numpy pass over rows, done only while under pressure.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass, field
from enum import IntEnum
from typing import AbstractSet, Callable, Hashable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from vllm_hisparse.core.commands import (
    HotLease,
    Residency,
    ResidencyChange,
    StepCommand,
    TransferKind,
    TransferSpec,
    WorkerAcks,
)
from vllm_hisparse.core.device_pool import DevicePool
from vllm_hisparse.core.errors import DevicePoolExhausted, HostPoolExhausted, ProtocolError
from vllm_hisparse.core.host_pool import HostBlockPool
from vllm_hisparse.core.page_table import ACTIVE_TAIL_PAGES, PageTable, PageTables, cdiv, range_mask, range_masks
from vllm_hisparse.core.transactions import Transaction, TransactionTable, TransferPhase


class RequestStatus(IntEnum):
    """Scheduling status of a request known to the policy."""

    ACTIVE = 0
    ACTIVATING = 1
    PARKED = 2
    IMPORTING = 3


class Outcome(IntEnum):
    """Result of an event that may meet back-pressure."""

    OK = 0
    WAIT_DEVICE = 1
    """Not enough free device blocks; nothing changed. Retry later (or preempt someone)."""
    WAIT_HOST = 2
    """Not enough free or evictable host blocks; nothing changed. The request waits."""
    WAIT_TRANSFER = 3
    """The request is not schedulable until restores in flight complete."""
    RECOMPUTE = 4
    """An import failed; the request starts from zero tokens and must be computed."""


@dataclass
class PolicyConfig:
    """Knobs of the residency policy.

    Args:
        block_size: tokens per page (vLLM block size).
        max_num_rows: number of state rows (max concurrent requests known to the policy).
        max_pages_per_request: ``cdiv(max_model_len, block_size)``.
        device_buffer_size_rows: default hot rows per request; a multiple of ``block_size``.
        low_watermark_blocks: below this many free device blocks, demote (default
            ``max(2 * hot_blocks, 5 % of the pool)``).
        high_watermark_blocks: target for demotions and floor for promotions (default
            ``max(low + hot_blocks, 10 % of the pool)``).
        admission_window_pages: a FULL request holding more pages than this is demoted
            (chunked prefill outgrowing what admission reserved); None = no limit.
        eager_host_mirror: mirror every written row to host after each forward; otherwise
            spill whole pages once sealed.
        max_spill_pages_per_step / max_restore_pages_per_step: transfer budget per step.
        max_promotions_per_step: promotions started per step.
        min_steps_between_transitions: a request that changed residency waits this many
            steps before it may change again (second half of the hysteresis).
    """

    block_size: int
    max_num_rows: int
    max_pages_per_request: int
    device_buffer_size_rows: int
    low_watermark_blocks: int | None = None
    high_watermark_blocks: int | None = None
    admission_window_pages: int | None = None
    eager_host_mirror: bool = True
    max_spill_pages_per_step: int = 4096
    max_restore_pages_per_step: int = 1024
    max_promotions_per_step: int = 4
    min_steps_between_transitions: int = 8

    def __post_init__(self) -> None:
        if self.device_buffer_size_rows <= 0 or self.device_buffer_size_rows % self.block_size:
            raise ValueError(
                f"device_buffer_size_rows={self.device_buffer_size_rows} must be a positive "
                f"multiple of block_size={self.block_size}"
            )

    @property
    def hot_blocks_per_request(self) -> int:
        """Device blocks in a default hot region lease."""
        return self.device_buffer_size_rows // self.block_size


@dataclass
class AddResult:
    """What ``add_request`` decided."""

    row: int
    num_host_hit_tokens: int
    outcome: Outcome


@dataclass
class PolicyStats:
    """Monotonic counters (for metrics and tests)."""

    num_demotions: int = 0
    num_promotions: int = 0
    num_device_backpressure: int = 0
    num_host_backpressure: int = 0
    num_pages_released: int = 0
    num_pages_reused: int = 0
    num_pages_repinned: int = 0
    num_spill_pages: int = 0
    num_restore_pages: int = 0
    num_failed_transfers: int = 0
    num_host_prefix_hit_pages: int = 0
    num_published_pages: int = 0
    num_prefix_load_pages: int = 0
    num_failed_prefix_load_pages: int = 0


@dataclass
class _Request:
    request_id: str
    row: int
    serial: int
    status: RequestStatus
    residency: Residency
    hot_blocks: int
    block_hashes: list = field(default_factory=list)
    hot_block_ids: list[int] = field(default_factory=list)
    promoting: bool = False
    num_restores_inflight: int = 0
    needs_tail_restore_retry: bool = False
    last_transition_step: int = -(10**9)
    prefilling: bool = False


class _SetView(Set):
    """A live, read-only view of a set (no copy; it follows the set's changes)."""

    __slots__ = ("_items",)

    def __init__(self, items: set) -> None:
        self._items = items

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"


class ResidencyPolicy:
    """Scheduler-side residency coordinator (engine-agnostic).

    Per engine step, the caller:

    1. ``apply_acks(acks)`` with what the worker reported;
    2. handles events (``add_request``, ``finish``, ``abort``, ``preempt``, ``resume``,
       ``begin_import`` / ``finish_import``) and calls ``schedule`` (or the batched
       ``schedule_rows``) for every request that runs this step; a non-OK outcome means the
       request does not run this step and nothing was changed for it;
    3. ``build_step()`` → the :class:`StepCommand` for the worker.
    """

    def __init__(self, config: PolicyConfig, device_pool: DevicePool, host_pool: HostBlockPool):
        self.config = config
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.block_size = config.block_size
        self.tables = PageTables(config.max_num_rows, config.max_pages_per_request, config.block_size)
        hot = config.hot_blocks_per_request
        num_device_blocks = device_pool.num_blocks
        self.low_watermark_blocks = (
            config.low_watermark_blocks
            if config.low_watermark_blocks is not None
            else max(2 * hot, cdiv(num_device_blocks, 20))
        )
        self.high_watermark_blocks = (
            config.high_watermark_blocks
            if config.high_watermark_blocks is not None
            else max(self.low_watermark_blocks + hot, cdiv(num_device_blocks, 10))
        )
        if self.high_watermark_blocks < self.low_watermark_blocks:
            raise ValueError("high_watermark_blocks must be >= low_watermark_blocks")
        self.stats = PolicyStats()
        self._step_id = 0
        self._next_serial = 1
        self._requests: dict[str, _Request] = {}
        self._row_request: list[_Request | None] = [None] * config.max_num_rows
        self._free_rows: list[int] = list(range(config.max_num_rows - 1, -1, -1))
        # Per-row vectors used by vectorised selection.
        n = config.max_num_rows
        self._row_status = np.full(n, -1, dtype=np.int8)
        self._row_residency = np.full(n, -1, dtype=np.int8)
        self._row_hot_blocks = np.zeros(n, dtype=np.int64)
        self._row_last_transition = np.full(n, -(10**9), dtype=np.int64)
        # Rows whose mirror acks may release pages: PARKED status or MIXED/NONE residency.
        self._row_watch = np.zeros(n, dtype=bool)
        # Requirement R1 (docs/core.md): rows whose prompt is not fully computed, and rows
        # ``schedule_rows`` must send through the per-request path (not ACTIVE, or a
        # prefilling request that is not FULL yet). Free rows are gated.
        self._row_prefilling = np.zeros(n, dtype=bool)
        self._row_gate = np.ones(n, dtype=bool)
        self._txns = TransactionTable()
        # Released device block -> [(row, serial, page)] whose copy it still holds.
        self._released_owner: dict[int, list[tuple[int, int, int]]] = {}
        # Pages that need a whole-page spill: (row, serial, page) in insertion order.
        self._spill_queue: dict[tuple[int, int, int], None] = {}
        self._window_candidates: set[int] = set()
        # Rows that crossed the admission window while prefilling: demoted once the prompt
        # is complete (``set_prefilling(..., False)``), never before (R1.a).
        self._window_waiting: set[int] = set()
        self._non_full_rows: set[int] = set()
        self._non_full_view = _SetView(self._non_full_rows)
        self._tail_retry_rows: set[int] = set()
        self._next_promotion_check_step = 0
        self._unmet_device_blocks = 0
        # Scratch for the duplicate-row check of a step's mirror (see _plan_mirror_or_seal).
        self._row_scratch = np.zeros(n, dtype=np.int64)
        self._row_arange = np.arange(n, dtype=np.int64)
        bs = self.block_size
        # Page arithmetic on arrays: a shift when the block size is a power of two (integer
        # division is several times slower in numpy).
        self._page_shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1
        self._reset_step_buffers()

    # =====================================================================================
    # Queries
    # =====================================================================================
    @property
    def step_id(self) -> int:
        """Id the next ``build_step`` command will carry."""
        return self._step_id

    @property
    def num_requests(self) -> int:
        """Requests known to the policy."""
        return len(self._requests)

    @property
    def num_open_transfers(self) -> int:
        """Transactions planned and not yet completed or failed."""
        return len(self._txns)

    def has_request(self, request_id: str) -> bool:
        """True when the policy knows ``request_id``."""
        return request_id in self._requests

    def row_of(self, request_id: str) -> int:
        """State row of a request."""
        return self._req(request_id).row

    def residency(self, request_id: str) -> Residency:
        """Residency state of a request."""
        return self._req(request_id).residency

    def status(self, request_id: str) -> RequestStatus:
        """Scheduling status of a request."""
        return self._req(request_id).status

    def is_ready(self, request_id: str) -> bool:
        """True when the request may be scheduled."""
        return self._req(request_id).status == RequestStatus.ACTIVE

    def hot_block_ids(self, request_id: str) -> list[int]:
        """Device blocks of the request's hot region lease (empty when it has none)."""
        return list(self._req(request_id).hot_block_ids)

    def page_table(self, request_id: str) -> PageTable:
        """Snapshot of a request's page table."""
        return self.tables.view(self._req(request_id).row)

    def request_ids(self) -> list[str]:
        """Ids of every known request."""
        return list(self._requests)

    @property
    def non_full_rows(self) -> AbstractSet[int]:
        """State rows whose request is MIXED or NONE (any status), as a live read-only view.

        No copy is made: the view follows the policy's changes, so take ``set(...)`` of it
        before iterating across calls that may change residency.
        """
        return self._non_full_view

    def num_device_blocks_pending_release(self) -> int:
        """Device blocks the policy will give back once the transfers now in flight are
        acknowledged (successfully), with no other event in between.

        Two sources:

        * pages released on completion: a pinned page that is not clean and has a spill or
          a (not failed) mirror in flight, where the completion makes it releasable:
          a sealed non-tail page of a running MIXED/NONE request that is not being
          promoted, or any page of a PARKED request;
        * leases that transfers hold for requests that ended meanwhile (mirrors and spills
          still reading a finished request's blocks, restores into an aborted request).

        Counted in the policy's device blocks (one per page). A block another holder also
        leases (a device prefix shared outside the policy) is counted although it does not
        become free. Cost: O(non-FULL rows x pages + open transfers); meant for the rare
        moment an allocation failed (vLLM's ``has_pending_block_frees``), not every step.
        """
        if not len(self._txns):
            return 0
        t = self.tables
        count = 0
        if self._non_full_rows:
            rows = np.fromiter(self._non_full_rows, dtype=np.int64, count=len(self._non_full_rows))
            status = self._row_status[rows]
            parked = status == RequestStatus.PARKED
            promoting = np.fromiter(
                (self._row_request[r].promoting for r in rows.tolist()), dtype=bool, count=rows.shape[0]
            )
            running = ((status == RequestStatus.ACTIVE) | (status == RequestStatus.ACTIVATING)) & ~promoting
            num_pages = t.num_pages[rows]
            sealed = np.minimum(num_pages - ACTIVE_TAIL_PAGES, t.num_tokens[rows] // self.block_size)
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
        for txn in self._txns.values():
            if txn.kind == TransferKind.MIRROR:
                # A mirror holds device leases only for requests that ended under it.
                orphaned.update(txn.held_device_until_enqueued)
                continue
            held = txn.held_device_until_enqueued if txn.kind == TransferKind.SPILL else txn.held_device_until_done
            if held:
                dead = ~self._live(txn)
                orphaned.update(txn.device_blocks[dead].tolist())
        return count + len(orphaned)

    def lookup_host_prefix(self, block_hashes: Sequence[Hashable]) -> int:
        """Pages of ``block_hashes`` published in the host pool (no lease taken)."""
        return len(self.host_pool.lookup(block_hashes[: self.config.max_pages_per_request]))

    def acquire_host_prefix(self, block_hashes: Sequence[Hashable], max_pages: int | None = None) -> list[int]:
        """Lease the longest published host prefix of ``block_hashes`` (at most ``max_pages``).

        Returns its host blocks, one lease each, owned by the caller until it hands them to
        :meth:`adopt_host_prefix` or gives them back with :meth:`release_host_prefix`.
        The lease keeps the blocks from being evicted between the engine's lookup and
        its allocation."""
        limit = self.config.max_pages_per_request
        if max_pages is not None:
            limit = min(limit, max(0, int(max_pages)))
        hits = self.host_pool.lookup(block_hashes[:limit])
        if hits:
            self.host_pool.touch(hits)
        return hits

    def release_host_prefix(self, host_block_ids: Sequence[int]) -> None:
        """Give back leases taken by :meth:`acquire_host_prefix` and never adopted."""
        self.host_pool.free(host_block_ids)

    def adopt_host_prefix(
        self,
        request_id: str,
        device_block_ids: Sequence[int],
        host_block_ids: Sequence[int],
        first_load_page: int,
    ) -> int:
        """A new request starts with ``n = len(device_block_ids)`` full pages of host prefix.

        The engine allocated (and pins) ``device_block_ids[p]`` for page ``p``; the policy
        takes over one lease of each, as for growth. ``host_block_ids`` are the pages'
        published host blocks, leased by :meth:`acquire_host_prefix` (the leases pass to
        the request). Pages ``[0, first_load_page)`` already hold their KV on the device
        (the engine's own prefix cache); pages ``[first_load_page, n)`` are loaded by one
        RESTORE into their pinned blocks, planned before this step's forward, which reads
        them (the worker fences the forward behind it). The request is FULL at once, and
        every page is clean, so nothing is mirrored.

        Call it on a request just added, before it is scheduled. Returns the RESTORE's
        transfer id (-1 when every page is already on the device).
        """
        req = self._req(request_id)
        t = self.tables
        row = req.row
        n = len(device_block_ids)
        if req.status != RequestStatus.ACTIVE or req.residency != Residency.FULL or t.num_tokens[row] != 0:
            raise ProtocolError(f"request {request_id!r}: a host prefix is adopted by a new, empty request")
        if len(host_block_ids) != n or not 0 <= first_load_page <= n:
            raise ProtocolError(
                f"request {request_id!r}: {n} device blocks, {len(host_block_ids)} host blocks and "
                f"first load page {first_load_page} do not describe one prefix"
            )
        if n > self.config.max_pages_per_request:
            raise ProtocolError(f"request {request_id!r}: prefix of {n} pages exceeds max_pages_per_request")
        if n == 0:
            return -1
        device = [int(b) for b in device_block_ids]
        host = [int(b) for b in host_block_ids]
        t.device_block[row, :n] = device
        t.pinned[row, :n] = True
        t.num_pinned[row] = n
        t.host_block[row, :n] = host
        t.host_mask[row, :n] = t.full_mask
        t.host_valid[row, :n] = True
        t.num_clean_pinned[row] = n
        t.num_pages[row] = n
        t.num_tokens[row] = n * self.block_size
        for page in range(n):
            self._emit_page(row, page, device[page], host[page])
        pages = list(range(first_load_page, n))
        if not pages:
            return -1
        txn = self._open_restore(req, pages, device[first_load_page:], host[first_load_page:],
                                 into_pinned=True)
        self.stats.num_prefix_load_pages += len(pages)
        return txn.transfer_id

    def set_block_hashes(self, request_id: str, first_page: int, block_hashes: Sequence[Hashable | None]) -> int:
        """Give pages ``first_page ..`` their prefix identity (``None`` = unknown).

        A page is published in the host pool once it has an identity and is clean
        (whichever comes last), so the engine hands identities over only when the host
        holds everything a later hit must load (e.g. the indexer's page too). Returns
        how many pages this call published."""
        req = self._req(request_id)
        end = int(first_page) + len(block_hashes)
        if first_page < 0 or end > self.config.max_pages_per_request:
            raise ProtocolError(f"request {request_id!r}: block hashes for pages [{first_page}, {end})")
        if len(req.block_hashes) < end:
            req.block_hashes.extend([None] * (end - len(req.block_hashes)))
        t = self.tables
        row = req.row
        published = 0
        for i, block_hash in enumerate(block_hashes):
            page = int(first_page) + i
            req.block_hashes[page] = block_hash
            if block_hash is None or page >= t.num_pages[row] or not t.host_valid[row, page]:
                continue
            if self.host_pool.publish(int(t.host_block[row, page]), block_hash):
                published += 1
        self.stats.num_published_pages += published
        return published

    def revoke_block_hashes(self, transfer_id: int, pages: Sequence[tuple[str, int, int, int]]) -> None:
        """Withdraw identities given with :meth:`set_block_hashes` before their host copy
        was known to be complete (the engine learned that part of it failed).

        ``pages``: ``(request id, serial, page, host block)``; the serial (see
        :meth:`serial_of`) ignores a request id reused by a later incarnation. Pages of
        ended requests are no longer published by transfer ``transfer_id``'s completion.
        Revoke before applying the acks that complete the transfer."""
        txn = self._txns.get(int(transfer_id)) if int(transfer_id) in self._txns else None
        for request_id, serial, page, host_block in pages:
            req = self._requests.get(request_id)
            if req is not None and req.serial == serial and page < len(req.block_hashes):
                req.block_hashes[page] = None
            if txn is not None:
                txn.publish_on_completion.pop(int(host_block), None)

    def serial_of(self, request_id: str) -> int:
        """The incarnation number of a live request (unique over the policy's life)."""
        return self._req(request_id).serial

    def _hash_of(self, req: _Request, page: int) -> Hashable | None:
        return req.block_hashes[page] if page < len(req.block_hashes) else None

    def can_admit(self, num_prompt_tokens: int, num_host_hit_pages: int = 0, hot_rows: int | None = None) -> Outcome:
        """Whether a new request fits device, host and hot capacity together.

        Device: a request computed from scratch needs its first admission window of pages;
        one with host hits needs its hot region plus the tail pages. Host: every page not
        served by a hit. Nothing is reserved; ``schedule`` re-checks when it allocates.
        """
        pages = cdiv(int(num_prompt_tokens), self.block_size)
        hot = self._hot_blocks_for(hot_rows)
        if num_host_hit_pages > 0:
            device_needed = hot + min(ACTIVE_TAIL_PAGES, num_host_hit_pages) + max(0, pages - num_host_hit_pages)
        else:
            window = self.config.admission_window_pages
            device_needed = min(pages, window) if window is not None else pages
        if device_needed > self.device_pool.get_num_free_blocks():
            return Outcome.WAIT_DEVICE
        if pages - num_host_hit_pages > self.host_pool.num_allocatable_blocks:
            return Outcome.WAIT_HOST
        return Outcome.OK

    # =====================================================================================
    # Events
    # =====================================================================================
    def add_request(
        self,
        request_id: str,
        *,
        block_hashes: Sequence[Hashable] = (),
        state_row: int | None = None,
        hot_rows: int | None = None,
        prefilling: bool = False,
    ) -> AddResult:
        """Register a request.

        Args:
            block_hashes: prefix identities of the prompt's full pages. The longest prefix
                published in the host pool is taken over (shared host blocks); the request
                then starts host-backed (NONE) and is activated at once if the device allows
                (``outcome``), else stays PARKED until ``resume``.
            state_row: the engine's state row for the request; None = the policy picks one.
            hot_rows: hot region size for this request (default ``device_buffer_size_rows``).
            prefilling: the request still has prompt tokens to compute (see
                :meth:`set_prefilling`). With a host prefix hit, the outcome is OK only
                once every page of the hit is resident (R1.b).
        """
        if request_id in self._requests:
            raise ProtocolError(f"request {request_id!r} added twice")
        row = self._take_row(state_row)
        serial = self._next_serial
        self._next_serial += 1
        req = _Request(
            request_id=request_id,
            row=row,
            serial=serial,
            status=RequestStatus.ACTIVE,
            residency=Residency.FULL,
            hot_blocks=self._hot_blocks_for(hot_rows),
            block_hashes=list(block_hashes),
            prefilling=bool(prefilling),
        )
        self._requests[request_id] = req
        self._row_request[row] = req
        self._row_prefilling[row] = req.prefilling
        t = self.tables
        t.serial[row] = serial
        self._row_hot_blocks[row] = req.hot_blocks
        self._set_status(req, RequestStatus.ACTIVE)
        self._set_residency(req, Residency.FULL, emit=False)

        hits = self.host_pool.lookup(req.block_hashes[: self.config.max_pages_per_request])
        if not hits:
            return AddResult(row=row, num_host_hit_tokens=0, outcome=Outcome.OK)
        self.host_pool.touch(hits)
        k = len(hits)
        t.host_block[row, :k] = hits
        t.host_mask[row, :k] = t.full_mask
        t.host_valid[row, :k] = True
        t.num_pages[row] = k
        t.num_tokens[row] = k * self.block_size
        for page, host_block in enumerate(hits):
            self._emit_page(row, page, -1, host_block)
        self.stats.num_host_prefix_hit_pages += k
        self._set_status(req, RequestStatus.PARKED)
        self._set_residency(req, Residency.NONE)
        outcome = self.resume(request_id)
        return AddResult(row=row, num_host_hit_tokens=k * self.block_size, outcome=outcome)

    def schedule(self, request_id: str, num_new_tokens: int, device_block_ids: Sequence[int] | None = None) -> Outcome:
        """Reserve pages for ``num_new_tokens`` positions the next forward writes.

        New pages get a device block (from ``device_block_ids`` when the engine already
        allocated them, the policy taking over one lease each; else from the device pool)
        and a host block. All or nothing: on back-pressure nothing changes.
        """
        req = self._req(request_id)
        if req.status != RequestStatus.ACTIVE:
            if req.status in (RequestStatus.ACTIVATING,):
                return Outcome.WAIT_TRANSFER
            raise ProtocolError(f"request {request_id!r} scheduled while {req.status.name}")
        if req.prefilling and req.residency != Residency.FULL:
            outcome = self._prepare_prefill(req)
            if outcome != Outcome.OK:
                return outcome
        return self._grow(req, int(num_new_tokens), device_block_ids, record=True)

    def schedule_rows(
        self,
        rows: np.ndarray,
        num_new_tokens: np.ndarray,
        device_blocks_for: Callable[[int, int, int], Sequence[int]] | None = None,
    ) -> np.ndarray:
        """Batched ``schedule`` by state row (each row at most once). Returns Outcome codes.

        Rows that stay inside their current last page take a vectorised fast path; only rows
        that need new pages go through per-request allocation. An engine that allocates
        its own pages passes ``device_blocks_for(row, first_new_page, num_new_pages)``,
        called for each such row, returning the device block of each new page (the
        ``device_block_ids`` of ``schedule``); without it the policy allocates them.
        """
        rows = np.asarray(rows, dtype=np.int64)
        counts = np.asarray(num_new_tokens, dtype=np.int64)
        t = self.tables
        outcome = np.zeros(rows.shape[0], dtype=np.int8)
        # Gated rows (not ACTIVE, or prefilling and not FULL: R1.b) take the per-request
        # path below; everything else is vectorised.
        not_active = self._row_gate[rows]
        # np.count_nonzero and ndarray.nonzero are much cheaper than .any() / flatnonzero
        # on the few hundred entries of a step.
        any_not_active = np.count_nonzero(not_active) > 0
        if any_not_active:
            for i in not_active.nonzero()[0].tolist():
                row = int(rows[i])
                st = int(self._row_status[row])
                if st == RequestStatus.ACTIVE:  # a prefilling request that is not FULL
                    outcome[i] = self._prepare_prefill(self._row_request[row])
                    if outcome[i] == Outcome.OK:
                        outcome[i] = self._grow_row(row, int(counts[i]), device_blocks_for)
                    continue
                if st != RequestStatus.ACTIVATING:
                    raise ProtocolError(f"row {row} scheduled while not active (status {st})")
                outcome[i] = Outcome.WAIT_TRANSFER
        starts = t.num_tokens[rows]
        ends = starts + counts
        grows = self._num_pages_for(ends) > t.num_pages[rows]
        if any_not_active:
            grows &= ~not_active
            fast = ~grows & ~not_active
        else:
            fast = ~grows
        grow_idx = grows.nonzero()[0]
        if grow_idx.shape[0] == 0 and not any_not_active:
            # Every row stays inside its last page (most decode steps): no masking. The
            # copy keeps the caller's array out of the step's records.
            fr, fast_starts, fast_ends = rows.copy(), starts, ends
        else:
            fr, fast_starts, fast_ends = rows[fast], starts[fast], ends[fast]
        if fr.shape[0]:
            t.num_tokens[fr] = fast_ends
            self._step_rows.append(fr)
            self._step_starts.append(fast_starts)
            self._step_ends.append(fast_ends)
            self._step_serials.append(t.serial[fr])
        for i in grow_idx.tolist():
            outcome[i] = self._grow_row(int(rows[i]), int(counts[i]), device_blocks_for)
        return outcome

    def _grow_row(self, row: int, count: int, device_blocks_for) -> Outcome:
        req = self._row_request[row]
        blocks = None
        if device_blocks_for is not None:
            t = self.tables
            old = int(t.num_pages[row])
            new = -(-(int(t.num_tokens[row]) + count) // self.block_size) - old
            if new > 0:
                blocks = device_blocks_for(row, old, new)
        return self._grow(req, count, blocks, record=True)

    def finish(self, request_id: str) -> None:
        """The request finished: publish its clean pages, return every lease."""
        self._end_request(self._req(request_id), publish=True)

    def abort(self, request_id: str, publish: bool = True) -> None:
        """The request was cancelled. Its computed KV is still correct, so clean pages are
        published unless ``publish`` is False."""
        self._end_request(self._req(request_id), publish=publish)

    def preempt(self, request_id: str) -> None:
        """Park a running request: release its hot lease, keep its host pages.

        Pages whose written rows are all on the host are released readable (a later resume
        re-pins them for free if the pool did not reuse them). Pages not yet on the host stay
        pinned and get spilled; they are released when the spill completes. Nothing is lost,
        and resuming never recomputes.
        """
        req = self._req(request_id)
        if req.status not in (RequestStatus.ACTIVE, RequestStatus.ACTIVATING):
            raise ProtocolError(f"request {request_id!r} preempted while {req.status.name}")
        self._drop_hot_lease(req)
        req.promoting = False
        req.needs_tail_restore_retry = False
        self._set_status(req, RequestStatus.PARKED)
        self._set_residency(req, Residency.NONE)
        row = req.row
        t = self.tables
        for page in np.nonzero(t.pinned[row, : t.num_pages[row]])[0]:
            page = int(page)
            if not self._settle_parked_page(req, page):
                if t.pending[row, page] < 0 and t.mirror_inflight[row, page] == 0:
                    self._spill_queue[(row, req.serial, page)] = None

    def resume(self, request_id: str) -> Outcome:
        """Re-activate a PARKED request (after preemption, import or a host prefix hit).

        The tail pages are made resident (re-pinned if their released block was not reused,
        else restored from host) and a hot region is leased; state NONE. A request whose
        every page is still pinned comes back FULL with no hot region.

        A prefilling request (R1.b) is then promoted at once: every released page is
        re-pinned and every host-only page restored; the outcome is OK only once it is
        FULL (``WAIT_TRANSFER`` while the restores are in flight).
        """
        outcome = self._resume(request_id)
        req = self._requests[request_id]
        if outcome == Outcome.WAIT_DEVICE or not req.prefilling or req.residency == Residency.FULL:
            return outcome
        return self._prepare_prefill(req)

    def _resume(self, request_id: str) -> Outcome:
        req = self._req(request_id)
        if req.status != RequestStatus.PARKED:
            raise ProtocolError(f"request {request_id!r} resumed while {req.status.name}")
        row = req.row
        t = self.tables
        num_pages = int(t.num_pages[row])
        if t.num_pinned[row] == num_pages:
            self._set_status(req, RequestStatus.ACTIVE)
            self._set_residency(req, Residency.FULL)
            return Outcome.OK
        tail = range(max(0, num_pages - ACTIVE_TAIL_PAGES), num_pages)
        repin = [p for p in tail if not t.pinned[row, p] and t.device_block[row, p] >= 0]
        # Tail pages with a restore already in flight (resumed while activating) just wait.
        restore = [p for p in tail if t.device_block[row, p] < 0 and t.pending[row, p] < 0]
        needed = req.hot_blocks + len(repin) + len(restore)
        if needed > self.device_pool.get_num_free_blocks():
            self.stats.num_device_backpressure += 1
            self._unmet_device_blocks += needed
            return Outcome.WAIT_DEVICE
        for page in repin:
            self._repin_page(req, page)
        self._lease_hot(req)
        self._set_residency(req, Residency.NONE)
        if restore:
            self._plan_restore(req, restore)
        if req.num_restores_inflight:
            self._set_status(req, RequestStatus.ACTIVATING)
            return Outcome.WAIT_TRANSFER
        self._set_status(req, RequestStatus.ACTIVE)
        return Outcome.OK

    def begin_import(self, request_id: str, num_tokens: int) -> list[int]:
        """P/D import: hand out host blocks for ``num_tokens`` positions an external
        transfer writes. Raises :class:`HostPoolExhausted` (back-pressure) if short."""
        req = self._req(request_id)
        t = self.tables
        if req.status != RequestStatus.ACTIVE or t.num_tokens[req.row] != 0:
            raise ProtocolError(f"request {request_id!r}: import must start on an empty request")
        num_pages = cdiv(int(num_tokens), self.block_size)
        if num_pages > self.config.max_pages_per_request:
            raise ProtocolError(f"import of {num_tokens} tokens exceeds max_pages_per_request")
        try:
            host = self.host_pool.allocate(num_pages)
        except HostPoolExhausted:
            self.stats.num_host_backpressure += 1
            raise
        row = req.row
        t.host_block[row, :num_pages] = host
        t.num_pages[row] = num_pages
        t.num_tokens[row] = int(num_tokens)
        self._set_status(req, RequestStatus.IMPORTING)
        return list(host)

    def finish_import(self, request_id: str, success: bool) -> Outcome:
        """The external transfer into the imported host blocks finished.

        On success the pages are host-valid and the request is activated like a resume
        (state NONE). On failure the host blocks are returned and the request restarts at
        zero tokens (``Outcome.RECOMPUTE``).
        """
        req = self._req(request_id)
        if req.status != RequestStatus.IMPORTING:
            raise ProtocolError(f"request {request_id!r} is not importing")
        row = req.row
        t = self.tables
        num_pages = int(t.num_pages[row])
        if not success:
            self.host_pool.free(int(b) for b in t.host_block[row, :num_pages])
            t.host_block[row, :num_pages] = -1
            t.num_pages[row] = 0
            t.num_tokens[row] = 0
            self._set_status(req, RequestStatus.ACTIVE)
            return Outcome.RECOMPUTE
        for page in range(num_pages):
            written = t.rows_written(row, page)
            t.host_mask[row, page] = range_mask(0, written, t.num_mask_words)
            if written == self.block_size:
                self._mark_clean(req, page)
            self._emit_page(row, page, -1, int(t.host_block[row, page]))
        self._set_status(req, RequestStatus.PARKED)
        self._set_residency(req, Residency.NONE)
        return self.resume(request_id)

    def set_prefilling(self, request_id: str, prefilling: bool) -> Outcome:
        """Tell the policy whether the request still has prompt tokens to compute.

        Requirement R1 (docs/core.md): the engine's prefill reads the whole context from
        the device. While a request is prefilling the policy therefore never demotes it
        (neither under pressure nor by the admission window, whose demotion waits for
        ``set_prefilling(id, False)``) and never releases its pages. A prefilling request
        that is MIXED/NONE (resume, import, host hit) is promoted first: released pages
        are re-pinned, host-only pages restored, and ``schedule`` answers
        ``WAIT_TRANSFER`` until the restores are acknowledged (``WAIT_DEVICE`` while the
        pool cannot take them).

        Returns whether the request may be scheduled for prefill now (``OK``), or why not.
        O(1) when nothing changes; a promotion is O(pages) of that request.
        """
        req = self._req(request_id)
        prefilling = bool(prefilling)
        row = req.row
        if req.prefilling != prefilling:
            req.prefilling = prefilling
            self._row_prefilling[row] = prefilling
            self._update_gate(req)
            if prefilling:
                if row in self._window_candidates:
                    self._window_candidates.discard(row)
                    self._window_waiting.add(row)
            else:
                if row in self._window_waiting:
                    self._window_waiting.discard(row)
                    self._window_candidates.add(row)
                if req.residency != Residency.FULL and req.status == RequestStatus.ACTIVE and not req.promoting:
                    # Releases were held back while prefilling.
                    self._release_all_releasable(req)
        if not prefilling or req.residency == Residency.FULL:
            return Outcome.OK if req.status == RequestStatus.ACTIVE else Outcome.WAIT_TRANSFER
        if req.status not in (RequestStatus.ACTIVE, RequestStatus.ACTIVATING):
            return Outcome.WAIT_TRANSFER  # parked or importing: resume / finish_import handle it
        return self._prepare_prefill(req)

    def is_prefilling(self, request_id: str) -> bool:
        """What the engine last told :meth:`set_prefilling` (or ``add_request``)."""
        return self._req(request_id).prefilling

    def note_device_demand(self, num_blocks: int) -> None:
        """The engine allocates its own pages and could not get ``num_blocks`` device blocks
        this step (``schedule(..., device_block_ids=...)`` never sees that shortfall).

        The demand is added to this step's unmet demand, exactly like a ``WAIT_DEVICE``
        from ``schedule``: the next ``build_step`` treats the pool as under pressure and
        sizes its demotions to cover ``high_watermark - free + unmet``. It is forgotten
        after that ``build_step``, so report it again each step it persists. Counters
        (``stats``) are not changed.
        """
        num_blocks = int(num_blocks)
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self._unmet_device_blocks += num_blocks

    # =====================================================================================
    # Worker acknowledgements
    # =====================================================================================
    def apply_acks(self, acks: WorkerAcks) -> None:
        """Apply worker reports: enqueued first, then completed, then failed."""
        for tid in acks.enqueued:
            txn = self._txns.mark_enqueued(int(tid))
            self._release_enqueued_leases(txn)
        for tid in acks.completed:
            txn = self._txns.close(int(tid))
            if txn.phase == TransferPhase.PLANNED:
                self._release_enqueued_leases(txn)
            self._on_completed(txn)
            self._release_done_leases(txn)
        for tid in acks.failed:
            txn = self._txns.close(int(tid))
            if txn.phase == TransferPhase.PLANNED:
                self._release_enqueued_leases(txn)
            self.stats.num_failed_transfers += 1
            self._on_failed(txn)
            self._release_done_leases(txn)

    # =====================================================================================
    # The step
    # =====================================================================================
    def build_step(self) -> StepCommand:
        """Plan mirrors, spills, demotions and promotions; return the worker's command."""
        self._plan_mirror_or_seal()
        self._retry_tail_restores()
        self._plan_spills()
        self._apply_pressure()
        cmd = StepCommand(
            step_id=self._step_id,
            cleared_rows=self._cleared_rows,
            page_rows=self._upd_rows,
            page_indices=self._upd_pages,
            page_device_blocks=self._upd_device,
            page_host_blocks=self._upd_host,
            hot_leases=self._hot_leases,
            residency_changes=self._residency_changes,
            transfers=self._transfers,
        )
        self._step_id += 1
        self._unmet_device_blocks = 0
        self._reset_step_buffers()
        return cmd

    # =====================================================================================
    # Internals: growth, release, re-pin
    # =====================================================================================
    def _grow(self, req: _Request, num_new_tokens: int, device_block_ids, record: bool) -> Outcome:
        if num_new_tokens < 0:
            raise ProtocolError("num_new_tokens must be >= 0")
        t = self.tables
        row = req.row
        start = int(t.num_tokens[row])
        end = start + num_new_tokens
        old_pages = int(t.num_pages[row])
        new_pages = -(-end // self.block_size) - old_pages
        if new_pages > 0:
            if end > self.config.max_pages_per_request * self.block_size:
                raise ProtocolError(f"request {req.request_id!r} grows past max_pages_per_request")
            if device_block_ids is None and new_pages > self.device_pool.get_num_free_blocks():
                self.stats.num_device_backpressure += 1
                self._unmet_device_blocks += new_pages
                return Outcome.WAIT_DEVICE
            if device_block_ids is not None and len(device_block_ids) != new_pages:
                raise ProtocolError(f"{len(device_block_ids)} device blocks given for {new_pages} new pages")
            try:
                host = self.host_pool.allocate(new_pages)
            except HostPoolExhausted:
                self.stats.num_host_backpressure += 1
                return Outcome.WAIT_HOST
            if device_block_ids is None:
                try:
                    device = self.device_pool.get_new_blocks(new_pages)
                except DevicePoolExhausted:  # pragma: no cover - checked above
                    self.host_pool.free(host)
                    self.stats.num_device_backpressure += 1
                    return Outcome.WAIT_DEVICE
            else:
                device = [int(b) for b in device_block_ids]
            pages = slice(old_pages, old_pages + new_pages)
            t.device_block[row, pages] = device
            t.pinned[row, pages] = True
            t.host_block[row, pages] = host
            t.num_pages[row] = old_pages + new_pages
            t.num_pinned[row] += new_pages
            for i in range(new_pages):
                self._emit_page(row, old_pages + i, device[i], host[i])
            if req.residency == Residency.FULL:
                # Only the first crossing of the window counts (pages only grow), so a request
                # promoted back to FULL later is not flipped again by the window rule.
                window = self.config.admission_window_pages
                if window is not None and old_pages <= window < old_pages + new_pages:
                    # R1.a: a prefilling request is demoted when its prompt completes.
                    (self._window_waiting if req.prefilling else self._window_candidates).add(row)
            elif not req.promoting:
                # Pages that just left the tail may now be released.
                for page in range(max(0, old_pages - ACTIVE_TAIL_PAGES), old_pages + new_pages - ACTIVE_TAIL_PAGES):
                    self._try_release(req, page)
        t.num_tokens[row] = end
        if record and num_new_tokens > 0:
            # Plain lists: one numpy conversion per step, not one per request.
            self._single_ranges.append((row, start, end, req.serial))
        return Outcome.OK

    def _try_release(self, req: _Request, page: int) -> bool:
        """Release a page of a MIXED/NONE request if the rules allow it."""
        t = self.tables
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
        self._release_page(req, page)
        return True

    def _release_page(self, req: _Request, page: int) -> None:
        t = self.tables
        row = req.row
        block = int(t.device_block[row, page])
        t.pinned[row, page] = False
        t.num_pinned[row] -= 1
        if t.host_valid[row, page]:
            t.num_clean_pinned[row] -= 1
        self._released_owner.setdefault(block, []).append((row, req.serial, page))
        self.device_pool.release_readable([block], self._on_block_reused)
        self.stats.num_pages_released += 1

    def _repin_page(self, req: _Request, page: int) -> None:
        t = self.tables
        row = req.row
        block = int(t.device_block[row, page])
        owners = self._released_owner.get(block)
        if owners is not None:
            owners.remove((row, req.serial, page))
            if not owners:
                del self._released_owner[block]
        self.device_pool.touch([block])
        t.pinned[row, page] = True
        t.num_pinned[row] += 1
        if t.host_valid[row, page]:
            t.num_clean_pinned[row] += 1
        self.stats.num_pages_repinned += 1

    def _on_block_reused(self, block: int) -> None:
        """Device pool callback: a released block was handed out again."""
        owners = self._released_owner.pop(block, None)
        if not owners:
            return
        t = self.tables
        for row, serial, page in owners:
            if t.serial[row] == serial and t.device_block[row, page] == block and not t.pinned[row, page]:
                t.device_block[row, page] = -1
                self._emit_page(row, page, -1, int(t.host_block[row, page]))
                self.stats.num_pages_reused += 1

    def _mark_clean(self, req: _Request, page: int) -> None:
        """Every row of the page is on the host: it is clean from now on."""
        t = self.tables
        row = req.row
        t.host_valid[row, page] = True
        t.mirror_failed[row, page] = False
        if t.pinned[row, page]:
            t.num_clean_pinned[row] += 1
        block_hash = self._hash_of(req, page)
        if block_hash is not None:
            if self.host_pool.publish(int(t.host_block[row, page]), block_hash):
                self.stats.num_published_pages += 1
        if req.status == RequestStatus.PARKED:
            self._settle_parked_page(req, page)
        elif req.residency != Residency.FULL and not req.promoting:
            self._try_release(req, page)

    def _settle_parked_page(self, req: _Request, page: int) -> bool:
        """Release a parked request's pinned page once its written rows are on the host."""
        t = self.tables
        row = req.row
        if not t.pinned[row, page]:
            return True
        if t.pending[row, page] >= 0 or t.mirror_inflight[row, page] > 0:
            return False
        if not t.host_covers_written(row, page):
            return False
        self._release_page(req, page)
        return True

    # =====================================================================================
    # Internals: transfers
    # =====================================================================================
    def _plan_mirror_or_seal(self) -> None:
        """Turn this step's written ranges into a MIRROR (eager) or queue sealed pages."""
        if self._single_ranges:
            singles = np.array(self._single_ranges, dtype=np.int64)
            self._step_rows.append(singles[:, 0])
            self._step_starts.append(singles[:, 1])
            self._step_ends.append(singles[:, 2])
            self._step_serials.append(singles[:, 3])
        if not self._step_rows:
            return
        t = self.tables
        bs = self.block_size
        if len(self._step_rows) == 1:
            rows, starts, ends, serials = (
                self._step_rows[0], self._step_starts[0], self._step_ends[0], self._step_serials[0]
            )
        else:
            rows = np.concatenate(self._step_rows)
            starts = np.concatenate(self._step_starts)
            ends = np.concatenate(self._step_ends)
            serials = np.concatenate(self._step_serials)
        keep = (t.serial[rows] == serials) & (ends > starts)
        if np.count_nonzero(keep) != keep.shape[0]:
            rows, starts, ends, serials = rows[keep], starts[keep], ends[keep], serials[keep]
        n = rows.shape[0]
        if n == 0:
            return
        first = self._page_of(starts)
        last = self._page_of(ends - 1)
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
        if self.config.eager_host_mirror:
            # A row's ranges cover distinct pages, so (row, page) pairs repeat only if a row
            # was scheduled twice this step; then the unbuffered np.add.at is needed.
            unique = n <= t.num_rows and self._rows_unique(rows)
            flat = t.flat_index(pr, pp)
            txn = self._txns.open(
                TransferKind.MIRROR,
                self._step_id,
                rows=pr,
                serials=ps,
                pages=pp,
                starts=lo,
                ends=hi,
                flat=flat,
                unique_pages=unique,
            )
            if unique:
                t.flat_mirror_inflight[flat] += 1
            else:
                np.add.at(t.mirror_inflight, (pr, pp), 1)
            self._transfers.append(
                TransferSpec(
                    transfer_id=txn.transfer_id,
                    kind=int(TransferKind.MIRROR),
                    after_forward=True,
                    mirror_rows=rows.tolist(),
                    mirror_starts=starts.tolist(),
                    mirror_ends=ends.tolist(),
                )
            )
        else:
            sealed = np.nonzero(hi == bs)[0]
            for i in sealed:
                self._spill_queue[(int(pr[i]), int(ps[i]), int(pp[i]))] = None

    def _plan_spills(self) -> None:
        """Plan one SPILL transaction for queued pages that are ready, within the budget."""
        if not self._spill_queue:
            return
        t = self.tables
        budget = self.config.max_spill_pages_per_step
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
            req = self._row_request[row]
            written = t.rows_written(row, page)
            if written < self.block_size and req.status != RequestStatus.PARKED:
                continue  # not sealed yet: the forward is still filling it
            del self._spill_queue[key]
            if t.host_covers_written(row, page):
                self._settle_parked_page(req, page)
                continue
            rows.append(row)
            serials.append(serial)
            pages.append(page)
            device.append(int(t.device_block[row, page]))
            host.append(int(t.host_block[row, page]))
            copied.append(written)
        if not pages:
            return
        txn = self._txns.open(
            TransferKind.SPILL,
            self._step_id,
            rows=np.array(rows, dtype=np.int64),
            serials=np.array(serials, dtype=np.int64),
            pages=np.array(pages, dtype=np.int64),
            device_blocks=np.array(device, dtype=np.int64),
            host_blocks=np.array(host, dtype=np.int64),
            num_rows_copied=np.array(copied, dtype=np.int64),
        )
        # Source and destination pinned for the life of the transfer.
        self.device_pool.touch(device)
        self.host_pool.touch(host)
        txn.held_device_until_enqueued = list(device)
        txn.held_host_until_done = list(host)
        t.pending[txn.rows, txn.pages] = txn.transfer_id
        self.stats.num_spill_pages += len(pages)
        self._transfers.append(
            TransferSpec(
                transfer_id=txn.transfer_id,
                kind=int(TransferKind.SPILL),
                after_forward=True,
                device_blocks=device,
                host_blocks=host,
            )
        )

    def _plan_restore(self, req: _Request, pages: list[int]) -> None:
        """Allocate device blocks for host-only pages and plan their H2D restore."""
        t = self.tables
        device = self.device_pool.get_new_blocks(len(pages))
        host = [int(t.host_block[req.row, p]) for p in pages]
        txn = self._open_restore(req, pages, device, host, into_pinned=False)
        # The new device blocks belong to the transfer until it completes.
        txn.held_device_until_done = list(device)
        req.num_restores_inflight += len(pages)

    def _open_restore(self, req: _Request, pages: list[int], device: list[int], host: list[int],
                      *, into_pinned: bool) -> Transaction:
        """One RESTORE (host → device, before the forward) of ``pages`` of ``req``: holds its
        host sources until done, marks the pages pending, queues the worker's spec."""
        self.host_pool.touch(host)
        txn = self._txns.open(
            TransferKind.RESTORE,
            self._step_id,
            rows=np.full(len(pages), req.row, dtype=np.int64),
            serials=np.full(len(pages), req.serial, dtype=np.int64),
            pages=np.array(pages, dtype=np.int64),
            device_blocks=np.array(device, dtype=np.int64),
            host_blocks=np.array(host, dtype=np.int64),
            into_pinned=into_pinned,
        )
        txn.held_host_until_done = list(host)
        self.tables.pending[req.row, pages] = txn.transfer_id
        self.stats.num_restore_pages += len(pages)
        self._transfers.append(
            TransferSpec(
                transfer_id=txn.transfer_id,
                kind=int(TransferKind.RESTORE),
                after_forward=False,
                device_blocks=list(device),
                host_blocks=list(host),
            )
        )
        return txn

    def _retry_tail_restores(self) -> None:
        for row in list(self._tail_retry_rows):
            req = self._row_request[row]
            if req is None or not req.needs_tail_restore_retry or req.status != RequestStatus.ACTIVATING:
                self._tail_retry_rows.discard(row)
                continue
            t = self.tables
            n = int(t.num_pages[row])
            missing = [p for p in range(max(0, n - ACTIVE_TAIL_PAGES), n) if t.device_block[row, p] < 0 and t.pending[row, p] < 0]
            if len(missing) > self.device_pool.get_num_free_blocks():
                continue
            req.needs_tail_restore_retry = False
            self._tail_retry_rows.discard(row)
            if missing:
                self._plan_restore(req, missing)
            elif req.num_restores_inflight == 0:
                self._set_status(req, RequestStatus.ACTIVE)

    def _release_enqueued_leases(self, txn: Transaction) -> None:
        if txn.held_device_until_enqueued:
            self.device_pool.free_blocks(txn.held_device_until_enqueued)
            txn.held_device_until_enqueued = []

    def _release_done_leases(self, txn: Transaction) -> None:
        if txn.held_device_until_done:
            self.device_pool.free_blocks(txn.held_device_until_done)
            txn.held_device_until_done = []
        if txn.held_host_until_done:
            self.host_pool.free(txn.held_host_until_done)
            txn.held_host_until_done = []

    def _live(self, txn: Transaction) -> np.ndarray:
        """Mask of the transaction's entries whose request incarnation still owns the row."""
        return self.tables.serial[txn.rows] == txn.serials

    def _on_completed(self, txn: Transaction) -> None:
        t = self.tables
        live = self._live(txn)
        if txn.kind == TransferKind.MIRROR:
            if txn.unique_pages:
                self._on_mirror_completed(txn, live)
            else:
                self._on_mirror_completed_repeated(txn, live)
            # Pages of requests that ended while this mirror completed them.
            for host_block, block_hash in txn.publish_on_completion.items():
                if self.host_pool.publish(host_block, block_hash):
                    self.stats.num_published_pages += 1
            return
        for i in np.nonzero(live)[0]:
            row, page = int(txn.rows[i]), int(txn.pages[i])
            if t.pending[row, page] != txn.transfer_id:
                continue
            t.pending[row, page] = -1
            req = self._row_request[row]
            if txn.kind == TransferKind.SPILL:
                t.host_mask[row, page] |= range_mask(0, int(txn.num_rows_copied[i]), t.num_mask_words)
                if not t.host_valid[row, page] and np.all(t.host_mask[row, page] == t.full_mask):
                    self._mark_clean(req, page)
                elif req.status == RequestStatus.PARKED:
                    self._settle_parked_page(req, page)
                elif t.host_valid[row, page] and req.residency != Residency.FULL and not req.promoting:
                    self._try_release(req, page)
            elif txn.into_pinned:  # a host-prefix load: the page already owns its block
                if req.status == RequestStatus.PARKED:
                    self._settle_parked_page(req, page)
            else:  # RESTORE: the transfer's device lease becomes the page's.
                block = int(txn.device_blocks[i])
                txn.held_device_until_done.remove(block)
                t.device_block[row, page] = block
                t.pinned[row, page] = True
                t.num_pinned[row] += 1
                if t.host_valid[row, page]:
                    t.num_clean_pinned[row] += 1
                self._emit_page(row, page, block, int(t.host_block[row, page]))
                req.num_restores_inflight -= 1
                if req.status == RequestStatus.PARKED:
                    self._settle_parked_page(req, page)
                elif req.residency != Residency.FULL and not req.promoting:
                    self._try_release(req, page)
                self._after_restores(req)
        if txn.kind == TransferKind.SPILL and txn.publish_on_completion:
            # Pages of ended requests: the copy is durable now, so the prefix may be shared,
            # but only if the spill copied a whole page (a preempted request spills partial
            # pages, and the request may have sealed the page after the spill was planned).
            for i, host_block in enumerate(txn.host_blocks.tolist()):
                block_hash = txn.publish_on_completion.get(host_block)
                if block_hash is None or txn.num_rows_copied[i] != self.block_size:
                    continue
                if self.host_pool.publish(host_block, block_hash):
                    self.stats.num_published_pages += 1

    def _on_mirror_completed(self, txn: Transaction, live: np.ndarray) -> None:
        """MIRROR completion when no (row, page) repeats: plain gathers and scatters over
        the flat views, and Python only for pages that became clean or may be released."""
        t = self.tables
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
            self._mark_clean(self._row_request[int(r[i])], int(p[i]))
        # The rest only concerns parked or MIXED/NONE requests (none in a FULL steady state).
        # Their pages' host_valid and mirror counts are as gathered above: marking other
        # pages clean, settling or releasing pages changes neither.
        if np.count_nonzero(self._row_watch[r]) == 0:
            return
        parked = self._row_status[r] == RequestStatus.PARKED
        non_full = self._row_residency[r] != Residency.FULL
        # Pages of parked requests may now be released, and pages that were waiting for
        # this mirror to end may now be released or spilled.
        for i in (parked & ~full).nonzero()[0].tolist():
            self._settle_parked_page(self._row_request[int(r[i])], int(p[i]))
        # Clean pages of MIXED/NONE requests that only waited for this mirror to end.
        waiting = non_full & ~full & ~parked & valid & (inflight == 0)
        for i in waiting.nonzero()[0].tolist():
            req = self._row_request[int(r[i])]
            if req.status == RequestStatus.ACTIVE and not req.promoting:
                self._try_release(req, int(p[i]))

    def _on_mirror_completed_repeated(self, txn: Transaction, live: np.ndarray) -> None:
        """MIRROR completion when a (row, page) may repeat (a row scheduled twice in the
        planning step): unbuffered ``ufunc.at`` updates, then per-entry handling."""
        t = self.tables
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
                self._mark_clean(self._row_request[row], page)
        parked = self._row_status[r] == RequestStatus.PARKED
        for i in np.nonzero(parked & ~full)[0]:
            self._settle_parked_page(self._row_request[int(r[i])], int(p[i]))
        waiting = (
            ~full
            & ~parked
            & t.host_valid[r, p]
            & (t.mirror_inflight[r, p] == 0)
            & (self._row_residency[r] != Residency.FULL)
        )
        for i in np.nonzero(waiting)[0]:
            req = self._row_request[int(r[i])]
            if req.status == RequestStatus.ACTIVE and not req.promoting:
                self._try_release(req, int(p[i]))

    def _on_failed(self, txn: Transaction) -> None:
        t = self.tables
        live = self._live(txn)
        if txn.kind == TransferKind.MIRROR:
            r, p, s = txn.rows[live], txn.pages[live], txn.serials[live]
            if txn.unique_pages:
                flat = txn.flat[live]
                t.flat_mirror_inflight[flat] -= 1
            else:
                np.subtract.at(t.mirror_inflight, (r, p), 1)
            t.mirror_failed[r, p] = True
            for i in (~t.host_valid[r, p]).nonzero()[0].tolist():
                self._spill_queue[(int(r[i]), int(s[i]), int(p[i]))] = None
            return
        for i in np.nonzero(live)[0]:
            row, page = int(txn.rows[i]), int(txn.pages[i])
            if t.pending[row, page] != txn.transfer_id:
                continue
            t.pending[row, page] = -1
            req = self._row_request[row]
            if txn.kind == TransferKind.SPILL:
                # A failed copy may have scribbled over the host page: trust none of its rows.
                # The page keeps its resident copy; try again later.
                if not t.host_valid[row, page]:
                    t.host_mask[row, page] = 0
                self._spill_queue[(row, req.serial, page)] = None
            elif txn.into_pinned:
                # A host-prefix load the forward already read: the engine learns of it from
                # the same ack (it fails the request); the host copy itself is still good.
                self.stats.num_failed_prefix_load_pages += 1
            else:
                req.num_restores_inflight -= 1
                if req.promoting:
                    # Give up this promotion (it may be chosen again later) and hand back the
                    # pages it had re-pinned.
                    req.promoting = False
                    if req.status == RequestStatus.ACTIVE:
                        self._release_all_releasable(req)
                if req.status == RequestStatus.ACTIVATING:
                    req.needs_tail_restore_retry = True
                    self._tail_retry_rows.add(row)

    def _after_restores(self, req: _Request) -> None:
        if req.num_restores_inflight:
            return
        if req.status == RequestStatus.ACTIVATING and not req.needs_tail_restore_retry:
            self._set_status(req, RequestStatus.ACTIVE)
        if req.promoting:
            self._maybe_finish_promotion(req)

    # =====================================================================================
    # Internals: pressure, demotion, promotion
    # =====================================================================================
    def _apply_pressure(self) -> None:
        demoted = False
        if self._window_candidates:
            for row in list(self._window_candidates):
                req = self._row_request[row]
                if req is None:
                    continue
                if req.prefilling:  # R1.a: wait for the prompt to complete
                    self._window_waiting.add(row)
                elif req.residency == Residency.FULL and req.status == RequestStatus.ACTIVE:
                    demoted |= self._demote(req)
            self._window_candidates.clear()
        free = self.device_pool.get_num_free_blocks()
        if free < self.low_watermark_blocks or self._unmet_device_blocks:
            self._demote_for_pressure(free)
        elif (
            not demoted
            and free >= self.high_watermark_blocks
            and self._non_full_rows
            and self._step_id >= self._next_promotion_check_step
        ):
            # Re-evaluated at most every min_steps_between_transitions steps, so a step with
            # no pressure costs O(1) even when many requests stay MIXED.
            self._next_promotion_check_step = self._step_id + max(1, self.config.min_steps_between_transitions)
            self._promote_some(free)

    def _demote_for_pressure(self, free: int) -> None:
        need = self.high_watermark_blocks + self._unmet_device_blocks - free
        if need <= 0:
            return
        t = self.tables
        cooled = self._step_id - self._row_last_transition > self.config.min_steps_between_transitions
        # R1.a: a prefilling request is never demoted.
        candidates = np.nonzero(
            (self._row_status == RequestStatus.ACTIVE)
            & (self._row_residency == Residency.FULL)
            & cooled
            & ~self._row_prefilling
        )[0]
        if candidates.shape[0] == 0:
            return
        reclaimable = np.maximum(t.num_clean_pinned[candidates] - ACTIVE_TAIL_PAGES, 0)
        hot = self._row_hot_blocks[candidates]
        net = reclaimable - hot
        ok = net > 0
        if not np.any(ok):
            return
        candidates, reclaimable, hot, net = candidates[ok], reclaimable[ok], hot[ok], net[ok]
        order = np.argsort(-(reclaimable / hot), kind="stable")
        gained = 0
        for i in order:
            if gained >= need:
                break
            if self._demote(self._row_request[int(candidates[i])]):
                gained += int(net[i])

    def _demote(self, req: _Request) -> bool:
        """FULL → MIXED: lease a hot region and release every releasable page."""
        if req.hot_blocks > self.device_pool.get_num_free_blocks():
            self.stats.num_device_backpressure += 1
            return False
        self._lease_hot(req)
        self._set_residency(req, Residency.MIXED)
        self.stats.num_demotions += 1
        self._release_all_releasable(req)
        return True

    def _release_all_releasable(self, req: _Request) -> None:
        """Release every clean, idle, non-tail pinned page of a MIXED/NONE request."""
        t = self.tables
        row = req.row
        limit = int(t.num_pages[row]) - ACTIVE_TAIL_PAGES
        if limit <= 0 or req.prefilling:  # R1.a: a prefilling request keeps every page
            return
        releasable = (
            t.pinned[row, :limit]
            & t.host_valid[row, :limit]
            & (t.pending[row, :limit] < 0)
            & (t.mirror_inflight[row, :limit] == 0)
        )
        for page in np.nonzero(releasable)[0]:
            self._release_page(req, int(page))

    def _promote_some(self, free: int) -> None:
        t = self.tables
        rows = np.fromiter(self._non_full_rows, dtype=np.int64, count=len(self._non_full_rows))
        cooled = self._step_id - self._row_last_transition[rows] > self.config.min_steps_between_transitions
        rows = rows[(self._row_status[rows] == RequestStatus.ACTIVE) & cooled]
        if rows.shape[0] == 0:
            return
        cost = t.num_pages[rows] - t.num_pinned[rows]
        order = np.argsort(cost, kind="stable")
        started = 0
        restore_budget = self.config.max_restore_pages_per_step
        for i in order:
            if started >= self.config.max_promotions_per_step:
                break
            req = self._row_request[int(rows[i])]
            if req.promoting:
                continue
            c = int(cost[i])
            if free - c < self.high_watermark_blocks:
                break
            host_only = int(np.count_nonzero(t.device_block[req.row, : t.num_pages[req.row]] < 0))
            if host_only > restore_budget:
                continue
            self._promote(req)
            restore_budget -= host_only
            free -= c
            started += 1

    def _promote(self, req: _Request) -> None:
        """Start MIXED/NONE → FULL: re-pin released pages, restore host-only ones."""
        t = self.tables
        row = req.row
        n = int(t.num_pages[row])
        req.promoting = True
        req.last_transition_step = self._step_id
        self._row_last_transition[row] = self._step_id
        self.stats.num_promotions += 1
        for page in np.nonzero(~t.pinned[row, :n] & (t.device_block[row, :n] >= 0))[0]:
            self._repin_page(req, int(page))
        host_only = [int(p) for p in np.nonzero((t.device_block[row, :n] < 0) & (t.pending[row, :n] < 0))[0]]
        if host_only:
            self._plan_restore(req, host_only)
        self._maybe_finish_promotion(req)

    def _prepare_prefill(self, req: _Request) -> Outcome:
        """R1.b: make every page of a prefilling MIXED/NONE request resident (a forced
        promotion, whatever the watermarks). OK once FULL; WAIT_TRANSFER while restores are
        in flight (a restore completes, and its page reaches the worker's tables, before
        the request may prefill); WAIT_DEVICE (unmet demand noted) when the pool cannot
        take the restores now."""
        if req.residency == Residency.FULL:
            return Outcome.OK
        if req.promoting:
            return Outcome.WAIT_TRANSFER
        t = self.tables
        row = req.row
        n = int(t.num_pages[row])
        device = t.device_block[row, :n]
        num_released = int(np.count_nonzero(~t.pinned[row, :n] & (device >= 0)))
        num_restore = int(np.count_nonzero((device < 0) & (t.pending[row, :n] < 0)))
        # Re-pinning takes released (free-counted) blocks out of the pool first.
        if num_restore > self.device_pool.get_num_free_blocks() - num_released:
            self.stats.num_device_backpressure += 1
            self._unmet_device_blocks += num_restore
            return Outcome.WAIT_DEVICE
        self._promote(req)
        if req.residency == Residency.FULL:
            return Outcome.OK
        return Outcome.WAIT_TRANSFER

    def _maybe_finish_promotion(self, req: _Request) -> None:
        t = self.tables
        if req.num_restores_inflight or t.num_pinned[req.row] != t.num_pages[req.row]:
            return
        req.promoting = False
        self._drop_hot_lease(req)
        self._set_residency(req, Residency.FULL)

    # =====================================================================================
    # Internals: leases, rows, emission
    # =====================================================================================
    def _lease_hot(self, req: _Request) -> None:
        req.hot_block_ids = self.device_pool.get_new_blocks(req.hot_blocks)
        self._hot_leases.append(HotLease(row=req.row, block_ids=list(req.hot_block_ids)))
        self._non_full_rows.add(req.row)

    def _drop_hot_lease(self, req: _Request) -> None:
        if req.hot_block_ids:
            self.device_pool.free_blocks(req.hot_block_ids)
            req.hot_block_ids = []
            self._hot_leases.append(HotLease(row=req.row, block_ids=[]))

    def _end_request(self, req: _Request, publish: bool) -> None:
        t = self.tables
        row, serial = req.row, req.serial
        n = int(t.num_pages[row])
        # 1. Mirrors in flight over this row: they take over leases on what they touch.
        mirrors_of_page: dict[int, list[tuple[Transaction, int]]] = {}
        for txn in self._txns.values():
            if txn.kind != TransferKind.MIRROR:
                continue
            hits = np.nonzero((txn.rows == row) & (txn.serials == serial))[0]
            for i in hits:
                page = int(txn.pages[i])
                mirrors_of_page.setdefault(page, []).append((txn, int(i)))
                if txn.phase == TransferPhase.PLANNED and t.pinned[row, page]:
                    block = int(t.device_block[row, page])
                    self.device_pool.touch([block])
                    txn.held_device_until_enqueued.append(block)
                host_block = int(t.host_block[row, page])
                self.host_pool.touch([host_block])
                txn.held_host_until_done.append(host_block)
        # 2. Publish durable pages; pages whose spill is in flight publish on completion.
        if publish and req.block_hashes:
            for page in range(min(n, len(req.block_hashes))):
                host_block = int(t.host_block[row, page])
                block_hash = req.block_hashes[page]
                if host_block < 0 or block_hash is None:
                    continue
                if t.host_valid[row, page]:
                    if self.host_pool.publish(host_block, block_hash):
                        self.stats.num_published_pages += 1
                elif t.pending[row, page] >= 0 and t.pending[row, page] in self._txns:
                    txn = self._txns.get(int(t.pending[row, page]))
                    if txn.kind == TransferKind.SPILL:
                        txn.publish_on_completion[host_block] = block_hash
                elif len(mirrors_of_page.get(page, ())) == 1:
                    # The page's last rows are on their way (the request ended right after
                    # writing them): publish if that one mirror completes the page.
                    txn, i = mirrors_of_page[page][0]
                    rows = range_mask(int(txn.starts[i]), int(txn.ends[i]), t.num_mask_words)
                    if np.all((t.host_mask[row, page] | rows) == t.full_mask):
                        txn.publish_on_completion[host_block] = block_hash
        # 3. Device leases of pages; forget released copies.
        pinned_blocks = [int(b) for b in t.device_block[row, :n][t.pinned[row, :n]]]
        if pinned_blocks:
            self.device_pool.free_blocks(pinned_blocks)
        for page in np.nonzero(~t.pinned[row, :n] & (t.device_block[row, :n] >= 0))[0]:
            block = int(t.device_block[row, page])
            owners = self._released_owner.get(block)
            if owners is not None:
                owners.remove((row, serial, int(page)))
                if not owners:
                    del self._released_owner[block]
        # 4. Host leases of pages.
        host_blocks = [int(b) for b in t.host_block[row, :n] if b >= 0]
        if host_blocks:
            self.host_pool.free(host_blocks)
        # 5. Hot lease.
        self._drop_hot_lease(req)
        # 6. The row.
        self._drop_pending_updates(row)
        self._cleared_rows.append(row)
        t.reset_row(row)
        self._row_status[row] = -1
        self._row_residency[row] = -1
        self._row_watch[row] = False
        self._row_hot_blocks[row] = 0
        self._row_last_transition[row] = -(10**9)
        self._non_full_rows.discard(row)
        self._window_candidates.discard(row)
        self._window_waiting.discard(row)
        self._row_prefilling[row] = False
        self._row_gate[row] = True
        self._tail_retry_rows.discard(row)
        self._row_request[row] = None
        self._free_rows.append(row)
        del self._requests[req.request_id]

    def _take_row(self, state_row: int | None) -> int:
        if state_row is None:
            if not self._free_rows:
                raise ProtocolError("no free state row")
            return self._free_rows.pop()
        if not 0 <= state_row < self.config.max_num_rows or self._row_request[state_row] is not None:
            raise ProtocolError(f"state row {state_row} is out of range or in use")
        self._free_rows.remove(state_row)
        return state_row

    def _page_of(self, positions: np.ndarray) -> np.ndarray:
        """Page index of each (non-negative) position."""
        if self._page_shift >= 0:
            return positions >> self._page_shift
        return positions // self.block_size

    def _num_pages_for(self, num_tokens: np.ndarray) -> np.ndarray:
        """Pages needed to hold ``num_tokens`` positions (``cdiv``, arrays)."""
        if self._page_shift >= 0:
            return (num_tokens + (self.block_size - 1)) >> self._page_shift
        return cdiv(num_tokens, self.block_size)

    def _rows_unique(self, rows: np.ndarray) -> bool:
        """True when no row appears twice (``len(rows) <= num_rows``)."""
        n = rows.shape[0]
        idx = self._row_arange[:n]
        self._row_scratch[rows] = idx
        return bool(np.array_equal(self._row_scratch[rows], idx))

    def _hot_blocks_for(self, hot_rows: int | None) -> int:
        if hot_rows is None:
            return self.config.hot_blocks_per_request
        if hot_rows <= 0 or hot_rows % self.block_size:
            raise ValueError(f"hot_rows={hot_rows} must be a positive multiple of block_size")
        return hot_rows // self.block_size

    def _set_status(self, req: _Request, status: RequestStatus) -> None:
        req.status = status
        self._row_status[req.row] = status
        self._row_watch[req.row] = status == RequestStatus.PARKED or req.residency != Residency.FULL
        self._update_gate(req)

    def _update_gate(self, req: _Request) -> None:
        """``schedule_rows`` sends the row through the per-request path when it is not
        ACTIVE, or when it is prefilling and not FULL (R1.b)."""
        self._row_gate[req.row] = req.status != RequestStatus.ACTIVE or (
            req.prefilling and req.residency != Residency.FULL
        )

    def _set_residency(self, req: _Request, residency: Residency, emit: bool = True) -> None:
        if req.residency != residency:
            req.last_transition_step = self._step_id
            self._row_last_transition[req.row] = self._step_id
        req.residency = residency
        self._row_residency[req.row] = residency
        self._row_watch[req.row] = req.status == RequestStatus.PARKED or residency != Residency.FULL
        self._update_gate(req)
        if residency == Residency.FULL:
            self._non_full_rows.discard(req.row)
        else:
            self._non_full_rows.add(req.row)
        if emit:
            self._residency_changes.append(
                ResidencyChange(request_id=req.request_id, row=req.row, residency=int(residency))
            )

    def _emit_page(self, row: int, page: int, device_block: int, host_block: int) -> None:
        self._upd_rows.append(int(row))
        self._upd_pages.append(int(page))
        self._upd_device.append(int(device_block))
        self._upd_host.append(int(host_block))

    def _drop_pending_updates(self, row: int) -> None:
        if row in self._upd_rows:
            keep = [i for i, r in enumerate(self._upd_rows) if r != row]
            self._upd_rows = [self._upd_rows[i] for i in keep]
            self._upd_pages = [self._upd_pages[i] for i in keep]
            self._upd_device = [self._upd_device[i] for i in keep]
            self._upd_host = [self._upd_host[i] for i in keep]
        self._hot_leases = [h for h in self._hot_leases if h.row != row]

    def _reset_step_buffers(self) -> None:
        self._step_rows: list[np.ndarray] = []
        self._step_starts: list[np.ndarray] = []
        self._step_ends: list[np.ndarray] = []
        self._step_serials: list[np.ndarray] = []
        self._single_ranges: list[tuple[int, int, int, int]] = []
        self._upd_rows: list[int] = []
        self._upd_pages: list[int] = []
        self._upd_device: list[int] = []
        self._upd_host: list[int] = []
        self._hot_leases: list[HotLease] = []
        self._residency_changes: list[ResidencyChange] = []
        self._cleared_rows: list[int] = []
        self._transfers: list[TransferSpec] = []

    def _req(self, request_id: str) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            raise ProtocolError(f"unknown request {request_id!r}")
        return req

    # =====================================================================================
    # Invariants (tests and debugging; O(everything))
    # =====================================================================================
    def check_invariants(self, extra_device_leases: Iterable[int] = (), extra_host_leases: Iterable[int] = ()) -> None:
        """Raise AssertionError if any residency invariant is broken.

        * every written page of every request has a valid copy: pinned on the device,
          released but not reused, or on the host (host rows cover the written rows);
        * the running tail pages of an ACTIVE request are pinned;
        * device and host reference counts equal the leases the policy and its open
          transactions hold (so never negative, and no block is both free and owned);
        * hot leases belong to live MIXED/NONE requests only.

        ``extra_*_leases`` are blocks held by someone other than the policy (a test hog).
        """
        t = self.tables
        dev_leases: dict[int, int] = {}
        host_leases: dict[int, int] = {}

        def add(d, k):
            d[k] = d.get(k, 0) + 1

        for req in self._requests.values():
            row = req.row
            assert self._row_request[row] is req
            assert t.serial[row] == req.serial
            assert self._row_watch[row] == (
                req.status == RequestStatus.PARKED or req.residency != Residency.FULL
            ), (req.request_id, "row watch flag out of date")
            assert self._row_prefilling[row] == req.prefilling, (req.request_id, "prefilling flag out of date")
            assert self._row_gate[row] == (
                req.status != RequestStatus.ACTIVE or (req.prefilling and req.residency != Residency.FULL)
            ), (req.request_id, "schedule gate out of date")
            if req.prefilling and req.status == RequestStatus.ACTIVE and req.residency == Residency.FULL:
                # R1.a: a prefilling request that may be scheduled has its whole context pinned.
                assert t.num_pinned[row] == cdiv(int(t.num_tokens[row]), self.block_size), req.request_id
            n = int(t.num_pages[row])
            assert n == cdiv(int(t.num_tokens[row]), self.block_size)
            assert t.num_pinned[row] == int(np.count_nonzero(t.pinned[row, :n])), req.request_id
            assert t.num_clean_pinned[row] == int(np.count_nonzero(t.pinned[row, :n] & t.host_valid[row, :n]))
            assert not np.any(t.pinned[row, n:]) and not np.any(t.device_block[row, n:] >= 0)
            for page in range(n):
                block = int(t.device_block[row, page])
                host_block = int(t.host_block[row, page])
                if req.status != RequestStatus.IMPORTING:
                    assert host_block >= 0, (req.request_id, page, "page without host block")
                if host_block >= 0:
                    add(host_leases, host_block)
                if t.pinned[row, page]:
                    assert block >= 0
                    add(dev_leases, block)
                    continue
                if block >= 0:
                    owners = self._released_owner.get(block, [])
                    assert (row, req.serial, page) in owners, (req.request_id, page, "released page not tracked")
                    if hasattr(self.device_pool, "is_free"):
                        assert self.device_pool.is_free(block), (req.request_id, page, "released block re-owned")
                if t.host_valid[row, page]:
                    assert np.all(t.host_mask[row, page] == t.full_mask)
                if req.status == RequestStatus.IMPORTING:
                    continue
                assert t.host_covers_written(row, page), (req.request_id, page, "page has no valid copy")
            if req.status == RequestStatus.ACTIVE and req.residency != Residency.FULL:
                for page in range(max(0, n - ACTIVE_TAIL_PAGES), n):
                    assert t.pinned[row, page], (req.request_id, page, "tail page not pinned")
            if req.residency == Residency.FULL and req.status in (RequestStatus.ACTIVE,):
                assert t.num_pinned[row] == n, (req.request_id, "FULL request with unpinned pages")
            if req.hot_block_ids:
                assert req.residency != Residency.FULL and req.status in (
                    RequestStatus.ACTIVE,
                    RequestStatus.ACTIVATING,
                ), (req.request_id, "hot lease held outside MIXED/NONE running")
                assert len(req.hot_block_ids) == req.hot_blocks
                for block in req.hot_block_ids:
                    add(dev_leases, block)
            elif req.status == RequestStatus.ACTIVE and req.residency != Residency.FULL:
                raise AssertionError((req.request_id, "MIXED/NONE request without hot lease"))
        for block in extra_device_leases:
            add(dev_leases, int(block))
        for block in extra_host_leases:
            add(host_leases, int(block))
        for txn in self._txns.values():
            for block in txn.held_device_until_enqueued + txn.held_device_until_done:
                add(dev_leases, block)
            for block in txn.held_host_until_done:
                add(host_leases, block)
        for row in range(t.num_rows):
            if self._row_request[row] is None:
                assert t.serial[row] == 0 and t.num_pages[row] == 0
                assert self._row_gate[row] and not self._row_prefilling[row]
                assert row not in self._window_waiting and row not in self._window_candidates
        ref = getattr(self.device_pool, "ref_counts", None)
        if ref is not None:
            assert np.all(ref >= 0)
            expected = np.zeros_like(ref)
            for block, count in dev_leases.items():
                expected[block] = count
            bad = np.nonzero(expected != ref)[0]
            assert bad.shape[0] == 0, f"device leases differ at blocks {bad[:8].tolist()}: " \
                f"expected {expected[bad[:8]].tolist()} got {ref[bad[:8]].tolist()}"
            assert self.device_pool.get_num_free_blocks() == int(np.count_nonzero(ref == 0))
        ref = self.host_pool.ref_counts
        assert np.all(ref >= 0)
        expected = np.zeros_like(ref)
        for block, count in host_leases.items():
            expected[block] = count
        bad = np.nonzero(expected != ref)[0]
        assert bad.shape[0] == 0, f"host leases differ at blocks {bad[:8].tolist()}"
        for block in host_leases:
            assert not self.host_pool.is_free(block)
        assert self.host_pool.num_free_blocks + self.host_pool.num_cached_blocks == int(np.count_nonzero(ref == 0))

    def is_idle(self) -> bool:
        """True when no request and no transfer is open (pools should be at rest)."""
        return not self._requests and len(self._txns) == 0
