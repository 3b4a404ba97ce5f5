"""The lockstep coordinator (``lockstep.py``, patch ``lockstep_coordinator``) on vLLM's real
Scheduler: the same workload with and without it gives the same scheduler output, step
by step (tokens, new block ids in every group, preemptions, finishes), through chunked
prefills, device prefix-cache hits, host-prefix loads and preemptions."""

from __future__ import annotations

import random

import pytest

from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.vllm.simulation.model import kv_transfer_config
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.patches.lockstep import LockstepCoordinator, lockstep_groups


def _harness(model_dir, *, lockstep: bool, connector: bool = True, **config) -> SchedulerHarness:
    harness = SchedulerHarness.build(
        model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
        construct_connector=connector, **config)
    coordinator = compat.kv_cache_coordinator(harness.scheduler.kv_cache_manager)
    if lockstep:
        patches.LOCKSTEP_COORDINATOR.install(coordinator)
    else:
        patches.LOCKSTEP_COORDINATOR.remove(coordinator)
    assert patches.LOCKSTEP_COORDINATOR.installed(coordinator) == lockstep
    return harness


def _workload(harness: SchedulerHarness, seed: int) -> None:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 900) for _ in range(256)]
    for i in range(14):
        suffix = [rng.randrange(10, 900) for _ in range(rng.randint(100, 700))]
        prompt = (shared if i % 2 else []) + suffix
        harness.add_request(len(prompt), rng.randint(40, 300), prompt_token_ids=prompt)


def _trace(harness: SchedulerHarness) -> list:
    steps = []
    while harness.scheduler.has_requests():
        out = harness.step()
        cached = out.scheduled_cached_reqs
        steps.append((
            dict(out.num_scheduled_tokens),
            {r.req_id: r.block_ids for r in out.scheduled_new_reqs},
            dict(zip(cached.req_ids, cached.new_block_ids)),
            sorted(out.preempted_req_ids or ()),
            sorted(out.finished_req_ids),
        ))
        assert harness.stats.steps < 5000
    harness.drain()
    return steps


@pytest.mark.parametrize("connector", [True, False], ids=["ours", "plan-only"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_same_scheduler_output_with_and_without_lockstep(dsa_model_dir, connector, async_scheduling):
    config = dict(num_blocks=260, max_model_len=2048, max_num_batched_tokens=256,
                  max_num_seqs=16, async_scheduling=async_scheduling)
    traces, stats = [], []
    for lockstep in (False, True):
        harness = _harness(dsa_model_dir, lockstep=lockstep, connector=connector, **config)
        _workload(harness, seed=3)
        traces.append(_trace(harness))
        stats.append(harness.stats)
        harness.assert_no_leaks()
    assert traces[0] == traces[1]
    assert stats[1].preemptions > 0  # the pool is short: preemptions and re-admissions ran
    assert sum(len(step[1]) for step in traces[1]) > 14  # resumed requests came back


def test_lockstep_is_installed_by_the_scheduler_role(dsa_model_dir):
    harness = SchedulerHarness.build(dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
                                     num_blocks=200, max_model_len=2048)
    coordinator = compat.kv_cache_coordinator(harness.scheduler.kv_cache_manager)
    assert type(coordinator) is LockstepCoordinator
    # vLLM's stock hybrid coordinator over the same plan (no connector) is left alone.
    plain = SchedulerHarness.build(dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
                                   num_blocks=200, max_model_len=2048, construct_connector=False)
    plain_coordinator = compat.kv_cache_coordinator(plain.scheduler.kv_cache_manager)
    assert type(plain_coordinator) is compat.hybrid_coordinator_class()
    assert lockstep_groups(plain_coordinator)


def test_groups_that_do_not_move_together_are_refused(dsa_model_dir):
    """A plan with one group (vLLM's default) or a group with another block size is not
    lockstep, and the patch refuses it by name."""
    harness = SchedulerHarness.build(dsa_model_dir, num_blocks=200, max_model_len=2048)  # one merged group
    coordinator = compat.kv_cache_coordinator(harness.scheduler.kv_cache_manager)
    assert not lockstep_groups(coordinator)
    with pytest.raises(ValueError, match="lockstep_coordinator"):
        patches.LOCKSTEP_COORDINATOR.install(coordinator)
    ours = SchedulerHarness.build(dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
                                  num_blocks=200, max_model_len=2048, construct_connector=False)
    coordinator = compat.kv_cache_coordinator(ours.scheduler.kv_cache_manager)
    manager = coordinator.single_type_managers[1]
    manager.block_size *= 2
    try:
        assert not lockstep_groups(coordinator)
    finally:
        manager.block_size //= 2
