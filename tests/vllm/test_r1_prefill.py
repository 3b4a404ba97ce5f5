"""Requirement R1 on vLLM's real Scheduler: a prefill never reads host-only context.

The worker role refuses a step that schedules more than ``max_decode_query_len`` tokens
for a residency-managed request while one of its pages that has a host block has no
device block (``PrefillGuard.check_context``, docs/worker.md). Here the
worker role's own bookkeeping and check (``TrackedRequests.apply``, ``PrefillGuard.check_context``)
run on the exact command stream the scheduler role produces, step by step, next to
vLLM's real scheduler with chunked prefill under pool pressure.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from tests.vllm.scheduler_harness import SchedulerHarness
from tests.vllm.test_connector_scheduler import build
from vllm_hisparse.core.commands import Residency
from vllm_hisparse.vllm.worker_side.prefill_guard import PrefillGuard
from vllm_hisparse.vllm.worker_side.tracked import TrackedRequests


class R1Monitor:
    """The worker role's tables and R1 check, fed each step's command (no tensors).

    It also records, for every step, the requests that were still prefilling
    (``num_computed_tokens < num_prompt_tokens`` before the step) and asserts the policy
    kept them FULL.
    """

    def __init__(self, harness: SchedulerHarness) -> None:
        self.harness = harness
        residency = harness.residency
        cfg = residency.policy.config
        shape = (cfg.max_num_rows, cfg.max_pages_per_request)
        executor = SimpleNamespace(residency=np.full(shape, -1, dtype=np.int64),
                                   host_blocks=np.full(shape, -1, dtype=np.int64))
        # The worker role's R1 parts, over the one executor table they read.
        self.tracked = TrackedRequests()
        self.guard = PrefillGuard([SimpleNamespace(executor=executor)],
                                  residency.geometry.max_decode_query_len)
        self.executor = executor
        self.prefill_checks = 0
        self.prefilling_seen: set[str] = set()
        self.demoted_after_prefill: dict[str, int] = {}
        self.steps = 0
        connector = harness.connector
        real = connector.build_connector_meta

        def monitored(scheduler_output):
            requests = harness.requests
            prefilling = {rid for rid in scheduler_output.num_scheduled_tokens
                          if requests[rid].num_computed_tokens < requests[rid].num_prompt_tokens}
            meta = real(scheduler_output)
            self.on_command(meta.command, scheduler_output, prefilling)
            return meta

        connector.build_connector_meta = monitored

    def on_command(self, cmd, scheduler_output, prefilling: set[str]) -> None:
        self.steps += 1
        ex = self.executor
        for row in cmd.cleared_rows:
            ex.residency[row] = -1
            ex.host_blocks[row] = -1
        for row, page, dev, host in zip(cmd.page_rows, cmd.page_indices,
                                        cmd.page_device_blocks, cmd.page_host_blocks):
            ex.residency[row, page] = dev
            ex.host_blocks[row, page] = host
        self.tracked.apply(cmd)
        # The worker's own selection (tracked_prefills) and check.
        counts = scheduler_output.num_scheduled_tokens
        limit = self.guard.max_decode_query_len
        prefill = [(rid, i, self.tracked[rid]) for i, (rid, n) in enumerate(counts.items())
                   if n > limit and rid in self.tracked]
        if prefill:
            self.prefill_checks += len(prefill)
            self.guard.check_context(cmd.step_id, prefill)
        # R1.a on the policy's side: prefilling requests stay FULL.
        policy = self.harness.residency.policy
        for rid in prefilling:
            self.prefilling_seen.add(rid)
            if policy.has_request(rid):
                assert policy.residency(rid) == Residency.FULL, f"{rid} demoted while prefilling"
        for change in cmd.residency_changes:
            if change.residency != Residency.FULL:
                assert change.request_id not in prefilling
                self.demoted_after_prefill.setdefault(change.request_id, self.steps)


#: (prompt, max_tokens, chunk = max_num_batched_tokens): 8 requests on the 400-block pool.
PRESSURE_WORKLOADS = [(1024, 512, 128), (1536, 256, 64)]


@pytest.mark.parametrize("prompt_len,max_tokens,chunk", PRESSURE_WORKLOADS)
def test_chunked_prefills_under_pressure_never_read_host_only_context(
        small_topk_model_dir, prompt_len, max_tokens, chunk):
    """Eight long prompts in small chunks (an admission window of 1-2 pages) on a pool
    that forces demotions and page reuse: every step passes the worker's R1 check, no
    request is MIXED while prefilling, and requests are demoted after their prompt."""
    harness = build(small_topk_model_dir, max_num_batched_tokens=chunk)
    monitor = R1Monitor(harness)
    requests = harness.add_requests(8, prompt_len=prompt_len, max_tokens=max_tokens)
    harness.run_to_completion()
    assert all(r.is_finished() for r in requests)
    assert monitor.prefilling_seen == {r.request_id for r in requests}
    assert harness.residency.policy.stats.num_demotions > 0
    assert harness.residency.policy.stats.num_pages_reused > 0  # host-only pages did exist
    assert monitor.demoted_after_prefill
    harness.assert_no_leaks()


#: A window (8 pages) that a 1536-token prompt crosses with a net gain, on a smaller pool.
WINDOW_WORKLOAD = dict(prompt_len=1536, max_tokens=256, chunk=512, num_blocks=300)


def test_the_r1_monitor_passes_where_it_fires_without_the_signal(small_topk_model_dir):
    """The workload of the next test, with the prefilling signal on: no R1 error."""
    w = WINDOW_WORKLOAD
    harness = build(small_topk_model_dir, max_num_batched_tokens=w["chunk"], num_blocks=w["num_blocks"])
    monitor = R1Monitor(harness)
    requests = harness.add_requests(8, prompt_len=w["prompt_len"], max_tokens=w["max_tokens"])
    harness.run_to_completion()
    assert all(r.is_finished() for r in requests) and monitor.demoted_after_prefill
    harness.assert_no_leaks()


def test_the_r1_monitor_is_not_vacuous(small_topk_model_dir):
    """With the prefilling signal switched off (the old behaviour), requests are demoted
    mid-prefill (the admission window), and the worker's R1 check fires."""
    w = WINDOW_WORKLOAD
    prompt_len, max_tokens = w["prompt_len"], w["max_tokens"]
    harness = build(small_topk_model_dir, max_num_batched_tokens=w["chunk"], num_blocks=w["num_blocks"])
    monitor = R1Monitor(harness)
    harness.residency.book.is_prefilling = lambda request: False
    monitor.on_command_real = monitor.on_command

    def without_policy_side_check(cmd, scheduler_output, prefilling):
        monitor.on_command_real(cmd, scheduler_output, set())

    monitor.on_command = without_policy_side_check
    harness.add_requests(8, prompt_len=prompt_len, max_tokens=max_tokens)
    with pytest.raises(RuntimeError, match="host-only.*R1"):
        harness.run_to_completion()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_prefill_is_demoted_at_its_first_decode_step(small_topk_model_dir, async_scheduling):
    """A 1536-token prompt in 128-token chunks (admission window: 2 pages) stays FULL for
    its whole prefill and is demoted by the window rule at its first decode step."""
    harness = build(small_topk_model_dir, max_num_batched_tokens=128, async_scheduling=async_scheduling)
    monitor = R1Monitor(harness)
    (request,) = harness.add_requests(1, prompt_len=1536, max_tokens=8)
    harness.run_to_completion()
    rid = request.request_id
    assert request.is_finished()
    assert monitor.prefill_checks == 0  # never tracked while prefilling
    # 12 prefill steps, then the window demotion in the first decode step's command.
    assert monitor.demoted_after_prefill == {rid: 13}
    harness.assert_no_leaks()
