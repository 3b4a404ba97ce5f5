"""Admission headroom (``HiSparseSchedulerRole.offer``) on vLLM's real Scheduler.

Finding (``vllm-hisparse simulate --requests 8 --prompt-len 512 --output-len 128
--device-blocks 160``): with the connector vLLM preempted 3 times against once without.
MIXED requests release pages, vLLM admits one more request into that space, and the
running requests (a burst: they cross page boundaries within a few steps) find no block
for their next page: preempt, re-admit from prefix-cache hits, preempt again. The gate
admits a request only when the free blocks cover its whole prompt, the prefilling
requests' remaining prompts, one crossing, and the decoding requests' next page in the
groups the policy does not manage.
"""

from __future__ import annotations

import pytest

from tests.vllm.scheduler_harness import SchedulerHarness
from tests.vllm.vllm_configs import kv_transfer_config

# The finding's workload on the harness plan (4 sparse groups + 1 indexer group).
WORKLOAD = dict(count=8, prompt_len=512, max_tokens=128)
CONFIG = dict(max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=1024)


def run(model_dir, num_blocks: int, *, connector: bool) -> tuple[SchedulerHarness, object]:
    harness = SchedulerHarness.build(
        model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
        construct_connector=connector, num_blocks=num_blocks, **CONFIG,
    )
    requests = harness.add_requests(**WORKLOAD)
    stats = harness.run_to_completion()
    assert sorted(stats.finished) == sorted(r.request_id for r in requests)
    harness.assert_no_leaks()
    return harness, stats


@pytest.mark.parametrize("num_blocks", [240, 300])
def test_no_more_preemptions_than_without_the_connector(small_topk_model_dir, num_blocks):
    _, without = run(small_topk_model_dir, num_blocks, connector=False)
    harness, with_connector = run(small_topk_model_dir, num_blocks, connector=True)
    assert without.preemptions == 1  # vLLM's greedy admission over-commits once
    assert with_connector.preemptions == 0
    assert harness.residency.num_preemptions == 0
    # Still more concurrency than without (MIXED requests), and no more steps.
    assert with_connector.peak_running > without.peak_running
    assert with_connector.steps <= without.steps
    # The gate did defer admissions (the run is under pressure).
    assert harness.residency.policy.stats.num_demotions > 0


def test_gate_defers_and_counts(small_topk_model_dir):
    """Driven step by step: once the pool cannot take a waiting request plus the running
    requests' next pages, the request waits (counted), later offers of the same step
    wait too, and the gate opens again in the next step."""
    harness = SchedulerHarness.build(
        small_topk_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
        num_blocks=240, **CONFIG,
    )
    role = harness.residency
    harness.add_requests(**WORKLOAD)
    deferred_steps = 0
    seen = 0
    while harness.scheduler.has_requests():
        harness.step()
        deferred = role._stats.data.get("num_admissions_deferred", 0)
        if deferred > seen:
            deferred_steps += 1
            # A deferral leaves requests waiting, never a preemption.
            assert harness.scheduler.waiting
        seen = deferred
        # The admission state is reset by build_connector_meta at the end of each step.
        assert not role._let_through and not role._admission_closed
    harness.drain()
    assert deferred_steps > 0
    assert harness.stats.preemptions == 0
    harness.assert_no_leaks()


def test_gate_is_idle_without_pressure(small_topk_model_dir):
    """A pool that holds every request: the gate never defers, same admissions as vLLM."""
    _, without = run(small_topk_model_dir, 2000, connector=False)
    harness, with_connector = run(small_topk_model_dir, 2000, connector=True)
    assert with_connector.peak_running == without.peak_running == WORKLOAD["count"]
    assert with_connector.running_per_step == without.running_per_step
    assert with_connector.preemptions == without.preemptions == 0


def test_an_idle_engine_admits_a_prompt_near_the_pool_size(small_topk_model_dir):
    """Liveness: with nothing running, the gate leaves admission to vLLM. A request that
    fills the pool (32 of 32 pages per group here, as vLLM's planning allows for
    max_model_len) plus the gate's one crossing page would otherwise wait forever."""
    harness = SchedulerHarness.build(
        small_topk_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
        num_blocks=161, max_model_len=2048, max_num_seqs=4, max_num_batched_tokens=2048,
    )
    pages_per_group = (harness.kv_cache_config.num_blocks - 1) // len(
        harness.kv_cache_config.kv_cache_groups)
    prompt = pages_per_group * 64 - 8
    (request,) = harness.add_requests(1, prompt_len=prompt, max_tokens=4)
    stats = harness.run_to_completion(max_steps=200)
    assert stats.finished == [request.request_id]
    harness.assert_no_leaks()
