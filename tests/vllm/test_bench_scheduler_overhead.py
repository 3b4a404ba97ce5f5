"""benchmarks/bench_scheduler_overhead.py still runs its three configurations (tiny sizes,
in process): a smoke check of the harness it builds, not a timing."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scheduler_overhead.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_scheduler_overhead", BENCH)
    module = importlib.util.module_from_spec(spec)
    # vLLM's connector factory imports the no-op connector's module by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.parametrize("mode", ["none", "noop", "hisparse"])
def test_each_mode_runs(bench, dsa_model_dir, mode):
    result = bench.measure(dsa_model_dir, mode, requests=4, context=256, steps=3, warmup=2)
    assert result["mode"] == mode and result["median_ms"] > 0
    assert (result["own_ms"] > 0) == (mode == "hisparse")


def test_connector_per_mode(bench, dsa_model_dir):
    from vllm_hisparse.vllm.connector import HiSparseResidencyConnector
    from vllm_hisparse.vllm.managers import ResidencyAwareManager

    kinds = {}
    for mode in bench.MODES:
        harness = bench.build_harness(dsa_model_dir, mode, requests=2, context=128, max_tokens=4)
        kinds[mode] = harness.scheduler.connector
        managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
        # Same plan in every mode (our split: 4 sparse groups + 1 indexer group).
        assert len(managers) == 5
        assert all(isinstance(m, ResidencyAwareManager) for m in managers) == (mode == "hisparse")
    assert kinds["none"] is None
    assert type(kinds["noop"]) is bench.NoopConnector
    assert isinstance(kinds["hisparse"], HiSparseResidencyConnector)


def test_unknown_mode(bench, dsa_model_dir):
    with pytest.raises(ValueError, match="mode must be one of"):
        bench.build_harness(dsa_model_dir, "other", requests=1, context=64, max_tokens=1)
