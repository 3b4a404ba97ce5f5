"""The harness drives vLLM's real Scheduler to completion on a small device pool."""

from __future__ import annotations

import pytest

from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.vllm.simulation.model import kv_transfer_config

# 4 DSA layers, block 64: default grouping = one group (MLA + indexer pages together).
# 8 requests of 256 prompt tokens (4 pages) all fit at admission (32 of 63 usable
# blocks); each grows to 256 + 512 tokens = 12 pages, which only 5 can hold at once,
# so the scheduler must preempt.
NUM_BLOCKS = 64
WORKLOAD = dict(count=8, prompt_len=256, max_tokens=512)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_workload_runs_to_completion_without_connector(dsa_model_dir, async_scheduling):
    harness = SchedulerHarness.build(
        dsa_model_dir, num_blocks=NUM_BLOCKS, max_model_len=2048,
        max_num_batched_tokens=512, async_scheduling=async_scheduling,
    )
    assert len(harness.kv_cache_config.kv_cache_groups) == 1
    expected_scheduler = "AsyncScheduler" if async_scheduling else "Scheduler"
    assert type(harness.scheduler).__name__ == expected_scheduler
    requests = harness.add_requests(**WORKLOAD)
    stats = harness.run_to_completion()
    assert sorted(stats.finished) == sorted(r.request_id for r in requests)
    assert all(len(r.output_token_ids) == WORKLOAD["max_tokens"] for r in requests)
    assert stats.peak_running == WORKLOAD["count"]  # all admitted at first
    assert stats.preemptions > 0  # ... and some pushed out while growing
    assert min(stats.running_per_step[len(stats.running_per_step) // 2 :]) < WORKLOAD["count"]
    assert stats.preemptions == sum(r.num_preemptions for r in requests)
    harness.assert_no_leaks()


def test_split_plan_runs_on_the_real_scheduler(dsa_model_dir):
    """Our split (4 sparse-MLA groups + 1 indexer group for 4 layers) through vLLM's
    stock managers: every group allocates per page, so the pool is 5x as busy."""
    harness = SchedulerHarness.build(
        dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
        construct_connector=False, num_blocks=5 * NUM_BLOCKS, max_model_len=2048,
        max_num_batched_tokens=512,
    )
    assert harness.scheduler.connector is None
    assert len(harness.kv_cache_config.kv_cache_groups) == 5
    requests = harness.add_requests(**WORKLOAD)
    stats = harness.run_to_completion()
    assert sorted(stats.finished) == sorted(r.request_id for r in requests)
    assert stats.preemptions > 0
    harness.assert_no_leaks()


def test_connector_is_constructed_by_the_real_scheduler(dsa_model_dir):
    """The real Scheduler builds our connector through the factory, before its
    KVCacheManager, so the sparse-MLA groups get the residency-aware manager."""
    from vllm_hisparse.vllm.scheduler_side.managers import ResidencyAwareManager

    harness = SchedulerHarness.build(
        dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
        num_blocks=NUM_BLOCKS * 5, max_model_len=2048,
    )
    managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
    sparse = harness.residency.geometry.sparse_group_ids
    assert sparse == (0, 1, 2, 3)
    assert all(isinstance(managers[i], ResidencyAwareManager) for i in sparse)
    assert all(managers[i].residency_bound for i in sparse)
    # The indexer group gets the same class, unbound (one class keeps vLLM's call sites
    # monomorphic, see managers.residency_manager_group_ids), i.e. FullAttentionManager.
    assert type(managers[4]) is ResidencyAwareManager and not managers[4].residency_bound
