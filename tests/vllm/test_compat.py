"""Every vLLM internal this package (and its scheduler harness) relies on exists, with
the signature relied on. A failure here names exactly what moved in a vLLM upgrade."""

from __future__ import annotations

import dataclasses
import inspect
import types

import pytest

from vllm_hisparse.vllm import compat


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_vllm_version_is_the_pinned_series():
    import vllm

    assert vllm.__version__.startswith("0.33."), vllm.__version__


def test_connector_factory():
    factory = compat.KVConnectorFactory
    assert isinstance(factory._registry, dict)
    assert params(factory.register_connector) == ["name", "module_path", "class_name"]
    assert params(factory.get_connector_class_by_name) == ["connector_name"]
    assert params(factory.get_connector_class) == ["kv_transfer_config"]
    assert params(factory.supports_hma_config) == ["kv_transfer_config"]


def test_connector_base_api():
    base = compat.KVConnectorBase_V1
    assert params(base.__init__) == ["self", "vllm_config", "role", "kv_cache_config"]
    assert sorted(base.__abstractmethods__) == [
        "build_connector_meta", "get_num_new_matched_tokens", "save_kv_layer",
        "start_load_kv", "update_state_after_alloc", "wait_for_layer_load", "wait_for_save",
    ]
    assert params(base.get_required_kvcache_layout) == ["vllm_config"]
    assert params(compat.SupportsHMA.request_finished_all_groups) == ["self", "request", "block_ids"]
    assert {r.name for r in compat.KVConnectorRole} == {"SCHEDULER", "WORKER"}
    for name in ("reset", "aggregate", "reduce", "is_empty"):
        assert callable(getattr(compat.KVConnectorStats, name))
    assert "data" in {f.name for f in dataclasses.fields(compat.KVConnectorStats)}


def test_planner_hook_target():
    from vllm.platforms.interface import Platform

    descriptor = Platform.__dict__["get_kv_cache_config_builder_cls"]
    assert isinstance(descriptor, classmethod)
    assert params(descriptor.__func__) == ["cls", "vllm_config"]
    # The unwrapped function answers the default builder for every in-tree platform.
    original = getattr(descriptor.__func__, "__vllm_hisparse_original__", descriptor.__func__)
    assert original(Platform, None) == compat.DEFAULT_BUILDER_QUALNAME
    builder = compat.DefaultKVCacheConfigBuilder
    assert issubclass(builder, compat.KVCacheConfigBuilder)
    assert params(builder.get_kv_cache_groups) == ["self", "vllm_config", "kv_cache_spec"]
    assert params(builder.get_kv_cache_config_from_groups) == [
        "self", "vllm_config", "kv_cache_groups", "num_blocks"]
    assert params(compat.get_kv_cache_groups) == ["vllm_config", "kv_cache_spec"]
    from vllm.v1.core import kv_cache_config_builder

    assert params(kv_cache_config_builder.get_kv_cache_config_builder) == ["vllm_config"]


def test_kv_cache_interface_fields():
    mla = {f.name for f in dataclasses.fields(compat.MLAAttentionSpec)}
    assert {"cache_role", "is_index_group_leader", "model_version", "block_size",
            "is_draft", "block_stride_alignment"} <= mla
    assert {r.name for r in compat.SparseCacheRole} == {"SPARSE", "INDEXER"}
    assert issubclass(compat.HiddenStateCacheSpec, compat.MLAAttentionSpec)
    assert callable(compat.UniformTypeKVCacheSpecs.from_specs)
    assert {"layer_names", "kv_cache_spec", "role", "host_resident"} <= {
        f.name for f in dataclasses.fields(compat.KVCacheGroupSpec)}
    assert {"num_blocks", "kv_cache_tensors", "kv_cache_groups"} <= {
        f.name for f in dataclasses.fields(compat.KVCacheConfig)}
    assert compat.KVCacheLayout.BLHNC.is_block_outermost
    assert not compat.KVCacheLayout.LBHNC.is_block_outermost
    assert hasattr(compat.MLAAttentionSpec, "get_block_stride_alignment")


def test_config_fields_read(dsa_model_dir):
    from vllm_hisparse.vllm.simulation.model import make_vllm_config

    from vllm.config import (CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             SpeculativeConfig)

    assert {"pipeline_parallel_size", "decode_context_parallel_size",
            "tensor_parallel_size"} <= set(ParallelConfig.__dataclass_fields__)
    assert {"disable_hybrid_kv_cache_manager", "max_num_batched_tokens",
            "async_scheduling"} <= set(SchedulerConfig.__dataclass_fields__)
    assert {"block_size", "kv_cache_layout"} <= set(CacheConfig.__dataclass_fields__)
    assert "num_speculative_tokens" in SpeculativeConfig.__dataclass_fields__
    # original_max_model_len is set in ModelConfig.__post_init__ (config/model.py:823).
    model_config = make_vllm_config(dsa_model_dir).model_config
    assert isinstance(model_config, ModelConfig)
    for name in ("hf_text_config", "max_model_len", "original_max_model_len",
                 "supports_kv_cache_grouping"):
        assert hasattr(model_config, name), name
    assert compat.CUDAGraphMode.FULL.name == "FULL"
    assert params(CacheConfig.get_resolved_kv_cache_layout) == ["self"]


def test_scheduler_classes():
    scheduler, async_scheduler = compat.scheduler_classes()
    assert issubclass(async_scheduler, scheduler)
    assert params(scheduler.__init__)[:5] == [
        "self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size"]
    assert params(scheduler.schedule)[0] == "self"
    assert all(p.default is not inspect.Parameter.empty
               for p in list(inspect.signature(scheduler.schedule).parameters.values())[1:])
    assert params(scheduler.update_from_output) == ["self", "scheduler_output", "model_runner_output"]
    assert params(scheduler.add_request) == ["self", "request"]


@pytest.mark.parametrize("name", compat.__all__)
def test_every_exported_name_resolves(name):
    assert getattr(compat, name) is not None


# ------------------------------------------------------------------ scheduler side
def test_block_pool_reuse_watchers():
    """``unpin_blocks`` drops one reference and registers one watcher per block;
    ``get_new_blocks`` fires it when it hands the block out again."""
    pool = compat.BlockPool(num_gpu_blocks=4, enable_caching=False, hash_block_size=16)
    assert params(pool.unpin_blocks) == ["blocks", "on_reuse"]
    assert params(pool.get_new_blocks) == ["num_blocks"]
    assert params(pool.touch) == ["blocks"]
    assert params(pool.free_blocks) == ["ordered_blocks"]
    assert isinstance(pool._reuse_watchers, dict)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    blocks = pool.get_new_blocks(3)
    fired = []
    pool.unpin_blocks(blocks[:1], fired.append)
    assert blocks[0].ref_cnt == 0 and pool.get_num_free_blocks() == 1
    pool.get_new_blocks(1)
    assert fired == [blocks[0]]


def test_full_attention_manager_internals():
    manager_cls = compat.FullAttentionManager
    assert params(manager_cls.pop_blocks_for_free) == ["self", "request_id"]
    init = params(manager_cls.__init__)
    for name in ("kv_cache_spec", "block_pool", "enable_caching", "kv_cache_group_id"):
        assert name in init
    source = inspect.getsource(compat.FullAttentionManager.__mro__[1].__init__)
    for attr in ("self.req_to_blocks", "self.num_cached_block", "self._partial_hit_reqs", "self._null_block"):
        assert attr in source, attr


def test_manager_registry_by_role():
    registry = compat.KVCacheSpecRegistry
    assert params(registry.register_role_manager) == ["role", "manager_class"]
    assert params(registry.get_manager_class) == ["kvcache_spec", "role"]
    assert callable(registry._ensure_registered)
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    assert "role" in {f.name for f in dataclasses.fields(KVCacheGroupSpec)}
    from vllm.v1.core.single_type_kv_cache_manager import get_manager_for_kv_cache_spec

    assert "role" in params(get_manager_for_kv_cache_spec)
    # The coordinator passes the group's role to the manager factory.
    from vllm.v1.core import kv_cache_coordinator

    assert "role=kv_cache_group.role" in inspect.getsource(kv_cache_coordinator)


def test_scheduler_builds_connector_before_kv_cache_manager():
    """Our connector assigns the sparse groups' role in its constructor; that only
    works because the scheduler builds the connector first, with the same config."""
    scheduler_cls, _ = compat.scheduler_classes()
    source = inspect.getsource(scheduler_cls.__init__)
    connector_at = source.index("KVConnectorFactory.create_connector(")
    manager_at = source.index("self.kv_cache_manager = KVCacheManager(")
    bind_at = source.index("self.connector.bind_kv_cache_manager(self.kv_cache_manager)")
    assert connector_at < manager_at < bind_at
    assert "kv_cache_config=self.kv_cache_config" in source[connector_at:manager_at]
    assert "kv_cache_config=kv_cache_config" in source[manager_at:bind_at]
    assert "has_pending_block_frees()" in inspect.getsource(scheduler_cls.schedule)


def test_kv_cache_manager_exposes_coordinator_managers():
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    source = inspect.getsource(KVCacheManager.__init__)
    assert "self.coordinator = " in source and "self.block_pool" in inspect.getsource(KVCacheManager)
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    assert "self.single_type_managers = tuple(" in inspect.getsource(KVCacheCoordinator.__init__)


def test_prefix_cache_geometry_and_load_failure_policy():
    from vllm.config import KVTransferConfig
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    assert "self.enable_caching = enable_caching" in inspect.getsource(KVCacheManager.__init__)
    assert "self.hash_block_size = hash_block_size" in inspect.getsource(BlockPool.__init__)
    field = KVTransferConfig.__dataclass_fields__["kv_load_failure_policy"]
    assert field.default == "fail"
    manager = types.SimpleNamespace(enable_caching=True,
                                    block_pool=types.SimpleNamespace(hash_block_size=64))
    assert compat.prefix_cache_geometry(manager) == (True, 64)


def test_admission_watermark_gates_waiting_requests_only():
    """The admission gate sets ``KVCacheManager.watermark_blocks`` before each waiting
    request's allocation: vLLM must read it per ``allocate_slots`` call, add it for WAITING
    and PREEMPTED requests only, and only while a request runs; a failed allocation of a
    waiting request must end the admission pass (``break``)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    assert "self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)" in \
        inspect.getsource(KVCacheManager.__init__)
    source = inspect.getsource(KVCacheManager.allocate_slots)
    assert "if has_scheduled_reqs and request.status in (" in source
    assert "RequestStatus.WAITING," in source and "RequestStatus.PREEMPTED," in source
    assert "watermark_blocks = self.watermark_blocks" in source
    assert source.count("required_blocks = num_blocks_to_allocate + watermark_blocks") == 2
    schedule = inspect.getsource(Scheduler.schedule)
    assert "has_scheduled_reqs=bool(self.running)," in schedule
    failed = schedule.index("if new_blocks is None:\n                    # The request cannot be scheduled.")
    assert "break" in schedule[failed:failed + 400]
    manager = types.SimpleNamespace(watermark_blocks=3)
    assert compat.admission_watermark_blocks(manager) == 3
    compat.set_admission_watermark_blocks(manager, 17)
    assert manager.watermark_blocks == 17


def test_lockstep_coordinator_internals():
    """What ``lockstep.py`` overrides and reads: the four per-step methods keep their
    signatures, the managers' fast paths are the ones it answers for."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    from vllm_hisparse.vllm.patches.lockstep import LockstepCoordinator

    hybrid = compat.hybrid_coordinator_class()
    assert issubclass(hybrid, KVCacheCoordinator)
    for name in ("get_num_blocks_to_allocate", "allocate_new_blocks", "cache_blocks",
                 "remove_skipped_blocks"):
        assert params(getattr(LockstepCoordinator, name)) == params(getattr(hybrid, name)), name
    init = inspect.getsource(KVCacheCoordinator.__init__)
    for needle in ("self.single_type_managers = tuple(", "self.drop_eagle_group_ids",
                   "self.retention_interval"):
        assert needle in init
    hybrid_init = inspect.getsource(hybrid.__init__)
    assert "self.hash_block_size = hash_block_size" in hybrid_init
    assert "self.enable_partial_hash_hits = (" in hybrid_init
    full = compat.FullAttentionManager
    # The managers' own answers the lockstep fast paths reproduce.
    assert "if request_id in self.num_cached_block:" in inspect.getsource(full.get_num_blocks_to_allocate)
    assert "return max(num_required_blocks - num_req_blocks, 0)" in \
        inspect.getsource(full.get_num_blocks_to_allocate)
    assert "if num_cached_blocks >= num_full_blocks:" in inspect.getsource(full.__mro__[1].cache_blocks)
    assert "if num_skipped_tokens <= 0:" in inspect.getsource(full.remove_skipped_blocks)
    assert "if num_new_blocks <= 0:" in inspect.getsource(full.allocate_new_blocks)


def test_num_allocated_pages_reads_the_first_groups_blocks():
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    assert "blocks" in {f.name for f in dataclasses.fields(KVCacheBlocks)}
    blocks = KVCacheBlocks(blocks=([object()] * 3, [object()] * 3))
    assert compat.num_allocated_pages(blocks) == 3
    assert compat.num_allocated_pages(None) == 0


def test_multi_connector_types_and_connector_output():
    multi, multi_meta, multi_worker_meta = compat.multi_connector_types()
    assert {f.name for f in dataclasses.fields(multi_meta)} >= {"metadata"}
    assert {f.name for f in dataclasses.fields(multi_worker_meta)} == {"metadata"}
    assert "kv_connector_worker_meta" in {f.name for f in dataclasses.fields(compat.KVConnectorOutput)}
    assert params(multi.build_kv_connector_stats) == ["data"]


def test_simulator_internals_exist():
    """Every vLLM name the simulator drives resolves (compat imports them at module load)."""
    from vllm_hisparse.vllm import compat

    assert all(obj is not None for obj in compat.SIMULATOR_INTERNALS)
    assert callable(compat.get_kv_cache_configs) and callable(compat.init_none_hash)
    import inspect
    assert "block_size" in inspect.signature(compat.get_request_block_hasher).parameters or \
        len(inspect.signature(compat.get_request_block_hasher).parameters) >= 1
    # simulate --tensor-parallel-size: the ranks' outputs folded as vLLM's executor does.
    assert list(inspect.signature(compat.KVOutputAggregator.from_connector).parameters) == \
        ["connector", "world_size"]
    assert list(inspect.signature(compat.KVOutputAggregator.aggregate).parameters) == \
        ["self", "outputs", "output_rank"]


def test_parallel_layout_accessors(dsa_model_dir):
    """What the host-pool sharing decision reads (vllm/setup/host_sharing.py)."""
    import copy
    import pickle

    from vllm.config import ParallelConfig
    from vllm.distributed import parallel_state
    from vllm.v1.worker import gpu_worker, worker_base

    from vllm_hisparse.vllm.simulation.model import make_vllm_config

    assert {"data_parallel_rank", "distributed_executor_backend", "nnodes", "rank",
            "tensor_parallel_size"} <= set(ParallelConfig.__dataclass_fields__)
    assert isinstance(ParallelConfig.nnodes_within_dp, property)
    config = make_vllm_config(dsa_model_dir)
    # The instance id is set when the config is built and survives the pickling that ships
    # the config to the engine core and to every worker: all ranks derive the same name.
    assert compat.instance_id(config)
    assert compat.instance_id(pickle.loads(pickle.dumps(config))) == compat.instance_id(config)
    assert compat.instance_id(copy.deepcopy(config)) == compat.instance_id(config)
    assert compat.data_parallel_rank(config) == 0
    assert compat.nodes_per_replica(config) == 1
    assert compat.executor_backend_name(config) in ("uni", "mp", None)
    tp2 = ParallelConfig(tensor_parallel_size=2)
    assert tp2.distributed_executor_backend == "mp"  # single node, world size 2
    # Without vLLM's TP group the rank comes from ParallelConfig.rank, set per worker by
    # WorkerBase; the worker builds the TP group before the connector binds KV caches.
    assert not parallel_state.model_parallel_is_initialized()
    assert params(parallel_state.get_tensor_model_parallel_rank) == []
    assert "self.parallel_config.rank = rank" in inspect.getsource(worker_base.WorkerBase.__init__)
    assert compat.tensor_parallel_rank(config) == 0
    config.parallel_config.rank = 3
    config.parallel_config.tensor_parallel_size = 2
    assert compat.tensor_parallel_rank(config) == 1
    source = inspect.getsource(gpu_worker.Worker)
    assert source.index("init_worker_distributed_environment(") < source.index(
        "ensure_kv_transfer_initialized(")


def test_config_time_accessors(dsa_model_dir):
    """What the checks at VllmConfig time read (vllm/setup/engine_checks.py)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    from vllm_hisparse.vllm.simulation.model import make_vllm_config

    config = make_vllm_config(dsa_model_dir)  # block_size=64 given
    assert compat.user_specified_block_size(config)
    assert "user_specified_block_size" in CacheConfig.__dataclass_fields__
    assert not compat.is_submodel_config(config)
    assert "is_submodel_config" in ModelConfig.__dataclass_fields__
    assert isinstance(compat.platform_supports_hybrid_kv_cache(), bool)
    assert callable(VllmConfig._get_v2_model_runner_unsupported_features)
    assert compat.v2_model_runner_unsupported_features(config) == []


def test_offloading_interop_fields():
    """The public fields OffloadingConnector keys on, and what vLLM does with them
    (``compat.scope_offloading``, ``offloading_scope.py``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config as offloading_config
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    assert compat.OFFLOADED_GROUP_ROLE.value == "hisparse_indexer"
    assert {f.name for f in dataclasses.fields(KVCacheConfig)} >= {"hisparse_host_num_blocks"}
    assert {f.name for f in dataclasses.fields(KVCacheGroupSpec)} >= {"role"}
    source = inspect.getsource(offloading_config.get_offloading_group_ids)
    assert "hisparse_host_num_blocks" in source and "HISPARSE_INDEXER" in source
    assert "defer_async_loads" in inspect.getsource(Scheduler.__init__)
    # retains_longer_hit is read per manager when the KVCacheManager is built.
    assert "retains_longer_hit" in inspect.getsource(KVCacheManager.__init__)
    assert compat.FullAttentionManager.retains_longer_hit is False


def test_prefix_hit_and_request_accessors():
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.request import RequestStatus

    assert params(HybridKVCacheCoordinator.find_longest_cache_hit_per_group) == [
        "self", "block_hashes", "max_cache_hit_length"]
    assert isinstance(compat.KVCacheBlock.block_hash, property)
    assert compat.block_is_cached(compat.KVCacheBlock(block_id=1)) is False
    assert RequestStatus.WAITING_FOR_REMOTE_KVS
    assert compat.is_waiting_for_remote_kvs(types.SimpleNamespace(status=RequestStatus.WAITING_FOR_REMOTE_KVS))
    assert not compat.is_waiting_for_remote_kvs(types.SimpleNamespace(status=RequestStatus.WAITING))

def test_p_d_decode_consumer_internals(dsa_model_dir):
    """What the P/D host landing relies on (kv_import.py, nixl_transport.py)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_scheduler

    from vllm_hisparse.vllm.simulation.model import make_vllm_config

    get_meta, payload_type, meta_type, compute_hash = compat.nixl_handshake_types()
    assert get_meta == b"get_meta_msg"
    assert {"compatibility_hash", "agent_metadata_bytes"} <= {f.name for f in dataclasses.fields(payload_type)}
    assert {"engine_id", "agent_metadata", "kv_caches_base_addr", "block_lens", "block_strides",
            "block_size", "region_names", "region_group_ids", "region_mem_types", "region_members",
            "packed_member_layouts", "attn_backend_name"} <= {f.name for f in dataclasses.fields(meta_type)}
    assert params(compute_hash)[:2] == ["vllm_config", "attn_backend_name"]
    for name in compat.NIXL_PULL_CONNECTORS:
        assert compat.connector_is_registered(name), name
    # The fields a stock prefill puts in kv_transfer_params, and the notification it waits for.
    source = inspect.getsource(pull_scheduler)
    for field in ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                  "remote_port", "tp_size", "remote_registration_generation"):
        assert field in source, field
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import pull_worker

    assert 'f"{remote_request_id}:{expected_consumers}"' in inspect.getsource(pull_worker)
    # A child sees only its own entry: MultiConnector.__init__ builds its config.
    init = inspect.getsource(MultiConnector.__init__)
    assert "self._get_connector_classes_and_configs(" in init and "vllm_config" in params(MultiConnector.__init__)
    config = make_vllm_config(dsa_model_dir, kv_transfer=KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_consumer", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}]}))
    assert compat.composing_kv_transfer_config(config) is config.kv_transfer_config  # nothing on the stack
    assert compat.kv_load_failure_policy(config) == "recompute"
    assert compat.prefill_backoff_tokens(config) == 0
    assert "num_prefill_lookahead_tokens" in dir(type(config))
