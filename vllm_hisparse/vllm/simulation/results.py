"""What a simulation run reports: :class:`RunResult`, one run's counters (with or without the
connector; the CLI's table and ``--json`` are made of them), and :class:`Progress`, the per-step
line the engine hands to its progress callback (and ``--plot`` draws)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunResult:
    """What one run (with or without the connector) measured."""

    with_connector: bool
    steps: int = 0
    peak_running: int = 0
    mean_running: float = 0.0
    preemptions: int = 0
    finished: int = 0
    generated_tokens: int = 0
    peak_blocks_in_use: int = 0
    peak_blocks_saved: int = 0
    rows_checked: int = 0
    tokens_checked: int = 0
    resident: int = 0
    hot_hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    gather_bytes: int = 0
    restore_bytes: int = 0
    demotions: int = 0
    promotions: int = 0
    released_pages: int = 0
    host_prefix_hit_tokens: int = 0  # loaded from the host tier (prefix hits, resumes)
    published_pages: int = 0
    indexer_rows_checked: int = 0
    # Sums over steps of the hot blocks leased and of the requests holding them.
    hot_block_steps: int = 0
    hot_request_steps: int = 0
    hot_grows: int = 0
    hot_shrinks: int = 0
    #: Of the requests with host-backed selections, the highest share of them that missed
    #: (the first index group's resolves, ``RowHotCounts``).
    worst_request_miss_rate: float = 0.0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: With --tensor-parallel-size > 1: each rank's figures and host memory (``.ranks``);
    #: ``rows_checked`` above then counts the rows of every rank.
    ranks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def hot_hit_rate(self) -> float:
        host = self.hot_hits + self.misses
        return self.hot_hits / host if host else 0.0

    @property
    def miss_rate(self) -> float:
        """Misses over every distinct selection (resident + hot hits + misses)."""
        total = self.resident + self.hot_hits + self.misses
        return self.misses / total if total else 0.0

    @property
    def mean_hot_blocks(self) -> float:
        """Hot blocks per request holding a hot region, averaged over steps (policy
        blocks: one per sparse-MLA group)."""
        return self.hot_block_steps / self.hot_request_steps if self.hot_request_steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["mean_hot_blocks"] = self.mean_hot_blocks
        out["hot_hit_rate"] = self.hot_hit_rate
        out["miss_rate"] = self.miss_rate
        return out


@dataclass
class Progress:
    label: str
    step: int
    running: int
    waiting: int
    finished: int
    total: int
    # For per-step plots: the BlockPool's free blocks after the step, and the worker's
    # selection counters so far (distinct resident / hot hit / miss selections).
    free_blocks: int = 0
    resident: int = 0
    hot_hits: int = 0
    misses: int = 0
