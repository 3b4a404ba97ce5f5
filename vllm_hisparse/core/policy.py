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

:class:`ResidencyPolicy` is the protocol the engine drives. It checks each event and
orchestrates the parts that carry it out (docs/core.md, "Module map"): page leases, the
transfer planner, residency transitions (selection rules in
:mod:`~vllm_hisparse.core.pressure`), request growth, host prefixes, imports and hot-region
sizing. What they share (page tables, request table, step builder, pools, counters) is one
:class:`~vllm_hisparse.core.policy_state.PolicyState`, built here. Requirement R1 (a
prefilling request is never demoted, never releases a page and is promoted at once) is
described in docs/core.md.

Per-step work is proportional to what changed: scheduling, mirroring and their acks are
vectorised over the scheduled rows; Python loops only over pages that crossed a boundary and
requests that change state.
"""

from __future__ import annotations

from typing import AbstractSet, Hashable, Mapping, Sequence

import numpy as np

from vllm_hisparse.core.commands import Residency, StepCommand, WorkerAcks
from vllm_hisparse.core.device_pool import DevicePool
from vllm_hisparse.core.errors import ProtocolError
from vllm_hisparse.core.growth import DeviceBlocksFor, RequestGrowth
from vllm_hisparse.core.host_blocks import HostBlockPool
from vllm_hisparse.core.host_prefix import HostPrefixes
from vllm_hisparse.core.hot_regions import HotRegionSizer
from vllm_hisparse.core.imports import ImportLedger
from vllm_hisparse.core.invariants import HeldLeases, check_pool_leases, check_records
from vllm_hisparse.core.outcome import AddResult, Outcome
from vllm_hisparse.core.page_leases import PageLeases
from vllm_hisparse.core.page_table import PageTable
from vllm_hisparse.core.policy_config import PolicyConfig
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.pressure import blocks_spared
from vllm_hisparse.core.request_table import Request, RequestStatus
from vllm_hisparse.core.rollback import roll_back_rows
from vllm_hisparse.core.stats import PolicyStats
from vllm_hisparse.core.transfer_planner import TransferPlanner
from vllm_hisparse.core.transitions import ResidencyTransitions
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, cdiv

__all__ = ["AddResult", "Outcome", "PolicyConfig", "PolicyStats", "RequestStatus", "ResidencyPolicy"]


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
        state = self._state = PolicyState.create(config, device_pool, host_pool)
        self.config = config
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.block_size = state.block_size
        self.tables = state.tables
        """Every row's page table: tests and checkers; the engine asks the row queries."""
        self.stats = state.stats
        self._steps = state.steps
        self._requests = state.requests
        self._leases = PageLeases(state)
        self._planner = TransferPlanner(state, self._leases)
        self._transitions = ResidencyTransitions(state, self._leases, self._planner)
        self._growth = RequestGrowth(state, self._leases, self._transitions)
        self._prefixes = HostPrefixes(state, self._planner)
        self._imports = ImportLedger(state, self._leases)
        self._hot_sizer = None if config.hot_sizing is None else HotRegionSizer(state, self._leases)

    # =====================================================================================
    # Queries
    # =====================================================================================
    @property
    def step_id(self) -> int:
        """Id the next ``build_step`` command will carry."""
        return self._steps.step_id

    @property
    def low_watermark_blocks(self) -> int:
        """Below this many free device blocks, requests are demoted (settable)."""
        return self._transitions.low_watermark_blocks

    @low_watermark_blocks.setter
    def low_watermark_blocks(self, num_blocks: int) -> None:
        self._transitions.low_watermark_blocks = int(num_blocks)

    @property
    def high_watermark_blocks(self) -> int:
        """Target of demotions and floor of promotions, in free device blocks (settable)."""
        return self._transitions.high_watermark_blocks

    @high_watermark_blocks.setter
    def high_watermark_blocks(self, num_blocks: int) -> None:
        self._transitions.high_watermark_blocks = int(num_blocks)

    @property
    def num_requests(self) -> int:
        """Requests known to the policy."""
        return len(self._requests)

    @property
    def num_open_transfers(self) -> int:
        """Transactions planned and not yet completed or failed."""
        return len(self._planner.txns)

    def open_transfers(self):
        """The open transactions (read only), in id order: for checkers and tests."""
        return tuple(self._planner.txns.values())

    def has_request(self, request_id: str) -> bool:
        """True when the policy knows ``request_id``."""
        return request_id in self._requests

    def row_of(self, request_id: str) -> int:
        """State row of a request."""
        return self._requests.get(request_id).row

    def residency(self, request_id: str) -> Residency:
        """Residency state of a request."""
        return self._requests.get(request_id).residency

    def status(self, request_id: str) -> RequestStatus:
        """Scheduling status of a request."""
        return self._requests.get(request_id).status

    def is_ready(self, request_id: str) -> bool:
        """True when the request may be scheduled."""
        return self._requests.get(request_id).status == RequestStatus.ACTIVE

    def hot_block_ids(self, request_id: str) -> list[int]:
        """Device blocks of the request's hot region lease (empty when it has none)."""
        return list(self._requests.get(request_id).hot_block_ids)

    def page_table(self, request_id: str) -> PageTable:
        """Snapshot of a request's page table."""
        return self.tables.view(self._requests.get(request_id).row)

    def request_ids(self) -> list[str]:
        """Ids of every known request."""
        return self._requests.ids()

    @property
    def non_full_rows(self) -> AbstractSet[int]:
        """State rows whose request is MIXED or NONE (any status), as a live read-only view
        (no copy: take ``set(...)`` of it before iterating across calls that change residency)."""
        return self._requests.non_full_rows
    def num_device_blocks_pending_release(self) -> int:
        """Device blocks the policy gives back once the transfers now in flight are
        acknowledged successfully (pages released on completion, and leases transfers hold
        for ended requests), in policy blocks. O(non-FULL rows x pages + open transfers):
        for the rare failed allocation (vLLM's ``has_pending_block_frees``); docs/core.md,
        "Engine hooks and queries", gives the exact rules."""
        return self._planner.num_device_blocks_pending_release()

    def num_device_blocks_saved(self) -> int:
        """Device blocks residency spares now: blocks the known requests' released and
        host-only pages free (a released page of a prefix another request still pins frees
        nothing), minus the blocks of every hot region. What the requests would hold on top
        of today's leases if every page were resident; negative while hot regions cost more
        than the pages released. O(rows) while every page is pinned, else O(rows x pages)
        (``pressure.blocks_spared``)."""
        return blocks_spared(self.tables) - self._leases.num_hot_blocks_leased

    def lookup_host_prefix(self, block_hashes: Sequence[Hashable]) -> int:
        """Pages of ``block_hashes`` published in the host pool (no lease taken)."""
        return len(self._prefixes.lookup(block_hashes))

    def acquire_host_prefix(self, block_hashes: Sequence[Hashable], max_pages: int | None = None) -> list[int]:
        """Lease the longest published host prefix of ``block_hashes`` (at most ``max_pages``).

        Returns its host blocks, one lease each, owned by the caller until it hands them to
        :meth:`adopt_host_prefix` or gives them back with :meth:`release_host_prefix`.
        The lease keeps the blocks from being evicted between the engine's lookup and
        its allocation."""
        return self._prefixes.acquire(block_hashes, max_pages)

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
        """A new request starts with ``n = len(device_block_ids)`` full pages of host
        prefix, in blocks the engine allocated (the policy takes over one lease of each)
        and host blocks leased by :meth:`acquire_host_prefix`. Pages ``[first_load_page,
        n)`` are loaded by one RESTORE before this step's forward; the request is FULL and
        clean. Call it on a request just added, before it is scheduled. Returns the
        RESTORE's transfer id (-1 when every page is already on the device); docs/core.md,
        "Engine hooks and queries"."""
        req = self._requests.get(request_id)
        return self._prefixes.adopt(req, device_block_ids, host_block_ids, first_load_page)

    def set_block_hashes(self, request_id: str, first_page: int, block_hashes: Sequence[Hashable | None]) -> int:
        """Give pages ``first_page ..`` their prefix identity (``None`` = unknown).

        A page is published in the host pool once it has an identity and is clean
        (whichever comes last), so the engine hands identities over only when the host
        holds everything a later hit must load (e.g. the indexer's page too). Returns
        how many pages this call published."""
        return self._prefixes.set_block_hashes(self._requests.get(request_id), first_page, block_hashes)

    def revoke_block_hashes(self, transfer_id: int, pages: Sequence[tuple[str, int, int, int]]) -> None:
        """Withdraw identities given with :meth:`set_block_hashes` before their host copy
        was known to be complete (the engine learned that part of it failed).

        ``pages``: ``(request id, serial, page, host block)``; the serial (see
        :meth:`serial_of`) ignores a request id reused by a later incarnation. Pages of
        ended requests are no longer published by transfer ``transfer_id``'s completion.
        Revoke before applying the acks that complete the transfer."""
        self._prefixes.revoke(transfer_id, pages)

    def serial_of(self, request_id: str) -> int:
        """The incarnation number of a live request (unique over the policy's life)."""
        return self._requests.get(request_id).serial

    # -- by state row: O(1) or one numpy gather, for the engine's per-step paths. Each
    # answer is a copy: holding it never sees, nor changes, the policy's later state.
    def serial_at(self, row: int) -> int:
        """The incarnation in state row ``row`` (:meth:`serial_of`; 0 = free row): a
        ``(row, serial)`` pair kept across steps still names its request while they agree."""
        return int(self.tables.serial[row])

    def serials_at(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`serial_at` of each of ``rows`` (integer array ``[n]`` of state rows):
        int64 ``[n]``."""
        return self.tables.serial[rows]

    def num_tokens_at(self, rows: np.ndarray) -> np.ndarray:
        """Positions written or scheduled (this step's ``schedule`` included) in each of
        ``rows`` (integer array ``[n]`` of state rows): int64 ``[n]``; 0 for a free row."""
        return self.tables.num_tokens[rows]

    def num_pages_at(self, row: int) -> int:
        """Pages of the request in state row ``row`` (0 for a free row)."""
        return int(self.tables.num_pages[row])

    def host_blocks_at(self, row: int, first_page: int, end_page: int) -> np.ndarray:
        """Host blocks of pages ``[first_page, end_page)`` of state row ``row``: int32
        ``[end_page - first_page]``, ``-1`` for a page with none. ``ValueError`` unless
        ``0 <= first_page <= end_page <= config.max_pages_per_request``."""
        if not 0 <= first_page <= end_page <= self.tables.max_pages:
            raise ValueError(f"pages [{first_page}, {end_page}) outside [0, {self.tables.max_pages}]")
        return self.tables.host_block[row, first_page:end_page].copy()

    def can_admit(self, num_prompt_tokens: int, num_host_hit_pages: int = 0, hot_rows: int | None = None) -> Outcome:
        """Whether a new request fits device, host and hot capacity together.

        Device: a request computed from scratch needs its first admission window of pages;
        one with host hits needs its hot region plus the tail pages. Host: every page not
        served by a hit. Nothing is reserved; ``schedule`` re-checks when it allocates.
        """
        pages = cdiv(int(num_prompt_tokens), self.block_size)
        hot = self.config.hot_blocks_for(hot_rows)
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
        hot_blocks = self.config.hot_blocks_for(hot_rows)
        req = self._requests.add(request_id, state_row=state_row, hot_blocks=hot_blocks,
                                 block_hashes=block_hashes, prefilling=prefilling)
        row = req.row
        self.tables.serial[row] = req.serial
        num_hit_pages = self._prefixes.take_over_hits(req)
        if not num_hit_pages:
            return AddResult(row=row, num_host_hit_tokens=0, outcome=Outcome.OK)
        outcome = self.resume(request_id)
        return AddResult(row=row, num_host_hit_tokens=num_hit_pages * self.block_size, outcome=outcome)

    def schedule(self, request_id: str, num_new_tokens: int, device_block_ids: Sequence[int] | None = None) -> Outcome:
        """Reserve pages for ``num_new_tokens`` positions the next forward writes.

        New pages get a device block (from ``device_block_ids`` when the engine already
        allocated them, the policy taking over one lease each; else from the device pool)
        and a host block. All or nothing: on back-pressure nothing changes.
        """
        req = self._requests.get(request_id)
        if req.status != RequestStatus.ACTIVE:
            if req.status == RequestStatus.ACTIVATING:
                return Outcome.WAIT_TRANSFER
            raise ProtocolError(f"request {request_id!r} scheduled while {req.status.name}")
        if req.prefilling and req.residency != Residency.FULL:
            outcome = self._transitions.prepare_prefill(req)
            if outcome != Outcome.OK:
                return outcome
        return self._growth.grow(req, int(num_new_tokens), device_block_ids)

    def schedule_rows(
        self,
        rows: np.ndarray,
        num_new_tokens: np.ndarray,
        device_blocks_for: DeviceBlocksFor | None = None,
    ) -> np.ndarray:
        """Batched ``schedule`` by state row (each row at most once). Returns Outcome codes.

        Rows that stay inside their current last page take a vectorised fast path; only rows
        that need new pages go through per-request allocation. An engine that allocates
        its own pages passes ``device_blocks_for(row, first_new_page, num_new_pages)``,
        called for each such row, returning the device block of each new page (the
        ``device_block_ids`` of ``schedule``); without it the policy allocates them.
        """
        rows = np.asarray(rows, dtype=np.int64)
        return self._growth.grow_rows(rows, np.asarray(num_new_tokens, dtype=np.int64), device_blocks_for)

    def roll_back(self, rows: np.ndarray, num_tokens: np.ndarray) -> int:
        """The engine discarded positions it had scheduled (rejected draft tokens): the
        requests in ``rows`` (int64 ``[n]`` distinct state rows) hold valid KV for their first
        ``num_tokens`` (int64 ``[n]``) positions only. Call it before applying the acks of the
        step that wrote them. Their host rows stop counting as valid, open copies are
        clipped, and the next ``schedule`` continues from there
        (:mod:`~vllm_hisparse.core.rollback`). Returns the positions rolled back."""
        rolled = roll_back_rows(self.tables, self._requests, self._planner.txns, rows, num_tokens)
        self.stats.num_rolled_back_tokens += rolled
        return rolled

    def finish(self, request_id: str) -> None:
        """The request finished: publish its clean pages, return every lease."""
        self._end_request(self._requests.get(request_id), publish=True)

    def abort(self, request_id: str, publish: bool = True) -> None:
        """The request was cancelled. Its computed KV is still correct, so clean pages are
        published unless ``publish`` is False."""
        self._end_request(self._requests.get(request_id), publish=publish)

    def preempt(self, request_id: str) -> None:
        """Park a running request: release its hot lease, keep its host pages.

        Pages whose written rows are all on the host are released readable (a later resume
        re-pins them for free if the pool did not reuse them). Pages not yet on the host stay
        pinned and get spilled; they are released when the spill completes. Nothing is lost,
        and resuming never recomputes.
        """
        req = self._requests.get(request_id)
        if req.status not in (RequestStatus.ACTIVE, RequestStatus.ACTIVATING):
            raise ProtocolError(f"request {request_id!r} preempted while {req.status.name}")
        self._transitions.park(req)

    def resume(self, request_id: str) -> Outcome:
        """Re-activate a PARKED request (after preemption, import or a host prefix hit).

        The tail pages are made resident (re-pinned if their released block was not reused,
        else restored from host) and a hot region is leased; state NONE. A request whose
        every page is still pinned comes back FULL with no hot region.

        A prefilling request (R1.b) is then promoted at once: every released page is
        re-pinned and every host-only page restored; the outcome is OK only once it is
        FULL (``WAIT_TRANSFER`` while the restores are in flight).
        """
        req = self._requests.get(request_id)
        if req.status != RequestStatus.PARKED:
            raise ProtocolError(f"request {request_id!r} resumed while {req.status.name}")
        outcome = self._transitions.activate(req)
        if outcome == Outcome.WAIT_DEVICE or not req.prefilling or req.residency == Residency.FULL:
            return outcome
        return self._transitions.prepare_prefill(req)

    def begin_import(self, request_id: str, num_tokens: int,
                     tail_device_blocks: Sequence[int] | None = None) -> list[int]:
        """P/D import: hand out host blocks for ``num_tokens`` positions an external
        transfer writes. Raises :class:`HostPoolExhausted` (back-pressure) if short.

        ``tail_device_blocks``: the engine allocated (and pins) one device block for each of
        the last ``min(ACTIVE_TAIL_PAGES, pages)`` pages, and the transfer writes those pages
        there as well as to the host. The policy takes over one lease of each (as for
        growth) and leases the hot region now, so that :meth:`finish_import` activates the
        request at once, NONE, with no restore. :class:`DevicePoolExhausted` (nothing
        changed) when the pool cannot give the hot region.
        """
        return self._imports.begin(self._requests.get(request_id), int(num_tokens), tail_device_blocks)

    def finish_import(self, request_id: str, success: bool) -> Outcome:
        """The external transfer into the imported host blocks finished.

        On success the pages are host-valid and the request is activated like a resume
        (state NONE); an import begun with ``tail_device_blocks`` is ACTIVE at once (``OK``).
        On failure the host blocks (and the hot region) are returned, the engine's tail
        blocks are left to the engine, and the request restarts at zero tokens
        (``Outcome.RECOMPUTE``).
        """
        outcome = self._imports.finish(self._requests.get(request_id), bool(success))
        return self.resume(request_id) if outcome is None else outcome

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
        req = self._requests.get(request_id)
        prefilling = bool(prefilling)
        if req.prefilling != prefilling:
            self._requests.set_prefilling(req, prefilling)
            self._transitions.note_prefilling(req)
            if not prefilling and req.residency != Residency.FULL and req.status == RequestStatus.ACTIVE \
                    and not req.promoting:
                self._leases.release_all_releasable(req)  # releases were held back while prefilling
        if not prefilling or req.residency == Residency.FULL:
            return Outcome.OK if req.status == RequestStatus.ACTIVE else Outcome.WAIT_TRANSFER
        if req.status not in (RequestStatus.ACTIVE, RequestStatus.ACTIVATING):
            return Outcome.WAIT_TRANSFER  # parked or importing: resume / finish_import handle it
        return self._transitions.prepare_prefill(req)

    def is_prefilling(self, request_id: str) -> bool:
        """What the engine last told :meth:`set_prefilling` (or ``add_request``)."""
        return self._requests.get(request_id).prefilling

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
        self._transitions.unmet_device_blocks += num_blocks

    # =====================================================================================
    # Worker acknowledgements and the step
    # =====================================================================================
    def apply_acks(self, acks: WorkerAcks) -> None:
        """Apply worker reports: enqueued first, then completed, then failed.

        The batch is checked as a whole first: an unknown or already finished id, or a
        second ``enqueued``, raises :class:`ProtocolError` and nothing of the batch is
        applied."""
        self._planner.check_acks(acks)
        self._planner.apply_acks(acks)

    def observe_hot_counts(self, counts: Mapping[int, tuple[int, int]]) -> None:
        """The worker's ``{state row: (misses, host-backed references)}`` since its last
        report; with ``config.hot_sizing`` they resize hot regions in the next
        ``build_step`` (:mod:`~vllm_hisparse.core.hot_regions`), else they are ignored."""
        if self._hot_sizer is not None:
            self._hot_sizer.observe(counts)

    def build_step(self) -> StepCommand:
        """Plan mirrors, spills, demotions, promotions and hot-region resizes; return the
        worker's command."""
        tr = self._transitions
        pressure = tr.unmet_device_blocks > 0 or self.device_pool.get_num_free_blocks() < tr.low_watermark_blocks
        self._planner.plan_step()
        tr.apply_pressure()
        if self._hot_sizer is not None:
            self._hot_sizer.apply(tr.low_watermark_blocks, pressure)
        return self._steps.build()

    # =====================================================================================
    # Internals
    # =====================================================================================
    def _end_request(self, req: Request, publish: bool) -> None:
        self._planner.take_over_ended(req, publish)
        self._leases.return_all(req)
        self._steps.clear_row(req.row)
        self.tables.reset_row(req.row)
        self._transitions.forget_row(req.row)
        self._planner.forget_row(req.row)
        if self._hot_sizer is not None:
            self._hot_sizer.forget_row(req.row)
        self._requests.remove(req)

    def check_invariants(self) -> None:
        """Raise AssertionError if a residency invariant is broken (tests and debugging;
        O(everything)); see :mod:`~vllm_hisparse.core.invariants`."""
        check_pool_leases(self.device_pool, self.host_pool, self.check_records())

    def check_records(self) -> HeldLeases:
        """The invariants of the policy's own records (AssertionError if one is broken), and
        the leases they hold, which the pools' counts match when nobody else holds blocks."""
        return check_records(self._state, self._leases.released_owner, self._planner.txns,
                             self._transitions)

    def is_idle(self) -> bool:
        """True when no request and no transfer is open (pools should be at rest)."""
        return not len(self._requests) and len(self._planner.txns) == 0
