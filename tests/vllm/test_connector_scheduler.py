"""The connector's scheduler role on vLLM's real Scheduler / AsyncScheduler (CPU).

Only the model forward and the worker's acks are fake (``FakeWorker``). Every test ends
with ``assert_no_leaks``: no request left, every device block free, host pool at rest,
no open transfer, no hot lease.
"""

from __future__ import annotations

import pytest

from tests.vllm.fake_worker import FakeWorker
from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.vllm.simulation.model import kv_transfer_config
from vllm_hisparse.core.commands import Residency, TransferKind

# 4 DSA layers -> 4 sparse-MLA groups + 1 indexer group; index_topk=128 -> hot region of
# 2 pages. 8 requests of 1024 + 512 tokens need 24 pages x 5 groups = 120 blocks each
# (960 in all) on a 400-block pool: without residency at most ~3 fit at full length.
POOL = dict(num_blocks=400, max_model_len=2048, max_num_batched_tokens=512)
WORKLOAD = dict(count=8, prompt_len=1024, max_tokens=512)


def build(model_dir, *, connector=True, extra=None, worker=None, under_multi=False, **kwargs):
    config = dict(POOL)
    config.update(kwargs)
    return SchedulerHarness.build(
        model_dir,
        kv_transfer=kv_transfer_config(extra or {"host_pool_gib": 1}, under_multi=under_multi),
        construct_connector=connector,
        worker=worker,
        **config,
    )


def run(harness, workload=WORKLOAD):
    requests = harness.add_requests(**workload)
    stats = harness.run_to_completion()
    assert sorted(stats.finished) == sorted(r.request_id for r in requests)
    assert all(len(r.output_token_ids) == workload["max_tokens"] for r in requests)
    harness.assert_no_leaks()
    return stats


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_more_concurrency_and_fewer_preemptions(small_topk_model_dir, async_scheduling):
    without = run(build(small_topk_model_dir, connector=False, async_scheduling=async_scheduling))
    harness = build(small_topk_model_dir, async_scheduling=async_scheduling)
    with_ = run(harness)
    assert with_.peak_running > without.peak_running
    assert with_.preemptions < without.preemptions
    assert with_.steps < without.steps
    stats = harness.residency.policy.stats
    assert stats.num_demotions > 0 and stats.num_pages_released > 0 and stats.num_pages_reused > 0


def test_released_pages_become_null_entries(small_topk_model_dir):
    """A page whose released block was reused reads from host: its entry in every sparse
    group's block table is vLLM's null block (checked as each step's command is built),
    and the free path never frees it."""
    harness = build(small_topk_model_dir)
    harness.add_requests(**WORKLOAD)
    residency = harness.residency
    connector = harness.connector
    real = connector.build_connector_meta
    nulls = []

    def checked(scheduler_output):
        meta = real(scheduler_output)
        t = residency.policy.tables
        for manager in residency.managers:
            for rid, blocks in manager.req_to_blocks.items():
                row = residency.book.row_of.get(rid)
                if row is None:
                    continue
                for page, block in enumerate(blocks[: int(t.num_pages[row])]):
                    lost = bool(t.device_block[row, page] < 0)
                    assert block.is_null == lost, (rid, page)
                    nulls.append(lost)
        return meta

    connector.build_connector_meta = checked
    harness.run_to_completion()
    assert any(nulls)
    harness.assert_no_leaks()


def test_preemption_storm(small_topk_model_dir):
    """A pool too small even with residency: vLLM preempts over and over; every
    preemption ends the request in the policy (hot lease and page leases returned)."""
    harness = build(small_topk_model_dir, num_blocks=260, max_num_seqs=16)
    # Long outputs: growth outruns what demotions free (with 256 tokens the policy now
    # demotes in time, releasing clean pages first on an empty pool, and none is preempted).
    stats = run(harness, dict(count=16, prompt_len=1024, max_tokens=768))
    assert stats.preemptions > 0
    assert harness.residency.num_preemptions == stats.preemptions


@pytest.mark.parametrize("eager_mirror", [True, False], ids=["mirror", "spill"])
def test_abort_in_the_middle_of_a_transfer(small_topk_model_dir, eager_mirror):
    from vllm.v1.request import RequestStatus

    worker = FakeWorker(delay_steps=3)
    harness = build(
        small_topk_model_dir, worker=worker,
        extra={"host_pool_gib": 1, "eager_host_mirror": eager_mirror},
    )
    requests = harness.add_requests(**WORKLOAD)
    residency = harness.residency
    kinds = set()
    victim = None
    for _ in range(200):
        harness.step()
        t = residency.policy.tables
        for request in requests:
            row = residency.book.row_of.get(request.request_id)
            if row is None:
                continue
            n = int(t.num_pages[row])
            busy = (t.mirror_inflight[row, :n] > 0).any() or (t.pending[row, :n] >= 0).any()
            if busy and residency.policy.residency(request.request_id) != Residency.FULL:
                victim = request
                break
        if victim is not None:
            break
    assert victim is not None, "no request with a transfer in flight"
    for meta in worker.commands:
        kinds.update(spec.kind for spec in meta.command.transfers)
    assert (TransferKind.MIRROR in kinds) == eager_mirror
    harness.scheduler.finish_requests(victim.request_id, RequestStatus.FINISHED_ABORTED)
    assert not residency.policy.has_request(victim.request_id)
    assert residency.policy.num_open_transfers > 0  # the aborted request's copies still run
    harness.run_to_completion()
    assert victim.request_id not in harness.stats.finished or victim.is_finished()
    harness.assert_no_leaks()


def test_prefix_cache_hit_on_released_pages(small_topk_model_dir):
    """A second request with the same prompt hits vLLM's device prefix cache, including
    pages the first request released (readable until reused) and the policy adopts the
    shared blocks without double counting their leases."""
    harness = build(small_topk_model_dir)
    prompt = [(i * 7) % 900 + 10 for i in range(1024)]
    first = harness.add_request(1024, 64, prompt_token_ids=prompt)
    fillers = harness.add_requests(2, prompt_len=1024, max_tokens=64)
    harness.run_to_completion()
    stats = harness.residency.policy.stats
    assert stats.num_pages_released > 0 and stats.num_pages_reused == 0  # released, still readable
    second = harness.add_request(1024, 64, prompt_token_ids=prompt)
    output = harness.step()
    # The first chunk would be 512 tokens without a hit; with it, only the tail.
    assert output.num_scheduled_tokens[second.request_id] < 512
    harness.run_to_completion()
    assert first.is_finished() and second.is_finished() and all(f.is_finished() for f in fillers)
    harness.assert_no_leaks()


def test_chunked_prefill_longer_than_the_admission_window(small_topk_model_dir):
    """max_num_batched_tokens=128 -> an admission window of 2 pages; a 1536-token prompt
    stays FULL while its prefill runs (requirement R1: prefill reads its whole context
    from the device), is demoted by the window rule once its prompt is complete, and
    finishes. (Before R1 it was demoted mid-prefill.)"""
    harness = build(small_topk_model_dir, max_num_batched_tokens=128)
    (request,) = harness.add_requests(1, prompt_len=1536, max_tokens=8)
    rid = request.request_id
    demoted_during_prefill = demoted_after = False
    while harness.scheduler.has_requests():
        harness.step()
        if not harness.residency.policy.has_request(rid):
            continue
        mixed = harness.residency.policy.residency(rid) != Residency.FULL
        if request.num_computed_tokens < request.num_prompt_tokens:
            demoted_during_prefill |= mixed
        else:
            demoted_after |= mixed
    harness.drain()
    assert not demoted_during_prefill
    assert demoted_after
    assert request.is_finished()
    harness.assert_no_leaks()


@pytest.mark.parametrize(
    "worker",
    [
        FakeWorker(order="reverse", delay_steps=1),
        FakeWorker(order="random", jitter_steps=4, seed=1),
        FakeWorker(order="random", jitter_steps=2, report_enqueued=True, seed=2),
    ],
    ids=["reverse", "jitter", "enqueued"],
)
def test_acks_in_and_out_of_order(small_topk_model_dir, worker):
    harness = build(small_topk_model_dir, worker=worker)
    stats = run(harness)
    assert stats.peak_running == WORKLOAD["count"]


def test_completion_needs_every_worker(small_topk_model_dir):
    """Two workers, the second acking two steps later: a transfer completes only once
    both completed it (the vote itself: tests/core/test_ack_vote.py)."""
    worker = FakeWorker(num_workers=2, stagger_steps=2)
    harness = build(small_topk_model_dir, worker=worker)
    harness.residency.num_workers = 2
    harness.add_requests(2, prompt_len=256, max_tokens=16)
    harness.step()
    harness.step()
    assert harness.residency.policy.num_open_transfers >= 2  # worker 1 has not acked yet
    harness.run_to_completion()
    harness.assert_no_leaks()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_duplicate_acks_are_counted_once(small_topk_model_dir, async_scheduling):
    """[7] defect 2: a completion repeated in one report and re-sent a step later is
    dropped and counted (it crashed ``Scheduler.update_from_output`` with ProtocolError)."""
    worker = FakeWorker(repeat=lambda tid, rank: tid % 3 == 0)
    harness = build(small_topk_model_dir, worker=worker, async_scheduling=async_scheduling)
    run(harness, dict(count=4, prompt_len=512, max_tokens=64))
    assert worker.num_repeated > 0
    residency = harness.residency
    assert residency.acks.num_duplicates_seen == 2 * worker.num_repeated
    assert residency.acks.num_open == 0


def test_a_worker_repeating_an_ack_does_not_vote_for_another(small_topk_model_dir):
    """[7] defect 3: worker 0 sends each completion twice while worker 1 acks three steps
    later; no transfer completes before worker 1 completed it (acks were counted per id:
    worker 0's repeat completed the transfer while worker 1 was still copying)."""
    worker = FakeWorker(num_workers=2, stagger_steps=3, repeat=lambda tid, rank: rank == 0)
    harness = build(small_topk_model_dir, worker=worker)
    residency = harness.residency
    residency.num_workers = 2
    harness.add_requests(2, prompt_len=256, max_tokens=16)
    issued = []
    for _ in range(3):
        harness.step()
        issued += [t.transfer_id for t in worker.commands[-1].command.transfers]
    open_ids = {t.transfer_id for t in residency.policy.open_transfers()}
    assert set(issued) <= open_ids  # worker 0 reported them twice; worker 1 not yet
    harness.run_to_completion()
    harness.assert_no_leaks()
    assert residency.acks.num_open == 0  # decided ballots are forgotten


@pytest.mark.parametrize("num_workers", [1, 2])
def test_a_lost_ack_stops_with_a_named_error(small_topk_model_dir, num_workers):
    """[7] defect 4: a worker never acks one transfer. The engine stalled forever; now,
    past ack_deadline_s, the scheduler raises WorkerSilentError naming the worker and
    the transfer (its copy may still be in flight: its blocks are never reused)."""
    import time

    from vllm_hisparse.core.ack_vote import WorkerSilentError

    lost = []

    def lose(spec, rank):
        if rank == num_workers - 1 and not lost and spec.kind == TransferKind.MIRROR:
            lost.append(spec.transfer_id)
            return True
        return False

    worker = FakeWorker(num_workers=num_workers, lose=lose)
    harness = build(small_topk_model_dir, worker=worker,
                    extra={"host_pool_gib": 1, "ack_deadline_s": 0.25})
    harness.residency.num_workers = num_workers
    harness.add_requests(2, prompt_len=256, max_tokens=64)
    give_up = time.monotonic() + 5.0
    with pytest.raises(WorkerSilentError) as info:
        while time.monotonic() < give_up:
            harness.step()
            time.sleep(0.002)
    message = str(info.value)
    assert f"worker(s) [{num_workers - 1}] went silent: transfer {lost[0]} " in message
    assert "ack_deadline_s=0.25" in message


def test_ack_deadline_s_is_validated():
    from vllm_hisparse.vllm.setup.config import HiSparseConfigError, parse_extra_config

    facts = dict(top_k=128, block_size=64, max_decode_query_len=1)
    assert parse_extra_config({"host_pool_gib": 1}, **facts).ack_deadline_s == 60.0
    assert parse_extra_config({"host_pool_gib": 1, "ack_deadline_s": 5}, **facts).ack_deadline_s == 5.0
    for bad in (0, -1, float("nan"), float("inf"), True, "10", 1e9):
        with pytest.raises(HiSparseConfigError, match="ack_deadline_s"):
            parse_extra_config({"host_pool_gib": 1, "ack_deadline_s": bad}, **facts)


@pytest.mark.parametrize("num_workers", [1, 2])
def test_failed_transfers_are_retried(small_topk_model_dir, num_workers):
    failures = {"left": 6}

    def fail(spec, worker_index):
        if worker_index == num_workers - 1 and failures["left"] > 0:
            failures["left"] -= 1
            return True
        return False

    worker = FakeWorker(num_workers=num_workers, fail=fail)
    harness = build(small_topk_model_dir, worker=worker)
    harness.residency.num_workers = num_workers
    run(harness)
    assert worker.num_failed == 6
    assert harness.residency.policy.stats.num_failed_transfers == 6


def test_as_a_multiconnector_child_next_to_offloading(small_topk_model_dir):
    """Composed with OffloadingConnector. Its stores are never acknowledged here (its
    worker is not faked), so only our side is required to come to rest."""
    harness = build(small_topk_model_dir, under_multi=True)
    assert type(harness.scheduler.connector).__name__ == "MultiConnector"
    residency = harness.residency
    assert residency is not None
    requests = harness.add_requests(**WORKLOAD)
    while harness.scheduler.running or harness.scheduler.waiting:
        harness.step()
        assert harness.stats.steps < 5000
    harness.drain()
    assert all(r.is_finished() for r in requests)
    assert harness.stats.peak_running > 3  # the stock managers fit at most 3 at full length
    for _ in range(3):  # let our last transfers be acknowledged
        harness.step()
    harness.drain()
    assert residency.is_idle() and residency.book.host_outstanding == 0
    assert (residency.host_pool.ref_counts == 0).all()


def test_a_small_host_pool_runs_the_rest_unmanaged(small_topk_model_dir):
    """A host pool that backs only a few whole requests: the policy manages that many at a
    time; the others run unmanaged (every page on the device, as without the connector),
    so the host pool never lowers concurrency below vLLM's own. No crash, no leak."""
    without = run(build(small_topk_model_dir, connector=False, extra={"host_pool_gib": 0.02}))
    harness = build(small_topk_model_dir, extra={"host_pool_gib": 0.02})
    role = harness.residency
    host_blocks = role.host_pool.num_blocks
    per_request = (1024 + 512) // 64
    assert host_blocks < WORKLOAD["count"] * per_request
    real = role.build_connector_meta
    managed, unmanaged = [], []

    def counted(scheduler_output):
        meta = real(scheduler_output)
        managed.append(len(role.book.requests))
        unmanaged.append(len(role.book.unmanaged))
        return meta

    role.build_connector_meta = counted
    stats = run(harness)
    assert max(managed) <= host_blocks // per_request
    assert max(unmanaged) > 0
    assert role.stats.data.get("num_unmanaged_admissions", 0) + sum(unmanaged) > 0
    assert stats.peak_running >= without.peak_running


def test_metadata_is_built_without_touching_scheduler_output(small_topk_model_dir):
    """Nothing of ``scheduler_output`` changes but ``has_sync_kv_loads``, set on every step
    that runs a forward (the worker applies the command before it: tests/vllm/test_step_order.py)."""
    harness = build(small_topk_model_dir)
    connector = harness.connector
    real = connector.build_connector_meta
    seen = []

    def checked(scheduler_output):
        before = (dict(scheduler_output.num_scheduled_tokens),
                  scheduler_output.total_num_scheduled_tokens, scheduler_output.kv_connector_metadata)
        meta = real(scheduler_output)
        after = (dict(scheduler_output.num_scheduled_tokens),
                 scheduler_output.total_num_scheduled_tokens, scheduler_output.kv_connector_metadata)
        assert before == after
        assert scheduler_output.has_sync_kv_loads == bool(scheduler_output.num_scheduled_tokens)
        seen.append(meta)
        return meta

    connector.build_connector_meta = checked
    run(harness, dict(count=2, prompt_len=256, max_tokens=4))
    assert seen and all(type(m).__name__ == "HiSparseConnectorMetadata" for m in seen)
    assert any(m.new_rows for m in seen) and any(m.bundles for m in seen)
