"""Admission headroom (``SchedulerRole.offer``) on vLLM's real Scheduler.

The gate never answers ``None``: it sets vLLM's admission watermark for each offered
request, capped by the blocks residency spares, so a refused request ends vLLM's
admission pass (one prefix lookup per step, as without the connector) and nothing vLLM
alone would admit is refused.

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
from vllm_hisparse.vllm.simulation.model import kv_transfer_config

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
        deferred = role.stats.data.get("num_admissions_deferred", 0)
        if deferred > seen:
            deferred_steps += 1
            # A deferral leaves requests waiting, never a preemption.
            assert harness.scheduler.waiting
        seen = deferred
        # The admission state is reset by build_connector_meta at the end of each step.
        assert not role.admission.let_through
        assert harness.scheduler.kv_cache_manager.watermark_blocks == role.admission.base_watermark_blocks
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


def _count_lookups(harness) -> list[int]:
    """Per step, how many waiting requests vLLM looked up in its prefix cache."""
    manager = harness.scheduler.kv_cache_manager
    real = manager.get_computed_blocks
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    manager.get_computed_blocks = counted
    return calls


@pytest.mark.parametrize("connector", [False, True], ids=["without", "with"])
def test_a_refused_admission_costs_one_prefix_lookup(small_topk_model_dir, connector):
    """Every step looks up the requests it admits plus at most one it refuses: a
    deferral stops vLLM's admission pass like a full pool (before: every waiting request
    was skipped and looked up again, every step)."""
    harness = SchedulerHarness.build(
        small_topk_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
        construct_connector=connector, num_blocks=240, **CONFIG,
    )
    calls = _count_lookups(harness)
    harness.add_requests(16, prompt_len=512, max_tokens=128)
    admitted_before = 0
    refused_steps = 0
    while harness.scheduler.has_requests():
        calls[0] = 0
        harness.step()
        admitted = len(harness.scheduler.running) + len(harness.stats.finished)
        new = admitted - admitted_before
        admitted_before = admitted
        assert calls[0] <= new + 1, (harness.stats.steps, calls[0], new)
        refused_steps += calls[0] == new + 1 and bool(harness.scheduler.waiting)
    harness.drain()
    assert refused_steps > 0  # the pool did turn requests away
    harness.assert_no_leaks()


def test_the_gate_steps_aside_when_residency_spares_nothing(small_topk_model_dir):
    """Requests shorter than a hot region (128 + 64 tokens; hot region 4 pages): no
    demotion can gain a block, so the gate admits exactly what vLLM admits, step by
    step (``vllm-hisparse simulate --requests 8 --prompt-len 128 --output-len 64
    --device-blocks 80``: 129 steps with the connector against 65 before)."""
    workload = dict(count=12, prompt_len=128, max_tokens=64)
    runs = []
    for connector in (False, True):
        harness = SchedulerHarness.build(
            small_topk_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
            construct_connector=connector, num_blocks=81, **CONFIG,
        )
        harness.add_requests(**workload)
        runs.append(harness.run_to_completion())
        harness.assert_no_leaks()
    without, with_connector = runs
    assert without.preemptions > 0  # the pool is short: vLLM over-commits
    assert with_connector.running_per_step == without.running_per_step
    assert with_connector.preemptions == without.preemptions
