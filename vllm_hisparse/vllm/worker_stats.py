"""Worker-side counters of the residency data plane, in vLLM's ``KVConnectorStats`` shape.

Each worker reports, since its previous report:

| key | meaning |
|---|---|
| ``resident`` | distinct selected positions read from a resident page |
| ``hot_hits`` | distinct host-backed selections already in the hot region |
| ``misses`` | distinct host-backed selections copied from the host pool |
| ``bytes_to_host`` | spill + mirror bytes, device → host (all layers) |
| ``bytes_to_device`` | restore bytes, host → device (all layers) |
| ``gather_bytes`` | miss-gather bytes, host → device (all layers of every index group) |
| ``steps`` | step commands applied |
| ``failed_transfers`` | transfers reported failed |

All values are integer counts that add up across workers (tensor-parallel ranks) and across
reports, so :meth:`aggregate` sums and :meth:`reduce` adds the hit rate. The scheduler-side
metrics (``metrics.py``) are separate.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hisparse.vllm.compat import KVConnectorStats

COUNTER_KEYS = ("resident", "hot_hits", "misses", "bytes_to_host", "bytes_to_device",
                "gather_bytes", "steps", "failed_transfers")


@dataclass
class HiSparseWorkerStats(KVConnectorStats):
    """Counters of one or more workers (``data`` maps every key of ``COUNTER_KEYS`` to an int)."""

    def __post_init__(self) -> None:
        unknown = set(self.data) - set(COUNTER_KEYS)
        if unknown:
            raise ValueError(f"HiSparseWorkerStats: unknown counters {sorted(unknown)}; "
                             f"accepted: {', '.join(COUNTER_KEYS)}")
        for key in COUNTER_KEYS:
            self.data[key] = int(self.data.get(key, 0))

    def add(self, **counts: int) -> None:
        """Add to named counters (unknown names raise)."""
        for key, value in counts.items():
            if key not in self.data:
                raise ValueError(f"HiSparseWorkerStats: unknown counter {key!r}; accepted: "
                                 f"{', '.join(COUNTER_KEYS)}")
            self.data[key] += int(value)

    def reset(self) -> None:
        for key in COUNTER_KEYS:
            self.data[key] = 0

    def aggregate(self, other: KVConnectorStats) -> "HiSparseWorkerStats":
        """Sum ``other``'s counters into this object (vLLM's aggregation contract)."""
        if not isinstance(other, HiSparseWorkerStats):
            raise TypeError(f"HiSparseWorkerStats.aggregate: cannot add "
                            f"{type(other).__name__}")
        for key in COUNTER_KEYS:
            self.data[key] += other.data[key]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters plus the hot hit rate over host-backed selections (0 when none)."""
        out: dict[str, int | float] = dict(self.data)
        host_backed = self.data["hot_hits"] + self.data["misses"]
        out["hot_hit_rate"] = self.data["hot_hits"] / host_backed if host_backed else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in COUNTER_KEYS)
