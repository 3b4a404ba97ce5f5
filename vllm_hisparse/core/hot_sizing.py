"""Per-request hot-region sizing from the observed miss rate.

A request whose selections are stable needs fewer hot rows than one whose selections drift.
:class:`HotSizer` sizes one request's hot region in whole blocks, between ``min_blocks``
(one step's host-backed selections must fit) and ``max_blocks`` (the table width D / bs):
every ``window_steps`` steps it compares the window's miss rate with ``target_miss_rate`` and
grows by ``grow_blocks`` above ``target * (1 + hysteresis)`` or shrinks by ``shrink_blocks``
below ``target * (1 - hysteresis)``. Under pool pressure it never grows, and it shrinks as soon
as the rate is at or below the target.

The region changes size without moving a slot: ``resolve`` never takes a slot whose hot block
is -1 (docs/design.md, "Op contracts", `resolve`, rule 4), so a shrink sets the last leased blocks to -1 and empties their
slots, a grow leases blocks there again, and the emptied slots lead the LRU order, so a grown
region fills them first. :func:`replay_adaptive` replays exactly that on a selection trace.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class HotSizingConfig:
    """The sizing rule's knobs (see the module docstring)."""

    block_size: int
    min_blocks: int
    max_blocks: int
    target_miss_rate: float
    window_steps: int = 8
    hysteresis: float = 0.2
    grow_blocks: int = 2
    shrink_blocks: int = 1

    def __post_init__(self):
        if self.block_size <= 0 or not 0 < self.min_blocks <= self.max_blocks:
            raise ValueError(f"HotSizingConfig: need block_size > 0 and 0 < min_blocks <= "
                             f"max_blocks, got {self.block_size}, {self.min_blocks}, "
                             f"{self.max_blocks}")
        if not 0 <= self.target_miss_rate < 1 or not 0 <= self.hysteresis < 1:
            raise ValueError("HotSizingConfig: target_miss_rate and hysteresis must be in [0, 1)")
        if self.window_steps <= 0 or self.grow_blocks <= 0 or self.shrink_blocks <= 0:
            raise ValueError("HotSizingConfig: window_steps, grow_blocks and shrink_blocks "
                             "must be positive")


class HotSizer:
    """The size of one request's hot region, in blocks (starts at ``initial_blocks``)."""

    def __init__(self, config: HotSizingConfig, initial_blocks: int | None = None):
        self.config = config
        blocks = config.max_blocks if initial_blocks is None else initial_blocks
        self.blocks = min(max(blocks, config.min_blocks), config.max_blocks)
        self._misses = self._references = self._steps = 0

    def observe(self, misses: int, references: int, under_pressure: bool = False) -> int:
        """Count one step's distinct misses and host-backed references; at the end of a window
        decide and return the (possibly new) size in blocks."""
        self._misses += misses
        self._references += references
        self._steps += 1
        cfg = self.config
        if self._steps < cfg.window_steps:
            return self.blocks
        rate = self._misses / self._references if self._references else 0.0
        self._misses = self._references = self._steps = 0
        if not under_pressure and rate > cfg.target_miss_rate * (1 + cfg.hysteresis):
            self.blocks = min(cfg.max_blocks, self.blocks + cfg.grow_blocks)
        elif rate <= cfg.target_miss_rate * (1 - (0 if under_pressure else cfg.hysteresis)):
            self.blocks = max(cfg.min_blocks, self.blocks - cfg.shrink_blocks)
        return self.blocks


@dataclasses.dataclass
class AdaptiveResult:
    """One request (or a sum of them) replayed with an adaptive hot region."""

    references: int
    misses: int
    block_steps: int  # sum over steps of the blocks held
    steps: int

    @property
    def miss_rate(self) -> float:
        return self.misses / self.references if self.references else 0.0

    @property
    def mean_blocks(self) -> float:
        return self.block_steps / self.steps if self.steps else 0.0


def replay_adaptive(sets: Sequence[np.ndarray], config: HotSizingConfig,
                    initial_blocks: int | None = None, sizer=None) -> AdaptiveResult:
    """Replay one request's selection sets through the kernel's policy (``hisparse``: LRU with
    hit promotion) with a region resized after every step by ``sizer`` (default: a
    :class:`HotSizer` of ``config``; anything with ``blocks`` and ``observe(misses,
    references)``).

    Slots are ``max_blocks * block_size``; slots of unleased blocks are empty, never taken, and
    lead the LRU order (docs/design.md, "Op contracts", `resolve`). Raises ValueError when a step selects more positions
    than the leased slots (``min_blocks`` too small for the trace).
    """
    bs = config.block_size
    num_slots = config.max_blocks * bs
    sizer = HotSizer(config, initial_blocks) if sizer is None else sizer
    slot_pos = np.full(num_slots, -1, dtype=np.int64)
    lru = np.arange(num_slots, dtype=np.int64)
    slot_block = np.arange(num_slots) // bs
    total = AdaptiveResult(0, 0, 0, 0)
    for s, needed in enumerate(sets):
        needed = np.unique(np.asarray(needed, dtype=np.int64))
        leased = slot_block < sizer.blocks
        if needed.shape[0] > int(leased.sum()):
            raise ValueError(f"step {s} selects {needed.shape[0]} positions, more than the "
                             f"{int(leased.sum())} leased slots")
        hit = np.isin(slot_pos, needed)  # by slot
        missing = needed[~np.isin(needed, slot_pos[hit])]
        lru_hit = hit[lru]
        lru_leased = leased[lru]
        evictable = lru[~lru_hit & lru_leased]
        taken = evictable[:missing.shape[0]]
        slot_pos[taken] = missing
        lru = np.concatenate([lru[~lru_hit & ~lru_leased], evictable[missing.shape[0]:], taken,
                              lru[lru_hit]])
        total.references += needed.shape[0]
        total.misses += missing.shape[0]
        total.block_steps += sizer.blocks
        total.steps += 1
        new_blocks = sizer.observe(missing.shape[0], needed.shape[0])
        slot_pos[slot_block >= new_blocks] = -1  # a shrink empties the released blocks' slots
    return total


@dataclasses.dataclass(frozen=True)
class SizingRow:
    """One line of :func:`compare_sizing`: a fixed region or the adaptive rule at a target."""

    label: str
    target_miss_rate: float | None  # None for a fixed region
    miss_rate: float  # over every request
    mean_blocks: float  # per request, averaged over requests and steps
    worst_miss_rate: float  # of the request that misses most
    fixed_blocks_same_worst: float | None = None  # the fixed size with the same worst rate


def compare_sizing(requests: Sequence[Sequence[np.ndarray]], fixed_rows: int, block_size: int,
                   target_scales: Sequence[float] = (1.0, 1.5),
                   fixed_scales: Sequence[float] = (0.75, 1.0, 1.25, 1.5, 1.75, 2.0)
                   ) -> list[SizingRow]:
    """Fixed regions of ``scale x fixed_rows`` (whole blocks) against the adaptive rule with
    the target miss rate ``scale x`` the miss rate of the fixed ``fixed_rows`` region.

    Adaptive regions start at ``fixed_rows`` and stay within ``[ceil(largest set / bs),
    2 x fixed blocks]``. Each adaptive row names the fixed size whose worst request misses as
    often as the adaptive rule's worst request (interpolated between the fixed sizes): a fixed
    size must be provisioned for the request that drifts most.
    """
    from vllm_hisparse.core.replacement import replay_request

    fixed_blocks = fixed_rows // block_size
    largest = max((s.shape[0] for sets in requests for s in sets), default=1)
    min_blocks = min(fixed_blocks, -(-largest // block_size))
    rows, base_rate = [], None
    for scale in sorted(set(fixed_scales) | {1.0}):
        blocks = max(min_blocks, int(round(scale * fixed_blocks)))
        per = [replay_request("hisparse", sets, blocks * block_size) for sets in requests]
        refs = sum(r for _, r in per)
        rate = sum(m for m, _ in per) / refs if refs else 0.0
        if blocks == fixed_blocks:
            base_rate = rate
        rows.append(SizingRow(f"fixed {blocks * block_size} rows", None, rate, float(blocks),
                              max((m / r for m, r in per if r), default=0.0)))
    fixed = sorted(rows, key=lambda r: r.mean_blocks)
    for scale in target_scales:
        config = HotSizingConfig(block_size=block_size, min_blocks=min_blocks,
                                 max_blocks=2 * fixed_blocks,
                                 target_miss_rate=min(0.99, base_rate * scale))
        results = [replay_adaptive(sets, config, initial_blocks=fixed_blocks)
                   for sets in requests]
        misses = sum(r.misses for r in results)
        references = sum(r.references for r in results)
        worst = max((r.miss_rate for r in results), default=0.0)
        rows.append(SizingRow(
            f"adaptive, target {scale:g} x", config.target_miss_rate,
            misses / references if references else 0.0,
            float(np.mean([r.mean_blocks for r in results])) if results else 0.0, worst,
            _blocks_for_worst(fixed, worst)))
    return rows


def _blocks_for_worst(fixed: list[SizingRow], worst: float) -> float | None:
    """Blocks a fixed region needs for its worst request to miss at most ``worst``: linear
    between the fixed sizes measured (ascending), None past the largest."""
    for a, b in zip(fixed, fixed[1:]):
        if a.worst_miss_rate >= worst >= b.worst_miss_rate:
            span = a.worst_miss_rate - b.worst_miss_rate
            frac = (a.worst_miss_rate - worst) / span if span else 1.0
            return a.mean_blocks + frac * (b.mean_blocks - a.mean_blocks)
    if fixed and worst >= fixed[0].worst_miss_rate:
        return fixed[0].mean_blocks
    return None
