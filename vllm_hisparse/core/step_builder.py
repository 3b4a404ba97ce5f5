"""What one engine step tells the worker, collected while the step is planned.

The policy reports, as they happen, the worker table writes (page emission), hot region
leases, residency changes, ended rows and planned transfers; it also records the token
ranges the step's forward writes, which become the step's MIRROR (or sealed-page spills).
:meth:`StepBuilder.build` turns all of it into one :class:`StepCommand` and starts the
next step. Plain lists, converted once per step, keep the per-request cost low.
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.core.commands import HotLease, Residency, ResidencyChange, StepCommand, TransferSpec


class StepBuilder:
    """The buffers of the step being planned, and the id it will carry."""

    def __init__(self) -> None:
        self.step_id = 0
        """Id the next :meth:`build` command will carry."""
        self._reset()

    def _reset(self) -> None:
        # Written ranges: batches of arrays (schedule_rows) and single ranges (schedule).
        self._range_rows: list[np.ndarray] = []
        self._range_starts: list[np.ndarray] = []
        self._range_ends: list[np.ndarray] = []
        self._range_serials: list[np.ndarray] = []
        self._single_ranges: list[tuple[int, int, int, int]] = []
        # Worker table writes, parallel lists.
        self._page_rows: list[int] = []
        self._page_indices: list[int] = []
        self._page_device: list[int] = []
        self._page_host: list[int] = []
        self._hot_leases: list[HotLease] = []
        self._residency_changes: list[ResidencyChange] = []
        self._cleared_rows: list[int] = []
        self._transfers: list[TransferSpec] = []

    # -- written ranges ---------------------------------------------------------------
    def record_ranges(self, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray, serials: np.ndarray) -> None:
        """The forward writes positions ``[starts[i], ends[i])`` of ``rows[i]`` (int64 arrays)."""
        self._range_rows.append(rows)
        self._range_starts.append(starts)
        self._range_ends.append(ends)
        self._range_serials.append(serials)

    def record_range(self, row: int, start: int, end: int, serial: int) -> None:
        """One range of :meth:`record_ranges`, for the per-request path."""
        self._single_ranges.append((row, start, end, serial))

    def written_ranges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """``(rows, starts, ends, serials)`` of every range recorded this step (int64,
        in recording order, batches first), or None when there is none."""
        if self._single_ranges:
            singles = np.array(self._single_ranges, dtype=np.int64)
            self.record_ranges(singles[:, 0], singles[:, 1], singles[:, 2], singles[:, 3])
            self._single_ranges = []
        if not self._range_rows:
            return None
        if len(self._range_rows) == 1:
            return self._range_rows[0], self._range_starts[0], self._range_ends[0], self._range_serials[0]
        return (
            np.concatenate(self._range_rows),
            np.concatenate(self._range_starts),
            np.concatenate(self._range_ends),
            np.concatenate(self._range_serials),
        )

    # -- what the worker is told ------------------------------------------------------
    def emit_page(self, row: int, page: int, device_block: int, host_block: int) -> None:
        """Worker table write: page ``page`` of ``row`` is in ``device_block`` (-1 = not on
        the device) and ``host_block`` (-1 = none)."""
        self._page_rows.append(int(row))
        self._page_indices.append(int(page))
        self._page_device.append(int(device_block))
        self._page_host.append(int(host_block))

    def emit_hot_lease(self, row: int, block_ids: list[int]) -> None:
        """A new hot region for ``row`` (``[]`` = released)."""
        self._hot_leases.append(HotLease(row=row, block_ids=block_ids))

    def emit_residency(self, request_id: str, row: int, residency: Residency) -> None:
        self._residency_changes.append(ResidencyChange(request_id=request_id, row=row, residency=int(residency)))

    def add_transfer(self, spec: TransferSpec) -> None:
        self._transfers.append(spec)

    def clear_row(self, row: int) -> None:
        """The row's request ended: drop its pending table writes and hot leases, and tell
        the worker to clear the row."""
        if row in self._page_rows:
            keep = [i for i, r in enumerate(self._page_rows) if r != row]
            self._page_rows = [self._page_rows[i] for i in keep]
            self._page_indices = [self._page_indices[i] for i in keep]
            self._page_device = [self._page_device[i] for i in keep]
            self._page_host = [self._page_host[i] for i in keep]
        self._hot_leases = [h for h in self._hot_leases if h.row != row]
        self._cleared_rows.append(row)

    def build(self) -> StepCommand:
        """The step's command; the next step starts with empty buffers."""
        cmd = StepCommand(
            step_id=self.step_id,
            cleared_rows=self._cleared_rows,
            page_rows=self._page_rows,
            page_indices=self._page_indices,
            page_device_blocks=self._page_device,
            page_host_blocks=self._page_host,
            hot_leases=self._hot_leases,
            residency_changes=self._residency_changes,
            transfers=self._transfers,
        )
        self.step_id += 1
        self._reset()
        return cmd
