"""P/D decode consumer on vLLM's real Scheduler: our connector alone (``kv_consumer``) or
first in MultiConnector[HiSparseResidencyConnector, NixlConnector] (NixlConnector's real
scheduler side), our scheduler role.

Faked: the prefill engine (requests arrive with its ``kv_transfer_params``) and our
workers' import reports (``pd_fakes.PDFakeWorker``). The pool is 200 blocks of 5 KV cache
groups (4 sparse-MLA + 1 indexer); a "hog" holds blocks to leave a chosen number free.
The worker side (NIXL reads, exact bytes, decode from the host tier) is
tests/vllm/test_pd_worker.py.
"""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from tests.vllm.pd_fakes import PDFakeWorker, add_pd_request, pd_kv_transfer, remote_params
from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.core import Residency
from vllm_hisparse.vllm.setup.config import HiSparseConfigError
from vllm_hisparse.vllm.pd.import_order import ImportAction
from vllm_hisparse.vllm.pd.landings import Landing

BLOCKS = 200
PROMPT = 1024  # 16 pages; 17 with the first decode token: 85 blocks resident, 45 host-landed


def build(model_dir, *, free=None, async_scheduling=False, compose="alone", **kv):
    worker = PDFakeWorker(nixl_index=1 if compose == "first" else None)
    harness = SchedulerHarness.build(model_dir, num_blocks=BLOCKS,
                                     kv_transfer=pd_kv_transfer(compose=compose, **kv),
                                     max_model_len=1536, worker=worker,
                                     async_scheduling=async_scheduling)
    pool = harness.scheduler.kv_cache_manager.block_pool
    harness.hog = pool.get_new_blocks(pool.get_num_free_blocks() - free) if free is not None else []
    return harness, worker


def release_hog(harness):
    harness.scheduler.kv_cache_manager.block_pool.free_blocks(harness.hog)
    harness.hog = []


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
    release_hog(harness)
    harness.assert_no_leaks()
    assert not harness.residency.landings._leases and not harness.residency.landings._importing


def sparse_tables(harness, rid):
    return [[b.block_id for b in m.req_to_blocks[rid]] for m in harness.residency.managers]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("compose", ["alone", "first"])
def test_resident_landing_when_the_prefix_fits(small_topk_model_dir, async_scheduling, compose):
    harness, worker = build(small_topk_model_dir, async_scheduling=async_scheduling, compose=compose)
    request = add_pd_request(harness, PROMPT, 8)
    rid = request.request_id
    harness.step()
    role = harness.residency
    assert role.landings.num_pd_landings == {Landing.RESIDENT: 1, Landing.HOST: 0}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    harness.step()
    # Our workers read every page into the blocks vLLM allocated in every group.
    order = worker.imports[rid]
    assert order.host_blocks == [] and order.num_pages == 16 and order.num_tokens == PROMPT - 1
    assert order.device_blocks == [list(p) for p in zip(*[t[:16] for t in sparse_tables(harness, rid)])]
    assert all(0 not in blocks for blocks in order.device_blocks)
    for _ in range(5):
        harness.step()
    assert not worker.nixl_loads  # NixlConnector (composed) never reads
    # At its first step the policy adopted exactly those blocks as resident pages (later
    # the admission-window rule may demote the request like any long one).
    first = next(m for m in worker.commands if rid in m.new_rows)
    row = first.new_rows[rid]
    adopted = {p: d for r, p, d in zip(first.command.page_rows, first.command.page_indices,
                                       first.command.page_device_blocks) if r == row}
    assert [adopted[p] for p in range(16)] == [blocks[0] for blocks in order.device_blocks]
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
    assert role.landings.num_pd_landings == {Landing.RESIDENT: 0, Landing.HOST: 1}
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request.kv_transfer_params["do_remote_prefill"] is False  # loaded here, once
    # vLLM allocated the indexer pages and the sparse tail only: the rest is the null block.
    tables = sparse_tables(harness, rid)
    assert all(t[:14] == [0] * 14 and 0 not in t[14:16] for t in tables)
    assert harness.num_free_blocks() == 60 - 16 - 2 * 4 - 4 * 4  # indexer, tail, hot region
    harness.step()
    order = worker.imports[rid]
    row = policy.row_of(rid)
    assert order.num_tokens == PROMPT - 1  # vLLM recomputes the last prompt token
    assert order.host_blocks == policy.tables.host_block[row, :16].tolist()
    assert order.device_blocks == [[t[p] for t in tables] for p in (14, 15)]
    indexer = role.indexer_managers[0].req_to_blocks[rid]
    assert order.indexer_blocks == [[b.block_id for b in indexer[:16]]]
    assert policy.status(rid).name == "IMPORTING" and len(policy.hot_block_ids(rid)) == 4
    for _ in range(4):
        harness.step()
    assert policy.residency(rid) == Residency.NONE and policy.is_ready(rid)
    assert int(policy.tables.num_tokens[row]) == request.num_computed_tokens
    finish(harness)
    assert len(request.output_token_ids) == 70


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("free", [60, None], ids=["host", "resident"])
def test_a_failed_import_fails_that_request_alone(small_topk_model_dir, async_scheduling, free):
    harness, worker = build(small_topk_model_dir, free=free and free + 50, async_scheduling=async_scheduling)
    local = harness.add_request(200, 20)
    bad = add_pd_request(harness, PROMPT, 8)
    worker.fail_loads.add(bad.request_id)
    finish(harness)
    landing = Landing.HOST if free else Landing.RESIDENT
    assert harness.residency.landings.num_pd_landings[landing] == 1
    assert bad.status == RequestStatus.FINISHED_ERROR and not bad.output_token_ids
    assert local.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(local.output_token_ids) == 20
    assert harness.residency.num_preemptions == 0


def test_a_failed_host_landing_is_recomputed(small_topk_model_dir):
    """kv_load_failure_policy=recompute: vLLM frees the blocks and prefills the request
    here (its params no longer ask for a remote prefill); not counted as a preemption."""
    harness, worker = build(small_topk_model_dir, free=60, failure_policy="recompute")
    request = add_pd_request(harness, PROMPT, 8)
    worker.fail_loads.add(request.request_id)
    for _ in range(5):
        harness.step()
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    release_hog(harness)  # room to prefill
    finish(harness)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(request.output_token_ids) == 8
    assert harness.residency.num_preemptions == 0
    assert list(worker.imports) == [request.request_id]  # read once, then computed here


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
    assert not worker.releases


def test_abort_before_admission_releases_the_prefill_blocks(small_topk_model_dir):
    """A P/D request that never got room here: the prefill is told to free its blocks."""
    harness, worker = build(small_topk_model_dir, free=20)
    request = add_pd_request(harness, PROMPT, 8)
    for _ in range(2):
        harness.step()
    assert request.status == RequestStatus.WAITING
    harness.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
    harness.step()
    assert worker.releases == [request.request_id] and not worker.imports
    finish(harness)


def test_leases_are_renewed_while_waiting_and_loading(small_topk_model_dir):
    harness, worker = build(small_topk_model_dir, free=20)
    role = harness.residency
    now = [0.0]
    role.landings._clock = lambda: now[0]
    request = add_pd_request(harness, PROMPT, 8)
    for _ in range(3):  # waits for room: one renewal, then none until 5 s passed
        harness.step()
    assert [h.request_ids for h in worker.heartbeats] == [(f"p-{request.request_id}",)]
    assert worker.heartbeats[0].remote.engine_id == "prefill-engine-0"
    now[0] = 5.0
    release_hog(harness)
    harness.step()  # admitted (and renewed once more)
    assert len(worker.heartbeats) == 2
    finish(harness)
    now[0] = 100.0
    harness.step()
    assert len(worker.heartbeats) == 2  # read: no more renewals


def test_nixl_listed_first_is_refused(small_topk_model_dir):
    with pytest.raises(HiSparseConfigError, match="NixlConnector.*before HiSparseResidencyConnector"):
        build(small_topk_model_dir, compose="after")


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
    assert worker.imports[request.request_id].action is ImportAction.CANCEL
    assert request.status == RequestStatus.FINISHED_ERROR


def test_a_child_reads_the_composing_config(small_topk_model_dir):
    """MultiConnector hands each child a config with its own entry only; the role reads the
    top-level settings anyway: the sibling order and the engine's kv_load_failure_policy,
    which turns host-prefix hits off under 'recompute'."""
    harness, _ = build(small_topk_model_dir, compose="first", failure_policy="recompute")
    role = harness.residency
    assert role.landings.composition.enabled
    assert role.geometry.load_failure_policy == "recompute" and not role.host_prefix.enabled


def _bad_params(harness, prompt_len, **change):
    return {**remote_params(prompt_len, harness.block_size), **change}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_refused_requests_fail_alone(small_topk_model_dir, async_scheduling, caplog):
    """Invalid kv_transfer_params (checked when the request arrives, or when it is offered
    and the imported tokens are known): one WARNING each, a REFUSE order that contacts
    nobody, FINISHED_ERROR; the good P/D request and the local one finish; nothing leaks.
    (Before: ``int("http")`` raised out of on_new_request, stopping the engine; the
    duplicate, missing and uncovered blocks reached the workers' reads.)"""
    caplog.set_level("WARNING", logger="vllm_hisparse.vllm.pd.landings")
    harness, worker = build(small_topk_model_dir, async_scheduling=async_scheduling)
    local = harness.add_request(200, 12)
    good = add_pd_request(harness, PROMPT, 8)
    bad = {
        "remote_block_ids": add_pd_request(harness, PROMPT, 8, kv_params=_bad_params(
            harness, PROMPT, remote_block_ids=[[5, 5, 6]])),
        "remote_port": add_pd_request(harness, PROMPT, 8, kv_params=_bad_params(
            harness, PROMPT, remote_port="http")),
        "remote_engine_id": add_pd_request(harness, 300, 8, kv_params=_bad_params(
            harness, 300, remote_engine_id=None)),
        "do_remote_prefill": add_pd_request(harness, 300, 8, kv_params=_bad_params(
            harness, 300, do_remote_prefill="true")),
        # 1024 tokens import 16 pages; the prefill names 4 (checked at the offer)
        "coverage": add_pd_request(harness, PROMPT, 8, kv_params=_bad_params(harness, 256)),
    }
    finish(harness)
    refused = [r for r in caplog.records if r.name == "vllm_hisparse.vllm.pd.landings"]
    assert len(refused) == len(bad)
    for field, request in bad.items():
        assert request.status == RequestStatus.FINISHED_ERROR and not request.output_token_ids, field
        order = worker.imports[request.request_id]
        assert order.action is ImportAction.REFUSE and order.remote is None, field
        message = next(r.getMessage() for r in refused if repr(request.request_id) in r.getMessage())
        want = "remote_block_ids" if field == "coverage" else field
        assert f"kv_transfer_params.{want}: " in message, message
    assert good.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(good.output_token_ids) == 8
    assert local.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(local.output_token_ids) == 12
    role = harness.residency
    # Leases renewed only for params valid at arrival (the coverage one until its offer).
    assert not worker.releases
    assert {rid for h in worker.heartbeats for rid in h.request_ids} <= {f"p-{good.request_id}", "p-req"}
    assert role.landings.num_pd_landings == {Landing.RESIDENT: 1, Landing.HOST: 0}
    assert not role.landings._refused and not role.landings._settled and not role.landings._offers


def test_a_refused_request_is_recomputed_under_recompute(small_topk_model_dir, caplog):
    harness, worker = build(small_topk_model_dir, failure_policy="recompute")
    with caplog.at_level("WARNING", logger="vllm_hisparse.vllm.pd.landings"):
        request = add_pd_request(harness, 300, 6, kv_params=_bad_params(harness, 300, tp_size=10**6))
        finish(harness)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(request.output_token_ids) == 6
    ours = [r.getMessage() for r in caplog.records if r.name == "vllm_hisparse.vllm.pd.landings"]
    assert len(ours) == 1 and "tp_size: 1000000 is outside 1..64" in ours[0]
    assert "vLLM recomputes it here" in ours[0]
    assert list(worker.imports) == [request.request_id]  # refused once, then computed here
    assert harness.residency.num_preemptions == 0


def test_a_request_vllm_computes_itself_is_released(small_topk_model_dir):
    """Prompt logprobs make vLLM skip every cache (``skip_reading_prefix_cache``): it
    allocates with no external tokens whatever the connector offered. The request is
    computed here and the prefill is told to free its blocks. (Before: a RuntimeError out
    of update_state_after_alloc stopped the engine.)"""
    harness, worker = build(small_topk_model_dir)
    request = add_pd_request(harness, PROMPT, 4, sampling={"prompt_logprobs": 1})
    finish(harness)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED and len(request.output_token_ids) == 4
    assert worker.releases == [request.request_id] and not worker.imports


@pytest.mark.parametrize("second", ["local", "refused", "pd"])
def test_a_host_landings_hot_region_is_kept_for_it(small_topk_model_dir, second):
    """A host landing leases its hot region at the step's end: the admissions after it in
    the same pass (a local request, a refused one, another P/D landing) must leave those
    blocks free. (Found by test_pd_fuzz: the policy then refused the landing, CANCEL.)"""
    harness, worker = build(small_topk_model_dir, free=60)
    landing = add_pd_request(harness, PROMPT, 4)
    if second == "local":
        other = harness.add_request(300, 4)
    elif second == "refused":
        other = add_pd_request(harness, 300, 4, kv_params=_bad_params(harness, 300, tp_size=0))
    else:
        other = add_pd_request(harness, 300, 4)
    harness.step()
    assert worker.imports[landing.request_id].action is ImportAction.READ
    assert worker.imports[landing.request_id].host_blocks
    finish(harness)
    assert landing.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert other.status == (RequestStatus.FINISHED_ERROR if second == "refused"
                            else RequestStatus.FINISHED_LENGTH_CAPPED)
