"""The residency policy's monotonic counters."""

from __future__ import annotations

from dataclasses import dataclass


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
    num_rolled_back_tokens: int = 0
    num_hot_grows: int = 0
    num_hot_shrinks: int = 0
