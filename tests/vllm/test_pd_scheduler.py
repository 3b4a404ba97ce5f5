"""P/D decode consumer on vLLM's real Scheduler: MultiConnector[HiSparseResidencyConnector,
NixlConnector (kv_consumer)], NixlConnector's real scheduler side, our scheduler role.

Faked: the prefill engine (requests arrive with its ``kv_transfer_params``) and the two
workers' load reports (``pd_fakes.PDFakeWorker``). The pool is 200 blocks of 5 KV cache
groups (4 sparse-MLA + 1 indexer); a "hog" holds blocks to leave a chosen number free.
The worker side of the host landing (NIXL reads, exact rows) is tests/vllm/test_pd_worker.py.
"""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from tests.vllm.pd_fakes import PDFakeWorker, add_pd_request, pd_kv_transfer
from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.core import Residency
from vllm_hisparse.vllm.kv_import import Landing

BLOCKS = 200
PROMPT = 1024  # 16 pages; 17 with the first decode token: 85 blocks resident, 45 host-landed


def build(model_dir, *, free=None, async_scheduling=False, **kv):
    worker = PDFakeWorker(nixl_index=1 if kv.get("hisparse_first", True) else 0)
    harness = SchedulerHarness.build(model_dir, num_blocks=BLOCKS, kv_transfer=pd_kv_transfer(**kv),
                                     max_model_len=1536, worker=worker,
                                     async_scheduling=async_scheduling)
    pool = harness.scheduler.kv_cache_manager.block_pool
    harness.hog = pool.get_new_blocks(pool.get_num_free_blocks() - free) if free is not None else []
    return harness, worker


def finish(harness, max_steps=200):
    """Run until every request finished, release the hog, check that nothing leaked."""
    for _ in range(max_steps):
        if not harness.scheduler.has_requests():
            break
        harness.step()
    harness.drain()
    for _ in range(3):  # last acks
        harness.step()
    harness.drain()
    harness.scheduler.kv_cache_manager.block_pool.free_blocks(harness.hog)
    harness.hog = []
    harness.assert_no_leaks()


def sparse_tables(harness, rid):
    return [[b.block_id for b in m.req_to_blocks[rid]] for m in harness.residency._managers]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_resident_landing_when_the_prefix_fits(small_topk_model_dir, async_scheduling):
    harness, worker = build(small_topk_model_dir, async_scheduling=async_scheduling)
    request = add_pd_request(harness, PROMPT, 8)
    rid = request.request_id
    harness.step()
    role = harness.residency
    assert role.num_pd_landings == {Landing.RESIDENT: 1, Landing.HOST: 0}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    for _ in range(6):
        harness.step()
    # NixlConnector read it into vLLM's blocks of every group; our policy adopted them.
    assert rid in worker.nixl_loads and not worker.imports
    assert [len(g) for g in worker.nixl_loads[rid]] == [16] * 5
    # At its first step the policy adopted exactly those blocks as resident pages (later
    # the admission-window rule may demote the request like any long one).
    first = next(m.command for m in worker.commands if rid in m.new_rows)
    row = first_row = next(m.new_rows[rid] for m in worker.commands if rid in m.new_rows)
    adopted = {p: d for r, p, d in zip(first.page_rows, first.page_indices, first.page_device_blocks)
               if r == first_row}
    assert [adopted[p] for p in range(16)] == list(worker.nixl_loads[rid][role.sparse_group_ids[0]])
    assert int(role.policy.tables.num_tokens[row]) == request.num_computed_tokens
    finish(harness)
    assert len(request.output_token_ids) == 8


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_host_landing_when_the_prefix_does_not_fit(small_topk_model_dir, async_scheduling):
    harness, worker = build(small_topk_model_dir, free=60, async_scheduling=async_scheduling)
    worker.load_delay_steps = 3
    request = add_pd_request(harness, PROMPT, 70)
    rid = request.request_id
    harness.step()
    role, policy = harness.residency, harness.residency.policy
    assert role.num_pd_landings == {Landing.RESIDENT: 0, Landing.HOST: 1}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # NixlConnector never sees it (no read, no "nothing to load" notification).
    assert request.kv_transfer_params["do_remote_prefill"] is False
    # vLLM allocated the indexer pages and the sparse tail only: the rest is the null block.
    tables = sparse_tables(harness, rid)
    assert all(t[:14] == [0] * 14 and 0 not in t[14:16] for t in tables)
    assert harness.num_free_blocks() == 60 - 16 - 2 * 4 - 4 * 4  # indexer, tail, hot region
    harness.step()
    order = worker.imports[rid]
    row = policy.row_of(rid)
    assert order.num_tokens == PROMPT - 1  # vLLM recomputes the last prompt token
    assert order.host_blocks == policy.tables.host_block[row, :16].tolist()
    assert order.tail_blocks == [[t[p] for t in tables] for p in (14, 15)]
    indexer = harness.residency._indexer_managers[0].req_to_blocks[rid]
    assert order.indexer_blocks == [[b.block_id for b in indexer[:16]]]
    assert policy.status(rid).name == "IMPORTING" and len(policy.hot_block_ids(rid)) == 4
    for _ in range(4):
        harness.step()
    assert rid not in worker.nixl_loads
    assert policy.residency(rid) == Residency.NONE and policy.is_ready(rid)
    assert int(policy.tables.num_tokens[row]) == request.num_computed_tokens
    finish(harness)
    assert len(request.output_token_ids) == 70


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_failed_host_landing_fails_that_request_alone(small_topk_model_dir, async_scheduling):
    harness, worker = build(small_topk_model_dir, free=110, async_scheduling=async_scheduling)
    local = harness.add_request(200, 20)
    bad = add_pd_request(harness, PROMPT, 8)
    worker.fail_loads.add(bad.request_id)
    finish(harness)
    assert harness.residency.num_pd_landings[Landing.HOST] == 1
    assert bad.status == RequestStatus.FINISHED_ERROR and not bad.output_token_ids
    assert local.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(local.output_token_ids) == 20
    assert harness.residency.num_preemptions == 0


def test_failed_host_landing_is_recomputed(small_topk_model_dir):
    """kv_load_failure_policy=recompute: vLLM frees the blocks and prefills the request
    here (its params no longer ask for a remote prefill); not counted as a preemption."""
    harness, worker = build(small_topk_model_dir, free=60, failure_policy="recompute")
    request = add_pd_request(harness, PROMPT, 8)
    worker.fail_loads.add(request.request_id)
    for _ in range(5):
        harness.step()
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    harness.scheduler.kv_cache_manager.block_pool.free_blocks(harness.hog)  # room to prefill
    harness.hog = []
    finish(harness)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(request.output_token_ids) == 8
    assert harness.residency.num_preemptions == 0
    assert request.request_id not in worker.nixl_loads


def test_abort_while_importing_frees_once_the_read_is_over(small_topk_model_dir):
    harness, worker = build(small_topk_model_dir, free=60)
    worker.load_delay_steps = 4
    request = add_pd_request(harness, PROMPT, 8)
    harness.step()
    harness.step()
    free_importing = harness.num_free_blocks()
    harness.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
    harness.step()
    # vLLM keeps the blocks of a request whose load is in flight (the read writes them).
    assert harness.num_free_blocks() == free_importing
    assert harness.residency.policy.status(request.request_id).name == "IMPORTING"
    finish(harness)


def test_nixl_listed_first_lands_resident_only(small_topk_model_dir):
    """With NixlConnector first, vLLM lets it load every P/D request: the request waits
    (its demand noted) until the whole prefix fits, then NixlConnector loads it."""
    harness, worker = build(small_topk_model_dir, free=60, hisparse_first=False)
    role = harness.residency
    assert not role.pd.host_landing and "first" in role.pd.reason
    request = add_pd_request(harness, PROMPT, 8)
    for _ in range(3):
        harness.step()
    assert request.status == RequestStatus.WAITING
    assert role._stats.data.get("num_admissions_deferred", 0) >= 3
    harness.scheduler.kv_cache_manager.block_pool.free_blocks(harness.hog)
    harness.hog = []
    finish(harness)
    assert role.num_pd_landings == {Landing.RESIDENT: 1, Landing.HOST: 0}
    assert request.request_id in worker.nixl_loads and not worker.imports


def test_a_host_landing_the_policy_refuses_is_reported_failed(small_topk_model_dir, monkeypatch):
    """The policy cannot take the import at its first step (here: no host block): the
    workers get a cancelled order, report the request failed, vLLM fails it alone."""
    from vllm_hisparse.core.errors import HostPoolExhausted

    harness, worker = build(small_topk_model_dir, free=60)
    policy = harness.residency.policy

    def refuse(*args, **kwargs):
        raise HostPoolExhausted("test: no host block")

    monkeypatch.setattr(policy, "begin_import", refuse)
    request = add_pd_request(harness, PROMPT, 8)
    finish(harness)
    assert worker.imports[request.request_id].cancel
    assert request.status == RequestStatus.FINISHED_ERROR


def test_a_child_reads_the_composing_config(small_topk_model_dir):
    """MultiConnector hands each child a config with its own entry only; the role reads the
    top-level settings anyway: the sibling order (host landing) and the engine's
    kv_load_failure_policy, which turns host-prefix hits off under 'recompute'."""
    harness, _ = build(small_topk_model_dir, failure_policy="recompute")
    role = harness.residency
    assert role.pd.host_landing
    assert role._load_failure_policy == "recompute" and not role.host_prefix_cache
