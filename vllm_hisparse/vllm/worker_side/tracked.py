"""The worker's registry of residency-managed (**tracked**) requests.

A request is tracked from its first non-FULL residency change until its state row is
cleared. Once MIXED or NONE, its pages may sit in blocks that vLLM's batch block table
does not name (a restore leases a new block; vLLM's worker table is append-only), so it
stays tracked even after it is FULL again: the read path resolves its rows and the
prefill guard rewrites its block-table rows.

It also remembers which request last held each state row (any residency), so that a
recorded trace names requests rather than rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_hisparse.core.commands import Residency, StepCommand, TransferKind
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME


class TrackedRequests:
    """Request id → state row of every tracked request (module docstring)."""

    def __init__(self) -> None:
        self._rows: dict[str, int] = {}
        self._request_of_row: dict[int, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, request_id: str) -> int:
        return self._rows[request_id]

    def track(self, request_id: str, row: int) -> None:
        """Start tracking ``request_id`` at state row ``row`` (what a non-FULL change does)."""
        self._rows[request_id] = row

    def apply(self, cmd: StepCommand) -> None:
        """The step's command: cleared rows end tracking, non-FULL changes start it."""
        cleared = set(cmd.cleared_rows)
        if cleared:
            for rid in [r for r, row in self._rows.items() if row in cleared]:
                del self._rows[rid]
        for change in cmd.residency_changes:
            self._request_of_row[change.row] = change.request_id
            if change.residency != Residency.FULL:
                self._rows[change.request_id] = change.row

    def request_of_row(self, row: int) -> str | None:
        """The request a residency change last named at ``row`` (None if none did)."""
        return self._request_of_row.get(row)

    def batch_state_rows(self, request_ids: Sequence[str] | None, cmd: StepCommand,
                         has_step_inputs: bool) -> list[int] | None:
        """State row per batch row for tracked requests (-1 otherwise); None if none is."""
        if not self._rows:
            return None
        if request_ids is None and not has_step_inputs and not any(
                t.kind == TransferKind.MIRROR and t.mirror_rows for t in cmd.transfers):
            # A step without a forward: vLLM's no_forward() passes no step inputs (every
            # scheduled request waits for a load); nothing reads or writes a row.
            return None
        if request_ids is None:
            # Without the batch order no token can be mapped to its row: refuse to guess.
            raise RuntimeError(
                f"{CONNECTOR_NAME}: requests are host-backed but start_load_kv got no "
                "request_ids; forward vLLM's start_load_kv keyword arguments to the worker role")
        rows = [self._rows.get(rid, -1) for rid in request_ids]
        if all(r < 0 for r in rows):
            return None
        return rows
