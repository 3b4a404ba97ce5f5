"""``MultiConnector[HiSparseResidencyConnector, OffloadingConnector]`` on vLLM's real
Scheduler (CPU): vLLM's real OffloadingConnector scheduler side with its CPU backend's
manager, our real scheduler role. Fake: the model forward, our worker's acks
(``FakeWorker``) and the offloading worker's (its copies need CUDA): every store and load
job it plans is reported completed with the next step's output, a load's request in
``finished_recving``.

* only the non-sparse groups (here: the indexer group) are offloaded;
* a prefix whose sparse-MLA pages are still cached on the device but whose indexer pages
  were evicted: OffloadingConnector restores only that indexer suffix, into the indexer
  group's fresh blocks, while the sparse groups get their cached blocks back;
* the same without the pages in its store: vLLM falls back to the prefix every group holds;
* our host prefix longer than the device's: we restore the sparse-MLA pages the device lost
  and the indexer pages of the whole suffix, nothing of the cached sparse pages;
* nothing leaks.
"""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig
from vllm.v1.outputs import KVConnectorOutput

from tests.vllm.fake_worker import FakeWorker
from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.vllm.simulation.model import CONNECTOR, kv_transfer_config
from vllm_hisparse.core.commands import TransferKind
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.compat import multi_connector_types
from vllm_hisparse.vllm.setup.config import HiSparseConfigError
from vllm_hisparse.vllm.setup.kv_plan import indexer_group_ids, sparse_group_ids
from vllm_hisparse.vllm.setup.offloading_scope import check_offloading_scope

BS = 64
PROMPT_PAGES = 8


def composed(offloading_first: bool = False) -> KVTransferConfig:
    ours = {"kv_connector": CONNECTOR, "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_pool_gib": 1}}
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 28}}
    children = [offload, ours] if offloading_first else [ours, offload]
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config={"connectors": children})


class ComposedWorker(FakeWorker):
    """Our acks (``FakeWorker``) plus the offloading worker's: each job it planned is
    reported completed one step later; a load job's request is also finished receiving."""

    offload_index: int = 1

    def on_forward(self, scheduler_output):
        ours = super().on_forward(scheduler_output)
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        due, self._offload_due = getattr(self, "_offload_due", []), []
        meta = scheduler_output.kv_connector_metadata.metadata[self.offload_index]
        self.offload_metadata.append(meta)
        self._offload_due = [(jid, None) for jid in meta.store_jobs] + [
            (jid, None if job.sync else job.req_id) for jid, job in meta.load_jobs.items()]
        if not due:
            return ours
        worker_meta = OffloadingWorkerMetadata()
        for jid, _ in due:
            worker_meta.mark_completed(jid)
        loaded = {rid for _, rid in due if rid is not None}
        _, _, multi_meta = multi_connector_types()
        slots = list(ours.kv_connector_worker_meta.metadata) if ours else [None, None]
        slots[self.offload_index] = worker_meta
        finished = set(ours.finished_recving or ()) | loaded if ours else loaded
        return KVConnectorOutput(kv_connector_worker_meta=multi_meta(metadata=tuple(slots)),
                                 finished_recving=finished or None,
                                 failed_recving=ours.failed_recving if ours else set())

    @property
    def offload_metadata(self) -> list:
        if not hasattr(self, "_offload_metadata"):
            self._offload_metadata = []
        return self._offload_metadata


def build(model_dir, *, offloading_first=False, num_blocks=400, async_scheduling=False,
          max_num_batched_tokens=1024):
    worker = ComposedWorker(multi_index=1 if offloading_first else 0)
    worker.offload_index = 0 if offloading_first else 1
    return SchedulerHarness.build(model_dir, kv_transfer=composed(offloading_first), worker=worker,
                                  num_blocks=num_blocks, max_model_len=2048,
                                  max_num_batched_tokens=max_num_batched_tokens,
                                  async_scheduling=async_scheduling)


def settle(harness, steps=4):
    for _ in range(steps):
        harness.step()
    harness.drain()


def prompt_tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + i * 7) % 900 + 10 for i in range(n)]


def run_first(harness, tokens):
    """Request A: computes the prompt, finishes; its pages stay cached on the device and
    are stored by OffloadingConnector and published in our host pool. Returns its blocks
    per group (page order)."""
    managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
    first = harness.add_request(len(tokens), 4, prompt_token_ids=tokens)
    blocks = None
    while not first.is_finished():
        harness.step()
        if first.num_computed_tokens >= len(tokens) and blocks is None:
            blocks = [[b.block_id for b in m.req_to_blocks[first.request_id][:PROMPT_PAGES]]
                      for m in managers]
    harness.drain()
    settle(harness)
    return blocks


def first_start(harness, request) -> dict:
    """Records ``request``'s computed tokens when it is first scheduled (its prefix hit:
    local plus loaded)."""
    seen: dict = {}
    real = harness.connector.build_connector_meta

    def spy(scheduler_output):
        if request.request_id in scheduler_output.num_scheduled_tokens and "start" not in seen:
            seen["start"] = request.num_computed_tokens
        meta = real(scheduler_output)
        seen.setdefault("metas", []).append(meta)
        return meta

    harness.connector.build_connector_meta = spy
    return seen


def test_only_the_indexer_group_is_offloaded(small_topk_model_dir):
    harness = build(small_topk_model_dir)
    config = harness.kv_cache_config
    indexer = indexer_group_ids(config)
    assert compat.offloading_group_ids(config) == indexer
    assert config.hisparse_host_num_blocks == harness.residency.host_pool.num_blocks
    assert all(config.kv_cache_groups[g].role == compat.OFFLOADED_GROUP_ROLE for g in indexer)
    requests = harness.add_requests(6, prompt_len=700, max_tokens=200)
    managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
    indexer_blocks: dict[str, set[int]] = {}
    while harness.scheduler.has_requests():
        harness.step()
        for r in requests:
            if r.request_id in managers[indexer[0]].req_to_blocks:
                indexer_blocks.setdefault(r.request_id, set()).update(
                    b.block_id for b in managers[indexer[0]].req_to_blocks[r.request_id])
    settle(harness)
    stores = [job for meta in harness.worker.offload_metadata for job in meta.store_jobs.values()]
    assert stores
    for job in stores:
        assert list(job.src_spec.group_sizes) == [len(job.src_spec.block_ids)]  # one group
        assert set(job.src_spec.block_ids.tolist()) <= indexer_blocks[job.req_id]
    assert all(len(r.output_token_ids) == 200 for r in requests)
    harness.assert_no_leaks()


def test_alone_nothing_is_scoped(small_topk_model_dir):
    harness = SchedulerHarness.build(small_topk_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
                                     num_blocks=400, max_model_len=2048)
    config = harness.kv_cache_config
    assert config.hisparse_host_num_blocks is None
    assert compat.OFFLOADED_GROUP_ROLE not in {g.role for g in config.kv_cache_groups}


@pytest.mark.parametrize("in_store", [True, False], ids=["restored", "fallback"])
def test_indexer_suffix_restored_through_offloading(small_topk_model_dir, in_store):
    """A's sparse-MLA pages stay cached, its indexer pages 3.. are evicted from the
    device. B shares A's prompt: OffloadingConnector loads indexer pages 3..7 only, into
    fresh indexer blocks, and B's sparse groups get A's cached blocks back (not fresh,
    unwritten ones). With its CPU store reset B falls back to the 3 shared pages."""
    harness = build(small_topk_model_dir)
    config = harness.kv_cache_config
    sparse, indexer = sparse_group_ids(config), indexer_group_ids(config)
    managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
    tokens = prompt_tokens(1, PROMPT_PAGES * BS + 10)
    blocks_a = run_first(harness, tokens)
    if not in_store:  # its CPU store lost the pages (vLLM's public reset)
        assert harness.scheduler.connector._connectors[1].reset_cache()
    pool = harness.scheduler.kv_cache_manager.block_pool
    pool.evict_blocks({b for g in indexer for b in blocks_a[g][3:]})
    loads_before = sum(len(m.load_jobs) for m in harness.worker.offload_metadata)
    b = harness.add_request(0, 4, prompt_token_ids=tokens[: PROMPT_PAGES * BS] + prompt_tokens(2, 20))
    seen = first_start(harness, b)
    harness.step()  # admission: vLLM allocates; a load parks B in WAITING_FOR_REMOTE_KVS
    assert not harness.residency.host_prefix.has_hit(b.request_id)  # we left it to Offloading
    loads = [job for m in harness.worker.offload_metadata for job in m.load_jobs.values()][loads_before:]
    if in_store:
        assert [job.req_id for job in loads] == [b.request_id]
        dst = loads[0].dst_spec
        own_indexer = [blk.block_id for blk in managers[indexer[0]].req_to_blocks[b.request_id]]
        assert list(dst.group_sizes) == [PROMPT_PAGES - 3]
        assert dst.block_ids.tolist() == own_indexer[3:PROMPT_PAGES]
        assert not set(dst.block_ids.tolist()) & set(blocks_a[indexer[0]])
        for g in sparse:  # the cached sparse-MLA pages, not fresh blocks
            got = [blk.block_id for blk in managers[g].req_to_blocks[b.request_id][:PROMPT_PAGES]]
            assert got == blocks_a[g]
    else:
        assert loads == []  # vLLM computes from the prefix every group holds (checked below)
        for g in sparse:
            got = [blk.block_id for blk in managers[g].req_to_blocks[b.request_id][:PROMPT_PAGES]]
            assert got[:3] == blocks_a[g][:3] and not set(got[3:]) & set(blocks_a[g][3:])
    while harness.scheduler.has_requests():
        harness.step()
    settle(harness)
    assert b.is_finished() and len(b.output_token_ids) == 4
    assert seen["start"] == (PROMPT_PAGES if in_store else 3) * BS
    harness.assert_no_leaks()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_our_host_prefix_longer_than_the_device(small_topk_model_dir, async_scheduling):
    """Device: sparse-MLA pages 0..5 and indexer pages 0..2 of A's prompt; our host pool:
    all 8 pages. We load B (our connector comes first): the RESTORE copies only sparse
    pages 6, 7 into fresh blocks (pages 3..5 keep A's cached blocks), the indexer pages
    3..7 ride with it; OffloadingConnector loads nothing. Under async scheduling vLLM
    defers ``update_state_after_alloc`` of the load by a step (``defer_async_loads``, on
    because ``hisparse_host_num_blocks`` is set): the offered prefix stays leased.
    Prefill chunks of 256 tokens: the 340 tokens B would recompute take two, so the host
    load saves a step and is offered (one chunk's worth would be recomputed)."""
    harness = build(small_topk_model_dir, async_scheduling=async_scheduling, max_num_batched_tokens=256)
    assert harness.scheduler.defer_async_loads == async_scheduling
    config = harness.kv_cache_config
    sparse, indexer = sparse_group_ids(config), indexer_group_ids(config)
    managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
    tokens = prompt_tokens(3, PROMPT_PAGES * BS + 10)
    blocks_a = run_first(harness, tokens)
    pool = harness.scheduler.kv_cache_manager.block_pool
    pool.evict_blocks({b for g in indexer for b in blocks_a[g][3:]}
                      | {b for g in sparse for b in blocks_a[g][6:]})
    loads_before = sum(len(m.load_jobs) for m in harness.worker.offload_metadata)
    b = harness.add_request(0, 4, prompt_token_ids=tokens[: PROMPT_PAGES * BS] + prompt_tokens(4, 20))
    seen = first_start(harness, b)
    harness.step()
    # Offered while B's update_state_after_alloc is still deferred (async scheduling).
    harness.add_request(0, 4, prompt_token_ids=prompt_tokens(5, 300))
    while harness.scheduler.has_requests():
        harness.step()
    settle(harness)
    load = next(m for m in seen["metas"] if b.request_id in m.load_requests.values())
    (tid,) = [t for t, rid in load.load_requests.items() if rid == b.request_id]
    restore = next(t for t in load.command.transfers if t.transfer_id == tid)
    assert TransferKind(restore.kind) is TransferKind.RESTORE
    assert len(restore.device_blocks) == 2  # sparse pages 6 and 7 (one bundle each)
    pages = load.indexer_pages[tid]
    assert [len(blocks) for blocks in pages.device_blocks] == [PROMPT_PAGES - 3] * len(indexer)
    assert sum(len(m.load_jobs) for m in harness.worker.offload_metadata) == loads_before
    assert b.is_finished() and seen["start"] == PROMPT_PAGES * BS
    harness.assert_no_leaks()


def test_a_scope_vllm_reads_otherwise_is_refused(small_topk_model_dir):
    """The construction check (both roles): vLLM must read the fields as we set them."""
    harness = build(small_topk_model_dir)
    config = harness.kv_cache_config
    check_offloading_scope(config)
    for group in config.kv_cache_groups:  # as if vLLM keyed on another role
        if group.role == compat.OFFLOADED_GROUP_ROLE:
            group.role = compat.RESIDENCY_GROUP_ROLE
    with pytest.raises(HiSparseConfigError, match=r"OffloadingConnector would offload KV cache groups \[\]"):
        check_offloading_scope(config)
