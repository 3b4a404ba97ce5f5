"""Connector statistics (``KVConnectorStats``) and their Prometheus metrics.

Both roles report :class:`HiSparseConnectorStats`: the scheduler role its counters and
gauges, the worker role its data-plane counters (:class:`HiSparseWorkerStats`,
converted by :meth:`HiSparseConnectorStats.from_worker`), because vLLM folds the workers'
report into the scheduler's (``Scheduler.update_from_output``: ``worker_stats.aggregate(
scheduler_stats)``) and, inside ``MultiConnector``, asserts that both have one type. Two kinds
of fields travel in ``data``:

* **counters** — events since the previous report (pages spilled, hot hits, bytes, ...).
  They are *summed* when vLLM aggregates reports: across the scheduler and every worker
  of a step, and across the steps of a logging interval. Any numeric key not listed
  as a gauge is a counter.
* **gauges** — a level observed at report time (host blocks in use, transfers in
  flight, ...). When two reports are combined, the later one wins.

Inside ``MultiConnector`` the stats live under our connector's class name in a
``MultiKVConnectorStats``; vLLM rebuilds them through
``HiSparseResidencyConnector.build_kv_connector_stats`` and hands each child's dict to
its own Prometheus object, so the aggregation above applies unchanged.

Every key of :data:`PROMETHEUS_METRICS` is exported as ``vllm:hisparse_residency_<name>``
(counters with the ``_total`` suffix); the names are stable and listed in docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hisparse.vllm.compat import KVConnectorPromMetrics, KVConnectorStats, VllmConfig, create_metric_per_engine

#: What each worker reports since its previous report, in vLLM's ``KVConnectorStats``
#: shape. Every value is an integer count that adds up across workers (tensor-parallel
#: ranks) and across reports, so :meth:`HiSparseWorkerStats.aggregate` sums and
#: :meth:`HiSparseWorkerStats.reduce` adds the hit rate.
#:
#: | key | meaning |
#: |---|---|
#: | ``resident`` | distinct selected positions read from a resident page |
#: | ``hot_hits`` | distinct host-backed selections already in the hot region |
#: | ``misses`` | distinct host-backed selections copied from the host pool |
#: | ``bytes_to_host`` | spill + mirror bytes, device → host (all layers) |
#: | ``bytes_to_device`` | restore bytes, host → device (all layers) |
#: | ``gather_bytes`` | miss-gather bytes, host → device (all layers of every index group) |
#: | ``steps`` | step commands applied |
#: | ``failed_transfers`` | transfers reported failed |
WORKER_COUNTERS = ("resident", "hot_hits", "misses", "bytes_to_host", "bytes_to_device",
                   "gather_bytes", "steps", "failed_transfers")


#: The residency policy's monotonic counters (``core.stats.PolicyStats`` field) the scheduler
#: role reports as deltas, under their stats key.
POLICY_COUNTERS = {
    "num_spill_pages": "num_spilled_pages",
    "num_restore_pages": "num_restored_pages",
    "num_pages_released": "num_released_pages",
    "num_pages_reused": "num_reused_pages",
    "num_demotions": "num_demotions",
    "num_promotions": "num_promotions",
    "num_failed_transfers": "num_failed_transfers",
    "num_rolled_back_tokens": "num_rolled_back_tokens",
    "num_host_prefix_hit_pages": "num_host_prefix_hit_pages",
    "num_prefix_load_pages": "num_host_prefix_loaded_pages",
    "num_failed_prefix_load_pages": "num_host_prefix_failed_pages",
    "num_published_pages": "num_host_prefix_published_pages",
    "num_hot_grows": "num_hot_region_grows",
    "num_hot_shrinks": "num_hot_region_shrinks",
}

#: Scheduler-side counters (events since the previous report).
SCHEDULER_COUNTERS = (
    *POLICY_COUNTERS.values(),
    "num_duplicate_acks",
    "num_preemptions",
    "num_preemptions_avoided",
    "num_admissions_deferred",
    "num_unmanaged_admissions",
    "num_pd_resident_landings",
    "num_pd_host_landings",
    "num_pd_imported_pages",
    "num_pd_import_failures",
)

#: Scheduler-side gauges (level at report time; the later report wins).
GAUGES = (
    "num_hot_leases",
    "num_host_blocks_used",
    "num_host_blocks_total",
    "num_pending_transfers",
    "num_mixed_requests",
)

#: The prefix of every metric name.
PREFIX = "vllm:hisparse_residency_"

#: Prometheus metrics: stats key -> (name after :data:`PREFIX`, kind, help). Stable; every
#: counter is exported with prometheus_client's ``_total`` suffix; docs/metrics.md lists the
#: same table (``tests/vllm/test_metrics_prometheus.py`` compares the two).
PROMETHEUS_METRICS: dict[str, tuple[str, str, str]] = {
    # scheduler role: residency transitions and page moves
    "num_spilled_pages": ("spilled_pages", "counter",
                          "Pages copied device to host as whole-page spills."),
    "num_restored_pages": ("restored_pages", "counter",
                           "Pages copied host to device (promotion, resume)."),
    "num_released_pages": ("released_pages", "counter",
                           "Clean pages given back to the device pool, readable until reused."),
    "num_reused_pages": ("reused_pages", "counter",
                         "Released pages whose device block was reused (now host-only)."),
    "num_demotions": ("demotions", "counter",
                      "Requests moved from full residency to a hot region (Full to Mixed)."),
    "num_promotions": ("promotions", "counter", "Requests moved back to full residency."),
    "num_failed_transfers": ("failed_transfers", "counter",
                             "Transfers a worker reported failed (retried; nothing is lost)."),
    "num_duplicate_acks": ("duplicate_acks", "counter",
                           "Transfer acks a worker repeated (dropped: acks are idempotent)."),
    "num_preemptions": ("preemptions", "counter",
                        "Requests vLLM preempted while the connector was active."),
    "num_preemptions_avoided": ("preemptions_avoided", "counter",
                                "Allocation failures answered by waiting for in-flight "
                                "transfers that free device blocks instead of preempting."),
    "num_admissions_deferred": ("admissions_deferred", "counter",
                                "Steps whose admission stopped at a waiting request because "
                                "admitting it would leave running requests no free blocks to "
                                "grow into (or the pool was full)."),
    "num_unmanaged_admissions": ("unmanaged_admissions", "counter",
                                 "Requests admitted without residency (all pages on the "
                                 "device, no host copy) because the host pool could not "
                                 "back them."),
    "num_rolled_back_tokens": ("rolled_back_tokens", "counter",
                               "Positions written by a step and then discarded (rejected "
                               "draft tokens): their host copies stop counting as valid."),
    "num_hot_region_grows": ("hot_region_grows", "counter",
                             "Hot regions grown by the adaptive sizing (adaptive_hot_region)."),
    "num_hot_region_shrinks": ("hot_region_shrinks", "counter",
                               "Hot regions shrunk by the adaptive sizing (adaptive_hot_region)."),
    # scheduler role: the host tier as a prefix cache
    "num_host_prefix_hit_pages": ("host_prefix_hit_pages", "counter",
                                  "Prompt pages found in the host pool's prefix cache (not "
                                  "recomputed)."),
    "num_host_prefix_loaded_pages": ("host_prefix_loaded_pages", "counter",
                                     "Host-prefix pages copied into device blocks."),
    "num_host_prefix_failed_pages": ("host_prefix_failed_pages", "counter",
                                     "Host-prefix page loads a worker reported failed (the "
                                     "request fails or is recomputed alone)."),
    "num_host_prefix_published_pages": ("host_prefix_published_pages", "counter",
                                        "Pages published to the host pool's prefix cache once "
                                        "their host copy was complete."),
    # scheduler role: P/D decode consumer (kv_role kv_consumer)
    "num_pd_resident_landings": ("pd_resident_landings", "counter",
                                 "P/D imports landed in resident device pages."),
    "num_pd_host_landings": ("pd_host_landings", "counter",
                             "P/D imports landed in the host tier (host blocks, hot region, "
                             "tail)."),
    "num_pd_imported_pages": ("pd_imported_pages", "counter",
                              "Pages read from a NixlConnector prefill."),
    "num_pd_import_failures": ("pd_import_failures", "counter",
                               "P/D imports that failed (the request fails or is recomputed "
                               "alone, per kv_load_failure_policy)."),
    # scheduler role: levels
    "num_hot_leases": ("hot_leases", "gauge",
                       "Requests holding a hot region (Mixed or None residency)."),
    "num_host_blocks_used": ("host_blocks_used", "gauge",
                             "Host pool blocks leased (cached blocks excluded)."),
    "num_host_blocks_total": ("host_blocks_total", "gauge", "Host pool size in blocks."),
    "num_pending_transfers": ("pending_transfers", "gauge",
                              "Transfers planned and not yet acknowledged by every worker."),
    "num_mixed_requests": ("mixed_requests", "gauge",
                           "Requests not fully resident on the device."),
    # worker role: the data plane (summed over the engine's workers)
    "resident": ("resident_selections", "counter",
                 "Distinct selected positions read from resident pages (all workers)."),
    "hot_hits": ("hot_hits", "counter",
                 "Distinct host-backed selections found in the hot region (all workers)."),
    "misses": ("hot_misses", "counter",
               "Distinct host-backed selections copied from the host pool (all workers)."),
    "gather_bytes": ("miss_gather_bytes", "counter",
                     "Bytes the miss gathers copied host to device, all layers (all workers)."),
    "bytes_to_device": ("restore_bytes", "counter",
                        "Bytes of page restores and host-prefix loads, host to device (all "
                        "workers)."),
    "bytes_to_host": ("host_write_bytes", "counter",
                      "Bytes of row mirrors and page spills, device to host (all workers)."),
    "steps": ("worker_steps", "counter", "Step commands applied, summed over the workers."),
    "failed_transfers": ("worker_failed_transfers", "counter",
                         "Transfers that failed on a worker, summed over the workers."),
}


@dataclass
class HiSparseConnectorStats(KVConnectorStats):
    """Counters and gauges of the residency connector (scheduler and worker roles)."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in self.data)

    def add(self, key: str, value: int | float) -> None:
        """Increment counter ``key`` by ``value``."""
        if value:
            self.data[key] = self.data.get(key, 0) + value

    def set_gauge(self, key: str, value: int | float) -> None:
        """Set gauge ``key`` (must be listed in ``GAUGES``)."""
        if key not in GAUGES:
            raise KeyError(f"{key!r} is not a gauge; gauges: {', '.join(GAUGES)}")
        self.data[key] = value

    def aggregate(self, other: KVConnectorStats) -> HiSparseConnectorStats:
        """Sum counters (any numeric key that is not a gauge); the later gauge wins."""
        for key, value in other.data.items():
            if key in GAUGES or not isinstance(value, (int, float)):
                self.data[key] = value
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """The interval summary the logger prints: every field, plus the hot hit rate
        (hits / host-backed selections) when the workers reported hits or misses."""
        out = {k: v for k, v in self.data.items() if isinstance(v, (int, float))}
        hits, misses = out.get("hot_hits", 0), out.get("misses", 0)
        if hits + misses:
            out["hot_hit_rate"] = round(hits / (hits + misses), 4)
        return out

    @classmethod
    def from_worker(cls, stats: HiSparseWorkerStats | None) -> HiSparseConnectorStats | None:
        """The worker role's counters as this class: vLLM folds the workers' report into the
        scheduler's with ``worker_stats.aggregate(scheduler_stats)`` (``MultiKVConnectorStats``
        asserts both have one type), so both roles report one class."""
        return None if stats is None else cls(data=dict(stats.data))


class HiSparsePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter or gauge per entry of ``PROMETHEUS_METRICS``, per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, tuple[str, dict[int, Any]]] = {}
        for key, (name, kind, doc) in PROMETHEUS_METRICS.items():
            cls = self._counter_cls if kind == "counter" else self._gauge_cls
            metric = cls(name=PREFIX + name, documentation=doc, labelnames=labelnames)
            self._metrics[key] = (kind, create_metric_per_engine(metric, per_engine_labelvalues))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            entry = self._metrics.get(key)
            if entry is None or not isinstance(value, (int, float)):
                continue  # a key of a newer or older version of this package
            kind, per_engine = entry
            if kind == "counter":
                if value:
                    per_engine[engine_idx].inc(value)
            else:
                per_engine[engine_idx].set(value)


@dataclass
class HiSparseWorkerStats(KVConnectorStats):
    """Counters of one or more workers (``data`` maps every key of ``WORKER_COUNTERS`` to an int)."""

    def __post_init__(self) -> None:
        unknown = set(self.data) - set(WORKER_COUNTERS)
        if unknown:
            raise ValueError(f"HiSparseWorkerStats: unknown counters {sorted(unknown)}; "
                             f"accepted: {', '.join(WORKER_COUNTERS)}")
        for key in WORKER_COUNTERS:
            self.data[key] = int(self.data.get(key, 0))

    def add(self, **counts: int) -> None:
        """Add to named counters (unknown names raise)."""
        for key, value in counts.items():
            if key not in self.data:
                raise ValueError(f"HiSparseWorkerStats: unknown counter {key!r}; accepted: "
                                 f"{', '.join(WORKER_COUNTERS)}")
            self.data[key] += int(value)

    def reset(self) -> None:
        for key in WORKER_COUNTERS:
            self.data[key] = 0

    def aggregate(self, other: KVConnectorStats) -> "HiSparseWorkerStats":
        """Sum ``other``'s counters into this object (vLLM's aggregation contract)."""
        if not isinstance(other, HiSparseWorkerStats):
            raise TypeError(f"HiSparseWorkerStats.aggregate: cannot add "
                            f"{type(other).__name__}")
        for key in WORKER_COUNTERS:
            self.data[key] += other.data[key]
        return self

    def reduce(self) -> dict[str, int | float]:
        """The counters plus the hot hit rate over host-backed selections (0 when none)."""
        out: dict[str, int | float] = dict(self.data)
        host_backed = self.data["hot_hits"] + self.data["misses"]
        out["hot_hit_rate"] = self.data["hot_hits"] / host_backed if host_backed else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in WORKER_COUNTERS)
