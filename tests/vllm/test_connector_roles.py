"""The façade's role dispatch and the connector's metrics (real vLLM types)."""

from __future__ import annotations

import sys
import types

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tests.vllm.scheduler_harness import planned_kv_cache_config
from vllm_hisparse.vllm.simulation.model import (
    dsa_layer_specs,
    kv_transfer_config,
    make_vllm_config,
)
from vllm_hisparse.vllm.compat import KVConnectorRole
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata
from vllm_hisparse.vllm.metrics import GAUGES, PROMETHEUS_METRICS, HiSparseConnectorStats
from vllm_hisparse.core.commands import StepCommand


class _RecordingWorkerRole:
    instances: list = []

    def __init__(self, vllm_config, hisparse_config, kv_cache_config):
        self.calls = [("init", hisparse_config.host_pool_gib, len(kv_cache_config.kv_cache_groups))]
        _RecordingWorkerRole.instances.append(self)

    def register_kv_caches(self, kv_caches):
        self.calls.append(("register_kv_caches", sorted(kv_caches)))

    def bind_step_metadata(self, bound=True):
        self.calls.append(("bind_step_metadata", bound))

    def start_load_kv(self, metadata):
        self.calls.append(("start_load_kv", metadata.command.step_id))

    def wait_for_save(self):
        self.calls.append(("wait_for_save",))

    def build_worker_meta(self):
        self.calls.append(("build_worker_meta",))
        return HiSparseWorkerMetadata()

    def get_stats(self):
        from vllm_hisparse.vllm.metrics import HiSparseWorkerStats

        return HiSparseWorkerStats(data={"hot_hits": 3})

    def shutdown(self):
        self.calls.append(("shutdown",))


def test_worker_role_delegates_to_hisparse_worker_role(dsa_model_dir, monkeypatch):
    module = types.ModuleType("vllm_hisparse.vllm.worker_side.role")
    module.WorkerRole = _RecordingWorkerRole
    monkeypatch.setitem(sys.modules, "vllm_hisparse.vllm.worker_side.role", module)
    from vllm_hisparse.connector import HiSparseResidencyConnector

    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}))
    kv_cache_config = planned_kv_cache_config(vllm_config, dsa_layer_specs(4), 1000)
    connector = HiSparseResidencyConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    role = _RecordingWorkerRole.instances[-1]
    connector.register_kv_caches({"a": None})
    connector.bind_connector_metadata(HiSparseConnectorMetadata(command=StepCommand(step_id=7)))
    connector.start_load_kv(None)
    connector.wait_for_layer_load("a")
    connector.save_kv_layer("a", None, None)
    connector.wait_for_save()
    assert isinstance(connector.build_connector_worker_meta(), HiSparseWorkerMetadata)
    connector.clear_connector_metadata()
    # Reported as the scheduler role's class: vLLM folds the two (one type, under
    # MultiConnector an assert), tests/vllm/test_metrics_prometheus.py.
    stats = connector.get_kv_connector_stats()
    assert type(stats) is HiSparseConnectorStats and stats.data["hot_hits"] == 3
    connector.shutdown()
    assert [c[0] for c in role.calls] == [
        "init", "register_kv_caches", "bind_step_metadata", "start_load_kv", "wait_for_save",
        "build_worker_meta", "bind_step_metadata", "shutdown"]
    assert role.calls[0] == ("init", 1, 5)
    assert role.calls[2] == ("bind_step_metadata", True) and role.calls[6][1] is False
    assert role.calls[3] == ("start_load_kv", 7)


def test_stats_sum_counters_keep_latest_gauges_and_extend():
    a = HiSparseConnectorStats()
    a.add("num_spilled_pages", 2)
    a.set_gauge("num_pending_transfers", 5)
    b = HiSparseConnectorStats(data={"num_spilled_pages": 3, "num_pending_transfers": 1,
                                     "hot_hits": 6, "misses": 2})  # worker fields
    merged = a.aggregate(b)
    assert merged.data["num_spilled_pages"] == 5
    assert merged.data["num_pending_transfers"] == 1
    assert merged.reduce()["hot_hit_rate"] == 0.75
    with pytest.raises(KeyError, match="not a gauge"):
        a.set_gauge("num_spilled_pages", 1)
    merged.reset()
    assert merged.is_empty()


def test_stats_inside_multiconnector():
    from vllm_hisparse.vllm.compat import multi_connector_types

    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiKVConnectorStats

    ours = HiSparseConnectorStats(data={"num_released_pages": 4})
    multi = MultiKVConnectorStats(data={"HiSparseResidencyConnector": ours})
    multi = multi.aggregate(MultiKVConnectorStats(
        data={"HiSparseResidencyConnector": HiSparseConnectorStats(data={"num_released_pages": 1})}))
    assert multi.reduce()["HiSparseResidencyConnector"]["num_released_pages"] == 5
    # Rebuilt from plain dicts (stats cross process boundaries as dicts).
    multi_cls = multi_connector_types()[0]
    rebuilt = multi_cls.build_kv_connector_stats(data={"HiSparseResidencyConnector": {"num_released_pages": 2}})
    assert isinstance(rebuilt.data["HiSparseResidencyConnector"], HiSparseConnectorStats)


def test_prometheus_metrics_names_and_observe(dsa_model_dir):
    from vllm_hisparse.connector import HiSparseResidencyConnector

    registry = CollectorRegistry()

    def bound(cls):
        class _Bound(cls):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, registry=registry, **kwargs)
        return _Bound

    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    prom = HiSparseResidencyConnector.build_prom_metrics(
        vllm_config, {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)},
        ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe({"num_released_pages": 4, "num_pending_transfers": 2, "hot_hits": 9,
                  "a_key_of_another_version": 1}, engine_idx=0)
    prom.observe({"num_released_pages": 1, "num_pending_transfers": 0}, engine_idx=0)
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:hisparse_residency_released_pages_total", labels) == 5
    assert registry.get_sample_value("vllm:hisparse_residency_pending_transfers", labels) == 0
    assert registry.get_sample_value("vllm:hisparse_residency_hot_hits_total", labels) == 9
    for key, (name, kind, _) in PROMETHEUS_METRICS.items():
        assert (kind == "gauge") == (key in GAUGES)
