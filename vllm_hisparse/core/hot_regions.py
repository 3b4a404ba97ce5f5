"""Adaptive hot regions: one :class:`~vllm_hisparse.core.hot_sizing.HotSizer` per request
with a hot lease, fed by the worker's per-row miss counts, turned into lease resizes.

The worker reports, per state row, the distinct misses and host-backed references its
resolves counted (``observe``). In ``build_step`` (``apply``), each row's counts go to the
sizer of the request in it when that request is ACTIVE, MIXED/NONE, holds a hot lease and is
not being promoted (counts of any other row are dropped). A size change becomes a resize
of the lease in whole blocks (:meth:`PageLeases.resize_hot`, a ``HotLease`` with
``resize=True`` in the command):

* a **grow** takes blocks from the pool only while the pool stays at or above the low
  watermark after it, and never in a step under pressure (free blocks under the low
  watermark, or demand the pool could not meet): it never takes what a demotion would
  have to win back;
* a **shrink** gives the last blocks back to the pool at once.

Counts arrive a step or two late (the worker reads its counters without a sync), so a
row's first counts after it changed hands may still be its previous request's; the sizer
decides on windows of several steps, which dilutes them.
"""

from __future__ import annotations

from typing import Mapping

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.hot_sizing import HotSizer
from vllm_hisparse.core.page_leases import PageLeases
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.request_table import RequestStatus


class HotRegionSizer:
    """The sizers of every request with a hot lease, keyed by state row and serial."""

    def __init__(self, state: PolicyState, leases: PageLeases) -> None:
        self.state = state
        self.leases = leases
        self._sizers: dict[int, tuple[int, HotSizer]] = {}  # row -> (serial, sizer)
        self._pending: dict[int, list[int]] = {}  # row -> [misses, references] not yet fed

    @property
    def num_sized(self) -> int:
        """Requests with a sizer (they had counts while they held a hot lease)."""
        return len(self._sizers)

    def observe(self, counts: Mapping[int, tuple[int, int]]) -> None:
        """Add the worker's ``{state row: (misses, host-backed references)}`` since its
        last report. ``ValueError`` for a row outside the table, a negative count or
        more misses than references."""
        for row, (misses, references) in counts.items():
            row, misses, references = int(row), int(misses), int(references)
            if not 0 <= row < self.state.requests.num_rows or not 0 <= misses <= references:
                raise ValueError(f"hot-region counts: row {row}: ({misses} misses, "
                                 f"{references} references) is invalid; accepted: a state row "
                                 f"in [0, {self.state.requests.num_rows}) and 0 <= misses <= "
                                 "references")
            acc = self._pending.setdefault(row, [0, 0])
            acc[0] += misses
            acc[1] += references

    def apply(self, low_watermark_blocks: int, under_pressure: bool) -> None:
        """Feed the pending counts to the sizers; grow or shrink the leases they resize."""
        pending, self._pending = self._pending, {}
        for row, (misses, references) in pending.items():
            req = self.state.requests.at(row)
            if (req is None or req.status != RequestStatus.ACTIVE or req.promoting
                    or req.residency == Residency.FULL or not req.hot_block_ids):
                self._sizers.pop(row, None)
                continue
            entry = self._sizers.get(row)
            if entry is None or entry[0] != req.serial:
                entry = (req.serial, HotSizer(self.state.config.hot_sizing, len(req.hot_block_ids)))
                self._sizers[row] = entry
            sizer = entry[1]
            current = len(req.hot_block_ids)
            sizer.blocks = current  # a lease made again since (resume) restarts from its size
            wanted = sizer.observe(misses, references, under_pressure)
            if wanted > current and (under_pressure or self.state.device_pool.get_num_free_blocks()
                                     - (wanted - current) < low_watermark_blocks):
                sizer.blocks = current  # no blocks to spare: keep the size
            elif wanted != current:
                self.leases.resize_hot(req, wanted)

    def forget_row(self, row: int) -> None:
        """The row's request ended."""
        self._sizers.pop(row, None)
        self._pending.pop(row, None)
