"""The scheduler benchmarks still run every system they compare (tiny sizes, in process):
smoke checks of what they build, never timings."""

from __future__ import annotations

import argparse

import pytest

from vllm_hisparse.cli.benchmarks import admission_sweep, scheduler_overhead, shared_prefix


@pytest.fixture(scope="module")
def bench():
    return scheduler_overhead


@pytest.mark.parametrize("mode", ["stock", "intree", "plan", "noop", "hisparse"])
def test_each_system_runs(bench, dsa_model_dir, mode):
    result = bench.measure(dsa_model_dir, mode, requests=4, context=256, steps=3, warmup=2)
    assert result["mode"] == mode and result["median_ms"] > 0
    assert (result["own_ms"] > 0) == (mode == "hisparse")


def test_what_each_system_builds(bench, dsa_model_dir):
    from vllm_hisparse.cli.benchmarks.vllm_baselines import InTreeFakeWorker, NoopConnector
    from vllm_hisparse.vllm import compat
    from vllm_hisparse.vllm.connector import HiSparseResidencyConnector
    from vllm_hisparse.vllm.patches.lockstep import LockstepCoordinator
    from vllm_hisparse.vllm.scheduler_side.managers import ResidencyAwareManager

    built = {mode: bench.build_harness(dsa_model_dir, mode, requests=2, context=128, max_tokens=4)
             for mode in bench.MODES}
    groups = {mode: len(h.kv_cache_config.kv_cache_groups) for mode, h in built.items()}
    # Plain vLLM: one group for every layer; ours: 4 sparse groups + 1 indexer group (4
    # layers); in-tree: source + indexer + a resident and a hot group per hot unit.
    assert groups == {"stock": 1, "intree": 10, "plan": 5, "noop": 5, "hisparse": 5}
    connectors = {mode: h.scheduler.connector for mode, h in built.items()}
    assert connectors["stock"] is None and connectors["plan"] is None
    assert type(connectors["noop"]) is NoopConnector
    assert isinstance(connectors["hisparse"], HiSparseResidencyConnector)
    assert type(connectors["intree"]).__name__ == "HiSparseConnector"
    assert isinstance(built["intree"].worker, InTreeFakeWorker)
    for mode, harness in built.items():
        managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
        assert all(isinstance(m, ResidencyAwareManager) for m in managers) == (mode == "hisparse")
        coordinator = compat.kv_cache_coordinator(harness.scheduler.kv_cache_manager)
        assert (type(coordinator) is LockstepCoordinator) == (mode == "hisparse")


def test_unknown_system(bench, dsa_model_dir):
    with pytest.raises(ValueError, match="mode must be one of"):
        bench.build_harness(dsa_model_dir, "none", requests=1, context=64, max_tokens=1)


def test_shared_prefix_benchmark_counts_lookups(dsa_model_dir):
    """The shared-prefix workload on a tiny pool: every system finishes, and the lookup
    counter sees vLLM's prefix-cache lookups."""
    args = argparse.Namespace(model_dir=dsa_model_dir, layers=4, requests=6, prefix=256,
                              suffix_min=64, suffix_max=192, output=8, kv_gib=0.03,
                              host_gib=1.0, max_num_seqs=8, max_num_batched_tokens=512,
                              seed=0, max_steps=2000)
    results = {s: shared_prefix.measure(args, s) for s in ("stock", "intree", "hisparse")}
    for system, r in results.items():
        assert r["steps"] > 0 and r["peak_running"] > 0, system
        assert r["lookups_per_step"] > 0
    assert results["stock"]["num_groups"] == 1 and results["hisparse"]["num_groups"] == 5


def test_admission_sweep_configurations():
    sweep = admission_sweep
    specs = sweep.configurations()
    assert len(specs) == 64
    assert {s.prompt_len for s in specs} == {128, 512, 1024, 4096}
    assert {s.output_len for s in specs} == {64, 512}
    assert min(s.device_blocks for s in specs) == 60 and max(s.device_blocks for s in specs) == 1000
    assert sum(s.host_pool_gib is None for s in specs) == 32
    for s in specs:
        s.validate()
    result = {"without": {"peak_running": 5, "steps": 10, "preemptions": 0},
              "with": {"peak_running": 4, "steps": 11, "preemptions": 1}}
    assert sweep.losses(result) == ["peak 4 < 5", "steps 11 > 10", "preemptions 1 > 0"]
    assert sweep.losses({"error": "x"}) == ["error"]
    assert "--host-pool-gib" in sweep._command(specs[1])
