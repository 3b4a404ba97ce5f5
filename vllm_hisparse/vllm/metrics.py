"""Connector statistics (``KVConnectorStats``) and their Prometheus metrics.

Two kinds of fields travel in :class:`HiSparseConnectorStats.data`:

* **counters** — events since the previous report (pages spilled, pages released, ...).
  They are *summed* when vLLM aggregates reports: across the scheduler and every worker
  of a step, and across the steps of a logging interval. Any numeric key not listed
  as a gauge is a counter, so the worker role can add its own (hot hits, misses,
  bytes) without touching this file.
* **gauges** — a level observed at report time (host blocks in use, transfers in
  flight, ...). When two reports are combined, the later one wins.

Inside ``MultiConnector`` the stats live under our connector's class name in a
``MultiKVConnectorStats``; vLLM rebuilds them through
``HiSparseResidencyConnector.build_kv_connector_stats`` and hands each child's dict to
its own Prometheus object, so the aggregation above applies unchanged.

Metric names are stable and documented in ``docs/metrics.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hisparse.vllm.compat import KVConnectorPromMetrics, KVConnectorStats, VllmConfig

#: Scheduler-side counters (events since the previous report).
SCHEDULER_COUNTERS = (
    "num_spilled_pages",
    "num_restored_pages",
    "num_released_pages",
    "num_reused_pages",
    "num_demotions",
    "num_promotions",
    "num_failed_transfers",
    "num_duplicate_acks",
    "num_preemptions",
    "num_preemptions_avoided",
    "num_admissions_deferred",
    "num_rolled_back_tokens",
    "num_unmanaged_admissions",
)

#: Scheduler-side gauges (level at report time; the later report wins).
GAUGES = (
    "num_hot_leases",
    "num_host_blocks_used",
    "num_host_blocks_total",
    "num_pending_transfers",
    "num_mixed_requests",
)

#: Prometheus names: data key -> (metric name, kind, help). Stable; see docs/metrics.md.
PROMETHEUS_METRICS: dict[str, tuple[str, str, str]] = {
    "num_spilled_pages": ("vllm:hisparse_residency_spilled_pages", "counter",
                          "Pages copied device to host as whole-page spills."),
    "num_restored_pages": ("vllm:hisparse_residency_restored_pages", "counter",
                           "Pages copied host to device (promotion, resume)."),
    "num_released_pages": ("vllm:hisparse_residency_released_pages", "counter",
                           "Clean pages given back to the device pool, readable until reused."),
    "num_reused_pages": ("vllm:hisparse_residency_reused_pages", "counter",
                         "Released pages whose device block was reused (now host-only)."),
    "num_demotions": ("vllm:hisparse_residency_demotions", "counter",
                      "Requests moved from full residency to a hot region (Full to Mixed)."),
    "num_promotions": ("vllm:hisparse_residency_promotions", "counter",
                       "Requests moved back to full residency."),
    "num_failed_transfers": ("vllm:hisparse_residency_failed_transfers", "counter",
                             "Transfers a worker reported failed (retried; nothing is lost)."),
    "num_preemptions": ("vllm:hisparse_residency_preemptions", "counter",
                        "Requests vLLM preempted while the connector was active."),
    "num_duplicate_acks": ("vllm:hisparse_residency_duplicate_acks", "counter",
                           "Transfer acks a worker repeated (dropped: acks are idempotent)."),
    "num_preemptions_avoided": ("vllm:hisparse_residency_preemptions_avoided", "counter",
                                "Allocation failures answered by waiting for in-flight "
                                "transfers that free device blocks instead of preempting."),
    "num_admissions_deferred": ("vllm:hisparse_residency_admissions_deferred", "counter",
                                "Steps whose admission stopped at a waiting request because "
                                "admitting it would leave running requests no free blocks to "
                                "grow into (or the pool was full)."),
    "num_unmanaged_admissions": ("vllm:hisparse_residency_unmanaged_admissions", "counter",
                                 "Requests admitted without residency (all pages on the "
                                 "device, no host copy) because the host pool could not "
                                 "back them."),
    "num_rolled_back_tokens": ("vllm:hisparse_residency_rolled_back_tokens", "counter",
                               "Positions written by a step and then discarded (rejected "
                               "draft tokens): their host copies stop counting as valid."),
    "num_hot_leases": ("vllm:hisparse_residency_hot_leases", "gauge",
                       "Requests holding a hot region (Mixed or None residency)."),
    "num_host_blocks_used": ("vllm:hisparse_residency_host_blocks_used", "gauge",
                             "Host pool blocks leased or cached."),
    "num_host_blocks_total": ("vllm:hisparse_residency_host_blocks_total", "gauge",
                              "Host pool size in blocks."),
    "num_pending_transfers": ("vllm:hisparse_residency_pending_transfers", "gauge",
                              "Transfers planned and not yet acknowledged by every worker."),
    "num_mixed_requests": ("vllm:hisparse_residency_mixed_requests", "gauge",
                           "Requests not fully resident on the device."),
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
        when the worker reported hits and misses."""
        out = {k: v for k, v in self.data.items() if isinstance(v, (int, float))}
        hits, misses = out.get("num_hot_hits", 0), out.get("num_hot_misses", 0)
        if hits + misses:
            out["hot_hit_rate"] = round(hits / (hits + misses), 4)
        return out


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
        from vllm_hisparse.vllm.compat import create_metric_per_engine

        self._metrics: dict[str, tuple[str, dict[int, Any]]] = {}
        for key, (name, kind, doc) in PROMETHEUS_METRICS.items():
            cls = self._counter_cls if kind == "counter" else self._gauge_cls
            metric = cls(name=name, documentation=doc, labelnames=labelnames)
            self._metrics[key] = (kind, create_metric_per_engine(metric, per_engine_labelvalues))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            entry = self._metrics.get(key)
            if entry is None or not isinstance(value, (int, float)):
                continue  # worker-side fields the worker role exports itself
            kind, per_engine = entry
            if kind == "counter":
                if value:
                    per_engine[engine_idx].inc(value)
            else:
                per_engine[engine_idx].set(value)
