"""The P/D host landing's reading of vLLM's NixlConnector protocol, without transfers:
the prefill's ``kv_transfer_params``, its registration (per-layer and packed layouts), the
reader counts of heterogeneous tensor parallelism, the composition rules, and our side
channel client against vLLM's own listener."""

from __future__ import annotations

import threading

import msgspec
import pytest
from vllm.config import KVTransferConfig

from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.setup.config import HiSparseConfigError
from vllm_hisparse.vllm.pd.transfer_params import parse_remote_prefill
from vllm_hisparse.vllm.pd.composition import pd_composition
from vllm_hisparse.vllm.pd.nixl_transport import (
    ImportTransferError,
    RemotePage,
    nixl_missing,
    query_prefill,
    remote_layer_pages,
)
from vllm_hisparse.vllm.pd.reads import readers_of
from tests.vllm.pd_fakes import pd_kv_transfer, remote_params
from tests.vllm.pd_prefill import free_port
from tests.vllm.test_worker_side import model_dir  # noqa: F401 (fixture)


def _meta(**fields):
    _, _, meta_type, _ = compat.nixl_handshake_types()
    base = dict(engine_id="p", agent_metadata=b"", device_id=0, num_blocks=10, kv_cache_layout="LBHNC",
                block_size=64, ssm_sizes=(0, 0), attn_backend_name="X",
                physical_blocks_per_logical_kv_block=1)
    base.update(fields)
    return meta_type(**base)


def test_per_layer_regions():
    meta = _meta(kv_caches_base_addr=[1000, 9000], block_lens=[64, 32], block_strides=[64, 32],
                 region_names=["a", "b"], region_group_ids=[0, 0])
    assert remote_layer_pages(meta) == {"a": RemotePage(1000, 64, 64, 0, 10),
                                        "b": RemotePage(9000, 32, 32, 0, 10)}


def test_packed_rows_and_a_separate_indexer_region():
    """Block-outermost prefill: one region whose block is a row of every MLA layer's page."""
    meta = _meta(kv_caches_base_addr=[1000, 50000], block_lens=[300, 40], block_strides=[300, 40],
                 region_names=["mla0", "idx"], region_group_ids=[0, 1], region_num_blocks=[10, 7],
                 region_members=[["mla0", "mla1"], ["idx"]],
                 packed_member_layouts={"mla0": (0, 100), "mla1": (100, 200)})
    assert remote_layer_pages(meta) == {"mla0": RemotePage(1000, 100, 300, 0, 10),
                                        "mla1": RemotePage(1100, 200, 300, 0, 10),
                                        "idx": RemotePage(50000, 40, 40, 1, 7)}


@pytest.mark.parametrize("fields, match", [
    (dict(region_names=None), "names no layers"),
    (dict(region_names=["a"], region_group_ids=[-1], packed_member_layouts={"a": (0, 10)}),
     "several KV cache groups"),
    (dict(region_names=["a"], packed_member_layouts={"a": (4, 10)}), "at bytes 4..14 of a 10 B"),
    (dict(region_names=["a"], region_num_blocks=[1, 2]), "regions of different lengths"),
])
def test_registrations_a_host_landing_cannot_read(fields, match):
    meta = _meta(kv_caches_base_addr=[1], block_lens=[10], block_strides=[10], **fields)
    with pytest.raises(ImportTransferError, match=match):
        remote_layer_pages(meta)


def test_remote_prefill_from_params():
    """The accepted forms (the refusals: tests/vllm/test_pd_params.py)."""
    params = remote_params(130, 64)
    remote = parse_remote_prefill(params, max_blocks=10)
    assert remote.block_ids == ((100, 101, 102),) and remote.tp_size == 1 and remote.generation == 0
    assert remote.num_tokens == 130
    flat = parse_remote_prefill({**params, "remote_block_ids": [7, 8]}, max_blocks=10)
    assert flat.block_ids == ((7, 8),)
    for local in (None, {}, {"do_remote_prefill": False}, {**params, "do_remote_prefill": None}):
        assert parse_remote_prefill(local, max_blocks=10) is None, local


@pytest.mark.parametrize("decode, prefill, want", [
    (1, 1, [1]), (4, 2, [2, 2]), (1, 2, [1, 0]), (2, 4, [1, 1, 0, 0]), (3, 2, [2, 1])])
def test_readers_of_each_prefill_rank(decode, prefill, want):
    assert [readers_of(q, decode, prefill) for q in range(prefill)] == want


def test_composition_rules():
    assert pd_composition(pd_kv_transfer(compose="alone")).enabled
    assert pd_composition(pd_kv_transfer(compose="first")).enabled
    with pytest.raises(HiSparseConfigError, match="before HiSparseResidencyConnector"):
        pd_composition(pd_kv_transfer(compose="after"))
    second = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_consumer",
                              kv_connector_extra_config={"connectors": [
                                  {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
                                  {"kv_connector": "HiSparseResidencyConnector", "kv_role": "kv_consumer"}]})
    assert not pd_composition(second).enabled and "first" in pd_composition(second).reason
    for role in ("kv_producer", "kv_both"):  # kv_both: the colocated default needs no NIXL
        alone = KVTransferConfig(kv_connector="HiSparseResidencyConnector", kv_role=role)
        assert not pd_composition(alone).enabled
    assert not pd_composition(None).enabled
    extra = pd_kv_transfer(compose="first")
    extra.kv_connector_extra_config["connectors"][1]["kv_connector_extra_config"] = {"backends": ["UCX"]}
    assert pd_composition(extra).nixl_extra_config == {"backends": ["UCX"]}


def test_our_side_channel_client_against_vllms_listener():
    """vLLM's own ``_nixl_handshake_listener`` serves a payload built from its own types;
    our client gets it byte for byte."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )

    _, payload_type, _, _ = compat.nixl_handshake_types()
    meta = _meta(kv_caches_base_addr=[1], block_lens=[10], block_strides=[10], region_names=["a"])
    payload = msgspec.msgpack.encode(payload_type(compatibility_hash="h",
                                                  agent_metadata_bytes=msgspec.msgpack.encode(meta)))
    port = free_port()
    ready, stop = threading.Event(), threading.Event()
    listener = threading.Thread(target=NixlBaseConnectorScheduler._nixl_handshake_listener,
                                args=({(0, 0): payload, (0, 1): b"rank1"}, ready, stop, "127.0.0.1", port),
                                daemon=True)
    listener.start()
    try:
        assert ready.wait(10)
        assert query_prefill("127.0.0.1", port, 0) == payload
        assert query_prefill("127.0.0.1", port, 1) == b"rank1"
    finally:
        stop.set()
        listener.join(10)


@pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))
@pytest.mark.parametrize("prefill_layout", ["BLHNC", "LBHNC"])
def test_vllm_nixl_connector_cannot_read_into_our_kv_plan(model_dir, monkeypatch, prefill_layout):
    """Why this connector reads P/D requests itself: vLLM 0.33's NixlConnector worker on the
    decode side (our split, block-outermost plan) refuses a stock prefill's registration
    (one KV cache group), whichever layout the prefill uses. Faked: the CPU platform's
    NIXL support, the TP rank, the attention backend (no model is built)."""
    import copy
    import os
    import types

    import msgspec
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    from vllm_hisparse.vllm.simulation.model import dsa_layer_specs
    from tests.vllm.test_worker_side import LEADERS, NUM_LAYERS, allocate, planned
    from vllm_hisparse.vllm.simulation.model import make_vllm_config

    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: None, raising=False)
    monkeypatch.setitem(base_worker._NIXL_SUPPORTED_DEVICE, "cpu", ("cpu",))
    monkeypatch.setattr(base_worker, "current_platform", types.SimpleNamespace(
        device_type="cpu", get_nixl_memory_type=lambda: "DRAM", discover_numa_topology=lambda: [[0]],
        set_device=lambda d: None, is_rocm=lambda: False))
    monkeypatch.setattr(base_worker, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(base_worker, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(base_worker, "get_current_attn_backends", lambda *a, **k: [FlashMLASparseBackend])

    def worker(config, kv_cache_config, kv, role, engine):
        config = copy.copy(config)
        config.kv_transfer_config = KVTransferConfig(kv_connector="NixlConnector", kv_role=role,
                                                     engine_id=engine, kv_buffer_device="cpu")
        w = NixlPullConnectorWorker(config, engine, kv_cache_config)
        w.register_kv_caches(kv)
        return w

    p_config = make_vllm_config(model_dir, max_model_len=1024, kv_cache_layout=prefill_layout,
                                kv_transfer=KVTransferConfig(kv_connector="NixlConnector",
                                                             kv_role="kv_producer"))
    specs = dsa_layer_specs(NUM_LAYERS, leaders=LEADERS, block_size=64)
    p_config.cache_config.num_gpu_blocks_override = 100
    (p_plan,) = get_kv_cache_configs(p_config, [specs], [1 << 40],
                                     get_global_kv_cache_groups(p_config, [specs]))
    assert len(p_plan.kv_cache_groups) == 1  # stock vLLM: sparse-MLA and indexer merged
    prefill = worker(p_config, p_plan, compat.allocate_kv_cache(
        p_plan, torch.device("cpu"), compat.resolved_kv_cache_layout(p_config)), "kv_producer", "p")
    d_config, d_plan = planned(model_dir, 200)
    assert len(d_plan.kv_cache_groups) > 1  # ours: sparse-MLA groups apart from the indexer
    decode = worker(d_config, d_plan, allocate(d_config, d_plan), "kv_consumer", "d")
    _, payload_type, meta_type, _ = compat.nixl_handshake_types()
    payload = msgspec.msgpack.Decoder(payload_type).decode(
        msgspec.msgpack.encode(prefill.xfer_handshake_metadata))
    meta = msgspec.msgpack.Decoder(meta_type).decode(payload.agent_metadata_bytes)
    with pytest.raises(RuntimeError, match="Packed KV block rows differ between P and D"):
        decode.add_remote_agent(meta, 0, 1)
    assert remote_layer_pages(meta)  # while our reader addresses every layer's pages
