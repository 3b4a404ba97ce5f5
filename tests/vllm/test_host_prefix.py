"""The host tier as a prefix cache, on vLLM's real Scheduler (and the worker role on CPU).

* Publication: a full page is published under vLLM's block hash once its sparse-MLA rows
  and its indexer page are on the host (the indexer page rides with the step's mirror).
* Hits: ``get_num_new_matched_tokens`` reports published pages past vLLM's own prefix-cache
  hit; vLLM allocates their blocks, and the step's command restores them (sparse-MLA rows
  and indexer pages) into exactly those blocks before the forward.
* Preemption: a preempted request's pages are published, so it resumes from the host
  instead of recomputing (when what it would recompute takes more than one prefill chunk;
  a shorter one is recomputed in the step a load would have waited).
* Loads are asynchronous (vLLM holds the request in WAITING_FOR_REMOTE_KVS): a failed load
  is reported per request in ``failed_recving`` (vLLM refuses block-level
  ``invalid_block_ids`` with several KV cache groups) and fails that request alone.
"""

from __future__ import annotations

import pytest
import torch

from tests.vllm.fake_worker import FakeWorker
from tests.vllm.scheduler_harness import SchedulerHarness
from tests.vllm.test_worker_side import allocate, planned
from vllm_hisparse.vllm.simulation.model import kv_transfer_config
from vllm_hisparse.core import StepCommand, TransferKind, TransferSpec
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, IndexerPages
from vllm_hisparse.vllm.worker_side.role import WorkerRole

BS = 64


def _harness(model_dir, *, num_blocks=400, async_scheduling=False, extra=None, worker=None,
             load_failure_policy="fail", **kwargs):
    kv_transfer = kv_transfer_config({"host_pool_gib": 0.25, **(extra or {})})
    kv_transfer.kv_load_failure_policy = load_failure_policy
    return SchedulerHarness.build(
        model_dir, num_blocks=num_blocks, kv_transfer=kv_transfer,
        async_scheduling=async_scheduling, worker=worker, max_model_len=1024, **kwargs)


def _metadata(output) -> HiSparseConnectorMetadata:
    meta = output.kv_connector_metadata
    assert isinstance(meta, HiSparseConnectorMetadata)
    return meta


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_prefix_published_on_the_host_is_loaded_into_vllms_blocks(dsa_model_dir, async_scheduling):
    """A's prompt pages are published; after vLLM's device prefix cache is reset, B (same
    prefix) gets them as external tokens and the command restores them, indexer pages
    included, into the blocks vLLM allocated for B."""
    h = _harness(dsa_model_dir, async_scheduling=async_scheduling)
    residency = h.residency
    assert residency.host_prefix.enabled
    prompt = [(i * 37) % 900 + 10 for i in range(10 * BS)]
    h.add_request(len(prompt), 3, prompt_token_ids=prompt)
    h.run_to_completion()
    published = residency.host_pool.num_cached_blocks
    assert published == 10  # every full page of A (its last page is partial)
    assert h.scheduler.reset_prefix_cache()  # only the host tier remembers A now

    b = h.add_request(len(prompt) + 30, 3, prompt_token_ids=prompt + [11] * 30)
    out = h.step()
    assert b.request_id not in out.num_scheduled_tokens  # its pages load first
    meta = _metadata(out)
    (load,) = [t for t in meta.command.transfers if t.kind == TransferKind.RESTORE]
    assert not load.after_forward
    sparse_tables = [m.req_to_blocks[b.request_id] for m in residency.managers]
    assert load.device_blocks == [blk.block_id for blk in sparse_tables[0][:10]]
    idx = meta.indexer_pages[load.transfer_id]
    assert not idx.to_host and idx.host_blocks == load.host_blocks
    idx_tables = [m.req_to_blocks[b.request_id] for m in residency.indexer_managers]
    assert idx.device_blocks == [[blk.block_id for blk in t[:10]] for t in idx_tables]
    for lead in load.device_blocks:  # bundles name every sparse group's block of each page
        assert meta.bundles[lead] == [t[load.device_blocks.index(lead)].block_id
                                      for t in sparse_tables]
    assert residency.policy.stats.num_prefix_load_pages == 10
    assert meta.load_requests == {load.transfer_id: b.request_id}
    while b.request_id not in out.num_scheduled_tokens:
        out = h.step()
    assert out.num_scheduled_tokens[b.request_id] == 30  # 640 tokens came from the host
    h.run_to_completion()
    h.assert_no_leaks()


@pytest.mark.parametrize("num_workers", [1, 2])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_prefix_load_fails_that_request_alone(dsa_model_dir, async_scheduling,
                                                       num_workers):
    """[7] defect 1: a host-prefix hit whose RESTORE fails (on the last worker), on the real
    multi-group plan (4 sparse-MLA groups + the indexer group). It crashed the engine
    (block-level ``invalid_block_ids`` are refused with several KV cache groups); now vLLM
    gets it per request (``failed_recving``), fails that request alone, the others
    finish, and nothing leaks."""
    worker = FakeWorker(num_workers=num_workers, fail=lambda spec, rank: (
        spec.kind == TransferKind.RESTORE and rank == num_workers - 1))
    # Prefill chunks of 128 tokens: a 391-token resume takes several steps to recompute,
    # so the host hit is worth its load (shorter ones are recomputed).
    h = _harness(dsa_model_dir, async_scheduling=async_scheduling, worker=worker,
                 max_num_batched_tokens=128)
    h.residency.num_workers = num_workers
    assert len(h.kv_cache_config.kv_cache_groups) > 2 and h.residency.geometry.indexer_group_ids
    prompt = [(i * 29) % 900 + 10 for i in range(6 * BS)]
    h.add_request(len(prompt), 2, prompt_token_ids=prompt)
    h.run_to_completion()
    assert h.scheduler.reset_prefix_cache()
    hit = h.add_request(len(prompt) + 7, 4, prompt_token_ids=prompt + [13] * 7)
    others = h.add_requests(2, prompt_len=3 * BS, max_tokens=8)
    h.run_to_completion()
    assert worker.num_failed == 1  # the one RESTORE, on the last worker
    assert hit.is_finished() and hit.status.name == "FINISHED_ERROR"
    assert hit.request_id not in h.stats.finished or not hit.output_token_ids
    assert all(r.request_id in h.stats.finished and len(r.output_token_ids) == 8 for r in others)
    assert h.residency.policy.stats.num_failed_prefix_load_pages == 6
    h.assert_no_leaks()


def test_pages_still_cached_on_the_device_are_not_loaded_again(dsa_model_dir):
    h = _harness(dsa_model_dir)
    prompt = [(i * 13) % 900 + 10 for i in range(6 * BS)]
    h.add_request(len(prompt), 2, prompt_token_ids=prompt)
    h.run_to_completion()
    b = h.add_request(len(prompt) + 5, 2, prompt_token_ids=prompt + [12] * 5)
    out = h.step()
    # vLLM's own prefix cache serves all six pages: nothing external, no restore.
    assert out.num_scheduled_tokens[b.request_id] == 5
    assert not [t for t in _metadata(out).command.transfers if t.kind == TransferKind.RESTORE]
    h.run_to_completion()
    h.assert_no_leaks()


def test_a_page_is_published_only_once_its_mirror_completed(dsa_model_dir):
    """With acks delayed, nothing is published; after they arrive, the pages are."""
    h = _harness(dsa_model_dir, worker=FakeWorker(delay_steps=10_000))
    prompt = [(i * 7) % 900 + 10 for i in range(4 * BS)]
    a = h.add_request(len(prompt), 1, prompt_token_ids=prompt)
    for _ in range(3):
        h.step()
    h.drain()
    assert a.request_id in h.stats.finished  # ended before its mirror completed
    assert h.residency.policy.lookup_host_prefix(a.block_hashes) == 0
    h.scheduler.connector.update_connector_output(h.worker.flush())
    # The in-flight mirror completed the pages: published although the request ended.
    assert h.residency.policy.lookup_host_prefix(a.block_hashes) == 4
    assert h.residency.host_pool.num_cached_blocks == 4


def test_a_failed_mirror_never_publishes_its_pages(dsa_model_dir):
    worker = FakeWorker(fail=lambda spec, w: spec.kind == TransferKind.MIRROR)
    h = _harness(dsa_model_dir, worker=worker)
    prompt = [(i * 3) % 900 + 10 for i in range(3 * BS)]
    h.add_request(len(prompt), 2, prompt_token_ids=prompt)
    h.run_to_completion()
    assert worker.num_failed > 0
    # The pages became clean through spills instead; without their indexer pages saved
    # they must not be published.
    assert h.residency.host_pool.num_cached_blocks == 0
    h.assert_no_leaks()


def test_preempted_requests_resume_from_the_host(dsa_model_dir):
    """A preemption storm: preempted requests come back with their pages loaded from the
    host (external tokens), not recomputed, and everything is returned at the end."""
    h = _harness(dsa_model_dir, num_blocks=140)
    # Long outputs: growth, not admission, runs out of blocks (the admission headroom
    # gate, SchedulerRole.offer, prevents preemptions right after admission).
    h.add_requests(8, prompt_len=4 * BS, max_tokens=400)
    stats = h.run_to_completion()
    assert stats.preemptions > 0
    assert sorted(stats.finished) == sorted(h.requests)
    assert h.residency.policy.stats.num_prefix_load_pages > 0
    h.assert_no_leaks()


def test_hits_are_off_when_vllm_would_rewind_instead_of_failing(dsa_model_dir):
    h = _harness(dsa_model_dir, load_failure_policy="recompute")
    assert not h.residency.host_prefix.enabled
    prompt = [(i * 5) % 900 + 10 for i in range(4 * BS)]
    h.add_request(len(prompt), 1, prompt_token_ids=prompt)
    h.run_to_completion()
    assert h.residency.host_pool.num_cached_blocks == 0
    h.assert_no_leaks()


@pytest.mark.parametrize("host_layout", ["position", "layer"])
def test_simulated_resumes_read_exact_kv(host_layout):
    """The real worker role on CPU (reference ops): preempted requests come back with pages
    loaded from the host; every sparse-MLA row read and the indexer KV of every request
    that starts with computed tokens match the ground truth (else SimulationMismatch), in
    either host pool layout."""
    from vllm_hisparse.vllm.simulation.engine import SimulationEngine, SimulationSpec

    # Long outputs, so that growth forces preemptions (see the test above); prefill chunks
    # of 256 tokens, so that resumes take more than one chunk (else they are recomputed).
    spec = SimulationSpec(num_requests=8, prompt_len=256, output_len=384, device_blocks=160,
                          max_num_batched_tokens=256, connector_extra={"host_layout": host_layout})
    engine = SimulationEngine(spec)
    try:
        result = engine.run(with_connector=True)
    finally:
        engine.close()
    assert result.preemptions > 0
    assert result.host_prefix_hit_tokens > 0 and result.indexer_rows_checked > 0
    assert result.finished == 8


# ------------------------------------------------------------------ worker role (CPU)


@pytest.fixture
def role_rig(dsa_model_dir):
    vllm_config, kv_cache_config = planned_for(dsa_model_dir)
    kv = allocate(vllm_config, kv_cache_config)
    failing: set[int] = set()
    role = WorkerRole(vllm_config, resolve_config(vllm_config), kv_cache_config,
                              fail_transfer=lambda tid: tid in failing, huge_pages="never")
    role.register_kv_caches(kv)
    yield role, kv, failing
    role.shutdown()


def planned_for(model_dir):
    import tests.vllm.test_worker_side as ws

    return ws.planned(model_dir, 100)


def _page_views(role):
    return [v for group in role.prefix_loads.indexer_pages.groups for v in group]


def test_worker_saves_indexer_pages_before_the_mirror_and_loads_them_back(role_rig):
    role, kv, _ = role_rig
    store = role.prefix_loads.indexer_pages
    assert store is not None and store.num_layers == len(_page_views(role))
    ngroups = len(store.groups)
    bundles = {5: [5] * len(role.lanes)}
    pattern = torch.randint(0, 256, (store.num_layers, store.page_bytes), dtype=torch.uint8)
    for layer, view in enumerate(_page_views(role)):
        view[5] = pattern[layer]
    save = StepCommand(step_id=0, transfers=[
        TransferSpec(transfer_id=1, kind=int(TransferKind.MIRROR), after_forward=True)])
    role.start_load_kv(HiSparseConnectorMetadata(
        command=save, bundles=bundles,
        indexer_pages={1: IndexerPages([[5]] * ngroups, [3], to_host=True)}))
    role.wait_for_save()
    meta = role.build_worker_meta()
    assert meta is not None and 1 in meta.acks.completed and not meta.failed_indexer_saves
    for layer, host in enumerate(layer for g in store.host_groups for layer in g):
        assert torch.equal(host[3], pattern[layer])
    # Load host block 3 into block 9 of every indexer layer with a host-prefix RESTORE.
    load = StepCommand(step_id=1, transfers=[
        TransferSpec(transfer_id=2, kind=int(TransferKind.RESTORE), after_forward=False,
                     device_blocks=[9], host_blocks=[3])])
    role.start_load_kv(HiSparseConnectorMetadata(
        command=load, bundles={9: [9] * len(role.lanes)},
        indexer_pages={2: IndexerPages([[9]] * ngroups, [3], to_host=False)},
        load_requests={2: "req-b"}))
    role.wait_for_save()
    results = role.get_transfer_results()
    assert results.finished_recving == {"req-b"} and not results.failed_recving
    for layer, view in enumerate(_page_views(role)):
        assert torch.equal(view[9], pattern[layer])


def test_worker_reports_a_failed_prefix_load_to_vllm(role_rig):
    role, _, failing = role_rig
    ngroups = len(role.prefix_loads.indexer_pages.groups)
    failing.add(7)
    cmd = StepCommand(step_id=0, transfers=[
        TransferSpec(transfer_id=7, kind=int(TransferKind.RESTORE), after_forward=False,
                     device_blocks=[4], host_blocks=[2])])
    role.start_load_kv(HiSparseConnectorMetadata(
        command=cmd, bundles={4: [4] * len(role.lanes)},
        indexer_pages={7: IndexerPages([[4]] * ngroups, [2], to_host=False)},
        load_requests={7: "req-a"}))
    role.wait_for_save()
    results = role.get_transfer_results()
    assert results.finished_recving == {"req-a"} and results.failed_recving == {"req-a"}
    results = role.get_transfer_results()  # reported once
    assert not results.finished_recving and not results.failed_recving
    meta = role.build_worker_meta()
    assert meta.acks.failed == [7]


def test_worker_reports_a_failed_indexer_save(role_rig, monkeypatch):
    role, _, _ = role_rig

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(role.prefix_loads.indexer_pages, "save", broken)
    cmd = StepCommand(step_id=0, transfers=[
        TransferSpec(transfer_id=4, kind=int(TransferKind.MIRROR), after_forward=True)])
    ngroups = len(role.prefix_loads.indexer_pages.groups)
    role.start_load_kv(HiSparseConnectorMetadata(
        command=cmd, indexer_pages={4: IndexerPages([[1]] * ngroups, [1], to_host=True)}))
    role.wait_for_save()
    meta = role.build_worker_meta()
    assert meta.failed_indexer_saves == [4]


def test_indexer_pages_for_an_unknown_restore_are_refused(role_rig):
    role, _, _ = role_rig
    ngroups = len(role.prefix_loads.indexer_pages.groups)
    with pytest.raises(ValueError, match="not one of its RESTOREs"):
        role.start_load_kv(HiSparseConnectorMetadata(
            command=StepCommand(step_id=0),
            indexer_pages={9: IndexerPages([[1]] * ngroups, [1], to_host=False)}))


def test_a_resume_that_fits_one_prefill_chunk_is_recomputed(dsa_model_dir):
    """A hit shorter than one prefill chunk (391 tokens, chunks of 512) is not offered: the
    load would hold the request a step (WAITING_FOR_REMOTE_KVS) that recomputing spends
    anyway. With 128-token chunks the same hit is offered (test above)."""
    h = _harness(dsa_model_dir, max_num_batched_tokens=512)
    prompt = [(i * 29) % 900 + 10 for i in range(6 * BS)]
    h.add_request(len(prompt), 2, prompt_token_ids=prompt)
    h.run_to_completion()
    assert h.scheduler.reset_prefix_cache() and h.residency.host_pool.num_cached_blocks == 6
    b = h.add_request(len(prompt) + 7, 2, prompt_token_ids=prompt + [13] * 7)
    out = h.step()
    assert out.num_scheduled_tokens[b.request_id] == len(prompt) + 7
    assert h.residency.policy.stats.num_prefix_load_pages == 0
    h.run_to_completion()
    h.assert_no_leaks()
