"""The scheduler role's request registries: who is admitted, at which state row, in which
phase, and what host blocks each still has promised.

Every part of the role reads these; they change through the book's verbs:
:meth:`~RequestBook.admit` (vLLM allocated for a managed request),
:meth:`~RequestBook.bind_row` (the policy gave it a state row),
:meth:`~RequestBook.mark_finishing` (vLLM finished it), :meth:`~RequestBook.end_row` and
:meth:`~RequestBook.forget` (vLLM freed it). The book holds no policy: the role tells the
policy, then the book.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_hisparse.core.commands import Residency, StepCommand


class RequestBook:
    """Per-request registries of the scheduler role (module docstring)."""

    def __init__(self, max_num_rows: int, max_decode_query_len: int) -> None:
        self.max_decode_query_len = max_decode_query_len
        # Admitted managed requests (vLLM Request objects), and their state rows.
        self.requests: dict[str, Any] = {}
        self.row_of: dict[str, int] = {}
        self.rid_of_row: list[str | None] = [None] * max_num_rows
        # Finished or aborted by vLLM (not preempted): their free ends them as finished.
        self.finishing: set[str] = set()
        # Free in progress: request id -> [policy pages, sparse groups still to visit].
        self.freeing: dict[str, list[int]] = {}
        # Host blocks promised to admitted requests and not yet taken by the policy.
        self.host_remaining: dict[str, int] = {}
        self.host_outstanding = 0
        # R1: requests the policy was told are prefilling (docs/core.md).
        self.prefilling: set[str] = set()
        # Admitted requests the host pool could not back: vLLM runs them without us.
        self.unmanaged: set[str] = set()
        # Admitted with a host-prefix load, not run yet: id -> prompt pages still to allocate.
        self.loading: dict[str, int] = {}
        # Residency bookkeeping for metrics.
        self.non_full: set[str] = set()
        self.hot_rows: set[int] = set()
        # The previous step's scheduled ids and their state rows (build_connector_meta).
        self.cached_keys: tuple | None = None
        self.cached_rows: np.ndarray | None = None

    # ------------------------------------------------------------------ add
    def admit(self, request: Any, host_pages: int) -> None:
        """vLLM allocated for a managed request that reserves ``host_pages`` host blocks."""
        rid = request.request_id
        self.requests[rid] = request
        self.host_remaining[rid] = host_pages
        self.host_outstanding += host_pages

    def admit_unmanaged(self, rid: str) -> None:
        self.unmanaged.add(rid)

    def mark_loading(self, rid: str, prompt_pages: int) -> None:
        """Admitted with a host-prefix load: ``prompt_pages`` still to allocate once it runs."""
        self.loading[rid] = prompt_pages

    def bind_row(self, rid: str, row: int, prefilling: bool) -> None:
        """The policy added ``rid`` at state ``row``."""
        if prefilling:
            self.prefilling.add(rid)
        self.row_of[rid] = row
        self.rid_of_row[row] = rid
        self.cached_keys = None

    def take_host_reservation(self, rid: str, pages: int) -> int:
        """The policy is about to take up to ``pages`` host blocks for ``rid``: count them
        against its reservation. Returns the blocks counted."""
        remaining = self.host_remaining.get(rid, 0)
        used = min(pages, remaining)
        self.host_remaining[rid] = remaining - used
        self.host_outstanding -= used
        return used

    # ------------------------------------------------------------------ the step
    def rows_of_step(self, keys: tuple) -> np.ndarray | None:
        """The state rows of ``keys`` when they are the previous step's scheduled ids, in
        the same order (adding or ending a request drops this cache); else None."""
        return self.cached_rows if keys == self.cached_keys else None

    def remember_step(self, keys: tuple, rows: np.ndarray) -> None:
        self.cached_keys, self.cached_rows = keys, rows

    def is_prefilling(self, request: Any) -> bool:
        """True while the request has prompt tokens to compute, or more than
        ``max_decode_query_len`` known tokens left (a recompute after vLLM's preemption):
        any step of it may schedule prefill tokens, which read the whole context (R1)."""
        computed = request.num_computed_tokens
        return computed < request.num_prompt_tokens or computed + self.max_decode_query_len < request.num_tokens

    def prefill_progress(self, scheduled: dict[str, int]) -> tuple[list[str], int]:
        """Prefilling requests that completed their prompt (dropped from ``prefilling``),
        and the tokens the others still have to prefill after this step."""
        done = []
        left = 0
        for rid in self.prefilling:
            request = self.requests[rid]
            if not self.is_prefilling(request):
                done.append(rid)
                continue
            left += max(request.num_tokens - request.num_computed_tokens - scheduled.get(rid, 0), 0)
        for rid in done:
            self.prefilling.discard(rid)
        return done, left

    def end_prefill(self, rid: str) -> bool:
        """Drop ``rid`` from ``prefilling``; True if it was there."""
        if rid not in self.prefilling:
            return False
        self.prefilling.discard(rid)
        return True

    def managed(self, scheduled: dict[str, int]) -> dict[str, int]:
        """``scheduled`` without the unmanaged requests; requests admitted with a host-prefix
        load that run now stop being ``loading`` (their load is done, vLLM allocated the rest)."""
        if self.unmanaged:
            scheduled = {rid: n for rid, n in scheduled.items() if rid not in self.unmanaged}
        if self.loading:
            for rid in [rid for rid in self.loading if scheduled.get(rid)]:
                del self.loading[rid]
        return scheduled

    def note_residency(self, command: StepCommand) -> None:
        """Track residency and hot leases for metrics. Cost: proportional to the command."""
        for row in command.cleared_rows:
            self.hot_rows.discard(row)
        for lease in command.hot_leases:
            if lease.block_ids:
                self.hot_rows.add(lease.row)
            else:
                self.hot_rows.discard(lease.row)
        for change in command.residency_changes:
            if change.residency == Residency.FULL:
                self.non_full.discard(change.request_id)
            else:
                self.non_full.add(change.request_id)

    # ------------------------------------------------------------------ end
    def mark_finishing(self, rid: str) -> None:
        """vLLM finished or aborted ``rid`` (not a preemption): its free ends it as finished."""
        self.finishing.add(rid)

    def end_row(self, rid: str) -> int:
        """The policy ended ``rid``: its state row is free. Returns the row."""
        row = self.row_of.pop(rid)
        self.rid_of_row[row] = None
        return row

    def forget(self, rid: str) -> None:
        """vLLM freed ``rid``: drop it from every registry, return its host reservation."""
        self.cached_keys = None
        self.prefilling.discard(rid)
        self.requests.pop(rid, None)
        self.finishing.discard(rid)
        self.unmanaged.discard(rid)
        self.loading.pop(rid, None)
        self.non_full.discard(rid)
        self.host_outstanding -= self.host_remaining.pop(rid, 0)
