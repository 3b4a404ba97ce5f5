"""Request growth: the positions each step's forward writes, and the pages they need.

``schedule`` / ``schedule_rows`` of :class:`~vllm_hisparse.core.policy.ResidencyPolicy`
land here once the event is checked. A row that stays inside its last page only moves its
token count and records the written range (the step's MIRROR covers it); a row that crosses
into new pages takes a device and a host block per page through
:meth:`PageLeases.add_pages` (all or nothing), and then either counts towards the admission
window (FULL) or lets the pages that left its tail be released (MIXED/NONE).

``grow_rows`` is vectorised over the rows that stay inside their last page (most decode
steps: every row); Python visits only the rows that grow and the gated ones (not ACTIVE, or
prefilling and not FULL: R1.b).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.errors import ProtocolError
from vllm_hisparse.core.outcome import Outcome
from vllm_hisparse.core.page_leases import PageLeases
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.request_table import Request, RequestStatus
from vllm_hisparse.core.transitions import ResidencyTransitions
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, cdiv

DeviceBlocksFor = Callable[[int, int, int], Sequence[int]]
"""``(row, first_new_page, num_new_pages) -> device block of each new page`` (the engine's)."""


class RequestGrowth:
    """Token counts and new pages of scheduled requests (module docstring)."""

    def __init__(self, state: PolicyState, leases: PageLeases, transitions: ResidencyTransitions) -> None:
        self.state = state
        self.leases = leases
        self.transitions = transitions

    def grow_rows(self, rows: np.ndarray, counts: np.ndarray,
                  device_blocks_for: DeviceBlocksFor | None) -> np.ndarray:
        """See :meth:`ResidencyPolicy.schedule_rows`: ``rows``, ``counts`` int64 ``[n]``;
        returns the int8 ``[n]`` Outcome codes."""
        t = self.state.tables
        requests = self.state.requests
        outcome = np.zeros(rows.shape[0], dtype=np.int8)
        # Gated rows (not ACTIVE, or prefilling and not FULL: R1.b) take the per-request
        # path below; everything else is vectorised.
        not_active = requests.gate[rows]
        # np.count_nonzero and ndarray.nonzero are much cheaper than .any() / flatnonzero
        # on the few hundred entries of a step.
        any_not_active = np.count_nonzero(not_active) > 0
        if any_not_active:
            for i in not_active.nonzero()[0].tolist():
                row = int(rows[i])
                st = int(requests.status[row])
                if st == RequestStatus.ACTIVE:  # a prefilling request that is not FULL
                    outcome[i] = self.transitions.prepare_prefill(requests.at(row))
                    if outcome[i] == Outcome.OK:
                        outcome[i] = self._grow_row(row, int(counts[i]), device_blocks_for)
                    continue
                if st != RequestStatus.ACTIVATING:
                    raise ProtocolError(f"row {row} scheduled while not active (status {st})")
                outcome[i] = Outcome.WAIT_TRANSFER
        starts = t.num_tokens[rows]
        ends = starts + counts
        grows = t.num_pages_for(ends) > t.num_pages[rows]
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
            self.state.steps.record_ranges(fr, fast_starts, fast_ends, t.serial[fr])
        for i in grow_idx.tolist():
            outcome[i] = self._grow_row(int(rows[i]), int(counts[i]), device_blocks_for)
        return outcome

    def _grow_row(self, row: int, count: int, device_blocks_for: DeviceBlocksFor | None) -> Outcome:
        t = self.state.tables
        blocks = None
        if device_blocks_for is not None:
            old = int(t.num_pages[row])
            new = cdiv(int(t.num_tokens[row]) + count, self.state.block_size) - old
            if new > 0:
                blocks = device_blocks_for(row, old, new)
        return self.grow(self.state.requests.at(row), count, blocks)

    def grow(self, req: Request, num_new_tokens: int, device_block_ids: Sequence[int] | None) -> Outcome:
        """``req`` (ACTIVE, and FULL if prefilling) writes ``num_new_tokens`` more positions;
        new pages get ``device_block_ids`` (the engine's) or blocks of the pool. Anything
        but OK changes nothing."""
        if num_new_tokens < 0:
            raise ProtocolError("num_new_tokens must be >= 0")
        t = self.state.tables
        bs = self.state.block_size
        row = req.row
        start = int(t.num_tokens[row])
        end = start + num_new_tokens
        old_pages = int(t.num_pages[row])
        new_pages = cdiv(end, bs) - old_pages
        if new_pages > 0:
            if end > self.state.config.max_pages_per_request * bs:
                raise ProtocolError(f"request {req.request_id!r} grows past max_pages_per_request")
            if device_block_ids is not None and len(device_block_ids) != new_pages:
                raise ProtocolError(f"{len(device_block_ids)} device blocks given for {new_pages} new pages")
            outcome = self.leases.add_pages(req, new_pages, device_block_ids)
            if outcome == Outcome.WAIT_DEVICE:
                self.transitions.unmet_device_blocks += new_pages
            if outcome != Outcome.OK:
                return outcome
            if req.residency == Residency.FULL:
                self.transitions.note_growth(req, old_pages, new_pages)
            elif not req.promoting:
                # Pages that just left the tail may now be released.
                for page in range(max(0, old_pages - ACTIVE_TAIL_PAGES), old_pages + new_pages - ACTIVE_TAIL_PAGES):
                    self.leases.try_release(req, page)
        t.num_tokens[row] = end
        if num_new_tokens > 0:
            self.state.steps.record_range(row, start, end, req.serial)
        return Outcome.OK
