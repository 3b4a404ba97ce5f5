"""What one engine step tells the worker, collected while the step is planned.

The policy reports, as they happen, the worker table writes (page emission), hot region
leases, residency changes, ended rows and planned transfers; it also records the token
ranges the step's forward writes, which become the step's MIRROR (or sealed-page spills).
:meth:`StepBuilder.build` turns all of it into one :class:`StepCommand` and starts the
next step. Plain lists, converted once per step, keep the per-request cost low.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_hisparse.core.commands import HotLease, Residency, ResidencyChange, StepCommand, TransferSpec


@dataclass
class _StepBuffers:
    """Everything one step has collected so far."""

    # Written ranges: batches of arrays (schedule_rows) and single ranges (schedule).
    range_rows: list[np.ndarray] = field(default_factory=list)
    range_starts: list[np.ndarray] = field(default_factory=list)
    range_ends: list[np.ndarray] = field(default_factory=list)
    range_serials: list[np.ndarray] = field(default_factory=list)
    single_ranges: list[tuple[int, int, int, int]] = field(default_factory=list)
    # Worker table writes, parallel lists.
    page_rows: list[int] = field(default_factory=list)
    page_indices: list[int] = field(default_factory=list)
    page_device: list[int] = field(default_factory=list)
    page_host: list[int] = field(default_factory=list)
    hot_leases: list[HotLease] = field(default_factory=list)
    residency_changes: list[ResidencyChange] = field(default_factory=list)
    cleared_rows: list[int] = field(default_factory=list)
    transfers: list[TransferSpec] = field(default_factory=list)


class StepBuilder:
    """The buffers of the step being planned, and the id it will carry."""

    def __init__(self) -> None:
        self.step_id = 0
        """Id the next :meth:`build` command will carry."""
        self._buf = _StepBuffers()

    # -- written ranges ---------------------------------------------------------------
    def record_ranges(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, serials: np.ndarray) -> None:
        """The forward writes positions ``[starts[i], ends[i])`` of ``rows[i]`` (int64 arrays)."""
        buf = self._buf
        buf.range_rows.append(rows)
        buf.range_starts.append(starts)
        buf.range_ends.append(ends)
        buf.range_serials.append(serials)

    def record_range(self, row: int, start: int, end: int, serial: int) -> None:
        """One range of :meth:`record_ranges`, for the per-request path."""
        self._buf.single_ranges.append((row, start, end, serial))

    def written_ranges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """``(rows, starts, ends, serials)`` of every range recorded this step (int64,
        in recording order, batches first), or None when there is none."""
        buf = self._buf
        if buf.single_ranges:
            singles = np.array(buf.single_ranges, dtype=np.int64)
            self.record_ranges(singles[:, 0], singles[:, 1], singles[:, 2], singles[:, 3])
            buf.single_ranges = []
        if not buf.range_rows:
            return None
        if len(buf.range_rows) == 1:
            return buf.range_rows[0], buf.range_starts[0], buf.range_ends[0], buf.range_serials[0]
        return (
            np.concatenate(buf.range_rows),
            np.concatenate(buf.range_starts),
            np.concatenate(buf.range_ends),
            np.concatenate(buf.range_serials),
        )

    # -- what the worker is told ------------------------------------------------------
    def emit_page(self, row: int, page: int, device_block: int, host_block: int) -> None:
        """Worker table write: page ``page`` of ``row`` is in ``device_block`` (-1 = not on
        the device) and ``host_block`` (-1 = none)."""
        buf = self._buf
        buf.page_rows.append(int(row))
        buf.page_indices.append(int(page))
        buf.page_device.append(int(device_block))
        buf.page_host.append(int(host_block))

    def emit_hot_lease(self, row: int, block_ids: list[int], resize: bool = False) -> None:
        """A new hot region for ``row`` (``[]`` = released), or with ``resize`` the same
        region grown or shrunk to ``block_ids``."""
        self._buf.hot_leases.append(HotLease(row=row, block_ids=block_ids, resize=resize))

    def emit_residency(self, request_id: str, row: int, residency: Residency) -> None:
        self._buf.residency_changes.append(ResidencyChange(request_id=request_id, row=row, residency=int(residency)))

    def add_transfer(self, spec: TransferSpec) -> None:
        self._buf.transfers.append(spec)

    def clear_row(self, row: int) -> None:
        """The row's request ended: drop its pending table writes and hot leases, and tell
        the worker to clear the row."""
        buf = self._buf
        if row in buf.page_rows:
            keep = [i for i, r in enumerate(buf.page_rows) if r != row]
            buf.page_rows = [buf.page_rows[i] for i in keep]
            buf.page_indices = [buf.page_indices[i] for i in keep]
            buf.page_device = [buf.page_device[i] for i in keep]
            buf.page_host = [buf.page_host[i] for i in keep]
        buf.hot_leases = [h for h in buf.hot_leases if h.row != row]
        buf.cleared_rows.append(row)

    def build(self) -> StepCommand:
        """The step's command; the next step starts with empty buffers."""
        buf, self._buf = self._buf, _StepBuffers()
        cmd = StepCommand(
            step_id=self.step_id,
            cleared_rows=buf.cleared_rows,
            page_rows=buf.page_rows,
            page_indices=buf.page_indices,
            page_device_blocks=buf.page_device,
            page_host_blocks=buf.page_host,
            hot_leases=buf.hot_leases,
            residency_changes=buf.residency_changes,
            transfers=buf.transfers,
        )
        self.step_id += 1
        return cmd
