"""The connector's data-plane counters reach Prometheus through vLLM's own path (issue 18).

A small simulated workload runs on vLLM's real ``Scheduler``: each step the worker role's
stats ride in ``KVConnectorOutput.kv_connector_stats`` as vLLM's model runner sends them, the
scheduler folds them into the scheduler role's report (``update_from_output``), and the step's
``SchedulerStats.kv_connector_stats`` (the dict the engine core sends the API server) goes to
vLLM's ``KVConnectorProm``, which builds our ``HiSparsePromMetrics`` through the connector
class, with real ``prometheus_client`` metrics in a private registry. The registry must then
hold exactly the run's counters. docs/metrics.md must list exactly the exported names.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from vllm_hisparse.vllm.simulation.model import kv_transfer_config, make_vllm_config
from vllm_hisparse.vllm.metrics import GAUGES, PREFIX, PROMETHEUS_METRICS, HiSparseConnectorStats
from vllm_hisparse.vllm.simulation.probe import StepProbe
from vllm_hisparse.vllm.metrics import HiSparseWorkerStats

ROOT = Path(__file__).resolve().parents[2]
LABELS = {"model_name": "m", "engine": "0"}


def prometheus(vllm_config):
    """vLLM's ``KVConnectorProm`` for ``vllm_config``, its metrics in a private registry."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = CollectorRegistry()

    def bound(cls):
        class InRegistry(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)
        return InRegistry

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)

    return registry, Prom(vllm_config, list(LABELS), {0: list(LABELS.values())})


def sample(registry, key: str) -> float | None:
    name, kind, _ = PROMETHEUS_METRICS[key]
    return registry.get_sample_value(PREFIX + name + ("_total" if kind == "counter" else ""),
                                     LABELS)


class SchedulerStatsTap(StepProbe):
    def __init__(self):
        self.payloads: list[dict] = []

    def scheduler_stats(self, step, stats):
        if stats.kv_connector_stats:
            self.payloads.append(stats.kv_connector_stats)


@pytest.fixture(scope="module")
def simulated_run():
    """A tiny run with pool pressure (hot regions, misses, spills): its result and every
    step's connector payload."""
    from vllm_hisparse.vllm.simulation.engine import SimulationEngine, SimulationSpec

    tap = SchedulerStatsTap()
    spec = SimulationSpec(num_layers=2, num_requests=6, prompt_len=384, output_len=96,
                          device_blocks=120, max_num_batched_tokens=512)
    engine = SimulationEngine(spec, probe=tap)
    try:
        result = engine.run(True)
    finally:
        engine.close()
    return result, tap.payloads


def test_the_workers_counters_reach_prometheus_through_vllms_scheduler(simulated_run, dsa_model_dir):
    result, payloads = simulated_run
    assert result.misses > 0 and result.hot_hits > 0 and result.demotions > 0
    registry, prom = prometheus(make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config()))
    for payload in payloads:
        prom.observe(payload, 0)
    assert sample(registry, "hot_hits") == result.hot_hits
    assert sample(registry, "misses") == result.misses
    assert sample(registry, "resident") == result.resident
    assert sample(registry, "gather_bytes") == result.gather_bytes
    assert sample(registry, "bytes_to_device") == result.restore_bytes
    assert sample(registry, "bytes_to_host") == result.bytes_d2h
    assert sample(registry, "steps") == result.steps
    # The scheduler role's counters arrive in the same dicts (reported every 16 steps, so the
    # last few steps' may still be pending when the run ends).
    assert 0 < sample(registry, "num_demotions") <= result.demotions
    assert sample(registry, "num_host_blocks_total") > 0


def test_vllms_log_line_reports_the_hot_hit_rate(simulated_run, dsa_model_dir):
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    result, payloads = simulated_run
    logging = KVConnectorLogging(
        make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config()).kv_transfer_config)
    for payload in payloads:
        logging.observe(payload)
    lines = []
    logging.log(log_fn=lambda fmt, text: lines.append(text))
    (line,) = lines
    rate = float(re.search(r"hot_hit_rate=([\d.]+)", line).group(1))
    assert rate == pytest.approx(result.hot_hits / (result.hot_hits + result.misses), abs=1e-4)


def test_inside_multiconnector_both_roles_fold_and_reach_prometheus(dsa_model_dir):
    """vLLM asserts that the worker's and the scheduler's stats of a MultiConnector child
    have one type before it folds them: both roles report HiSparseConnectorStats."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector, MultiKVConnectorStats)

    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config(under_multi=True))
    registry, prom = prometheus(vllm_config)
    worker = HiSparseWorkerStats()
    worker.add(hot_hits=30, misses=10, gather_bytes=4096, steps=1)
    scheduler = HiSparseConnectorStats()
    scheduler.add("num_host_prefix_hit_pages", 3)
    scheduler.add("num_pd_host_landings", 1)
    scheduler.set_gauge("num_mixed_requests", 2)
    ours = "HiSparseResidencyConnector"
    folded = MultiKVConnectorStats(data={ours: HiSparseConnectorStats.from_worker(worker)}) \
        .aggregate(MultiKVConnectorStats(data={ours: scheduler}))
    payload = folded.to_dict()
    prom.observe(payload, 0)
    assert (sample(registry, "hot_hits"), sample(registry, "misses")) == (30, 10)
    assert sample(registry, "gather_bytes") == 4096
    assert sample(registry, "num_host_prefix_hit_pages") == 3
    assert sample(registry, "num_pd_host_landings") == 1
    assert sample(registry, "num_mixed_requests") == 2
    rebuilt = MultiConnector.build_kv_connector_stats(data=payload)
    assert rebuilt.reduce()[ours]["hot_hit_rate"] == 0.75


def test_every_stats_key_the_code_reports_is_exported():
    from vllm_hisparse.vllm.metrics import POLICY_COUNTERS, SCHEDULER_COUNTERS, WORKER_COUNTERS

    reported = {*SCHEDULER_COUNTERS, *GAUGES, *WORKER_COUNTERS}
    assert reported == set(PROMETHEUS_METRICS)
    assert set(POLICY_COUNTERS.values()) <= set(SCHEDULER_COUNTERS)
    for key, (name, kind, _) in PROMETHEUS_METRICS.items():
        assert (kind == "gauge") == (key in GAUGES), key
        assert re.fullmatch(r"[a-z_]+", name), name
        assert kind == "gauge" or not name.endswith("_total"), name  # the client adds it


def _documented_metrics(text: str) -> dict[str, str]:
    """stats key -> Prometheus name, from docs/metrics.md's table."""
    rows = re.findall(r"^\| `([a-z_]+)` \| `(vllm:hisparse_residency_[a-z_]+)` \|", text, re.M)
    return dict(rows)


def test_docs_list_exactly_the_exported_metrics():
    documented = _documented_metrics((ROOT / "docs" / "metrics.md").read_text())
    exported = {key: PREFIX + name + ("_total" if kind == "counter" else "")
                for key, (name, kind, _) in PROMETHEUS_METRICS.items()}
    assert documented == exported
    # The examples name only metrics that exist.
    for readme in sorted((ROOT / "examples").glob("*/README.md")):
        for name in re.findall(r"vllm:hisparse_residency_[a-z_]+", readme.read_text()):
            assert name in exported.values(), (readme, name)
