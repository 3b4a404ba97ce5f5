"""The scheduler role's per-step shortcuts keep their meaning (real Scheduler, CPU).

* ``get_kv_connector_stats`` reports at most once every ``_STATS_EVERY_STEPS`` calls, and
  the counters it reports add up to the policy's;
* ``has_pending_block_frees`` answers from the policy's
  ``num_device_blocks_pending_release()`` and reports the failed allocation as demand;
* demand the connector sees (an unadmitted waiting request, prefilling chunks) reaches
  ``note_device_demand``;
* the scheduled-request rows are cached while the scheduled set is unchanged.
"""

from __future__ import annotations

from tests.vllm.fake_worker import FakeWorker
from tests.vllm.test_connector_scheduler import WORKLOAD, build, run
from vllm_hisparse.vllm.scheduler_side.admission import AdmissionGate
from vllm_hisparse.vllm.scheduler_side.role import _STATS_EVERY_STEPS


def test_stats_are_throttled_and_lose_nothing(small_topk_model_dir):
    harness = build(small_topk_model_dir)
    residency = harness.residency
    real = residency.get_kv_connector_stats
    reports = []

    def recorded():
        stats = real()
        reports.append(stats)
        return stats

    residency.get_kv_connector_stats = recorded
    run(harness)
    for _ in range(_STATS_EVERY_STEPS):  # flush what the last interval holds
        recorded()
    sent = [r for r in reports if r is not None]
    assert 0 < len(sent) <= len(reports) // _STATS_EVERY_STEPS + 1
    policy = residency.policy.stats
    total = {}
    for stats in sent:
        for key, value in stats.data.items():
            if key not in ("num_hot_leases", "num_host_blocks_used", "num_host_blocks_total",
                           "num_pending_transfers", "num_mixed_requests"):
                total[key] = total.get(key, 0) + value
    assert total.get("num_demotions", 0) == policy.num_demotions > 0
    assert total.get("num_released_pages", 0) == policy.num_pages_released
    assert total.get("num_reused_pages", 0) == policy.num_pages_reused


def test_has_pending_block_frees_asks_the_policy_and_notes_demand(small_topk_model_dir):
    harness = build(small_topk_model_dir, worker=FakeWorker(delay_steps=3))
    residency = harness.residency
    policy = residency.policy
    noted = []
    policy.note_device_demand = noted.append
    pending = {"n": 0}
    policy.num_device_blocks_pending_release = lambda: pending["n"]
    harness.add_requests(1, prompt_len=256, max_tokens=4)
    harness.step()  # a mirror is open now
    assert policy.num_open_transfers > 0
    noted.clear()
    assert residency.has_pending_block_frees() is False
    pending["n"] = 3
    assert residency.has_pending_block_frees() is True
    # One page in each of the 5 groups = 2 bundles of the 4 sparse groups, each call.
    assert noted == [2, 2]
    harness.run_to_completion()
    harness.assert_no_leaks()


def test_unadmitted_requests_and_prefill_chunks_are_reported_as_demand(small_topk_model_dir):
    harness = build(small_topk_model_dir)
    policy = harness.residency.policy
    noted = []
    real = policy.note_device_demand

    def recorded(num_blocks):
        noted.append(num_blocks)
        real(num_blocks)

    policy.note_device_demand = recorded
    calls = {"unadmitted": 0}
    real_unadmitted = AdmissionGate.note_unadmitted

    def counting(self, scheduled):
        before = len(noted)
        real_unadmitted(self, scheduled)
        calls["unadmitted"] += len(noted) - before

    harness.residency.admission.note_unadmitted = counting.__get__(harness.residency.admission)
    run(harness, dict(WORKLOAD, count=12))
    assert calls["unadmitted"] > 0  # vLLM could not admit a waiting request at least once
    assert len(noted) > calls["unadmitted"]  # prefilling chunks too
    assert all(n > 0 for n in noted)


def test_scheduled_rows_are_cached_while_the_set_is_unchanged(small_topk_model_dir):
    harness = build(small_topk_model_dir)
    residency = harness.residency
    harness.add_requests(2, prompt_len=128, max_tokens=8)
    harness.step()
    harness.step()
    keys, rows = residency.book.cached_keys, residency.book.cached_rows
    assert keys is not None and sorted(keys) == sorted(residency.book.row_of)
    assert [residency.book.row_of[rid] for rid in keys] == rows.tolist()
    harness.step()
    assert residency.book.cached_rows is rows  # reused, not rebuilt
    harness.run_to_completion()
    assert residency.book.cached_keys is None  # invalidated when requests ended
    harness.assert_no_leaks()
