"""Every access this package makes to a vLLM 0.33 internal, in one place.

vLLM's connector API is public, but planning, scheduling and the factory registry are
internal and move between releases. Each internal is reached through one small named
function or constant below, so an upgrade touches one file and
``tests/vllm/test_compat.py`` / ``tests/vllm/test_compat_worker.py`` (which check every name
and signature relied on here) say exactly what moved.

Only accessors live here. The runtime patches this package applies to vLLM (each replacing
one vLLM attribute) are in ``vllm_hisparse/vllm/patches/``, one table (``patches.PATCHES``)
with install / installed / remove for each; the other writes to vLLM objects made through
this module are listed in docs/vllm-integration.md, "Other changes to vLLM's objects".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# Public-ish building blocks (stable since the V1 connector API landed).
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, KVConnectorTransferResults,
                                                              KVConnectorWorkerMetadata, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# Internal: KV-cache planning (engine core and, for profiling, the workers).
from vllm.platforms.interface import Platform
from vllm.v1.core.kv_cache_config_builder import KVCacheConfigBuilder
from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (AttentionSpec, HiddenStateCacheSpec, KVCacheConfig, KVCacheGroupRole,
                                        KVCacheGroupSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                        SparseCacheRole, UniformTypeKVCacheSpecs)
from vllm.v1.kv_cache_layout import KVCacheLayout

# Internal: the scheduler-side KV cache manager, its block pool and manager registry.
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

__all__ = ["AttentionSpec", "BlockPool", "CUDAGraphMode", "DEFAULT_BUILDER_QUALNAME",
           "DefaultKVCacheConfigBuilder", "FullAttentionManager", "HiddenStateCacheSpec",
           "KVCacheBlock", "KVCacheConfig", "KVCacheConfigBuilder", "KVCacheGroupSpec",
           "KVCacheLayout", "KVCacheSpec", "KVCacheSpecRegistry", "KVConnectorBase_V1",
           "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorPromMetrics", "KVConnectorRole", "KVConnectorStats",
           "KVConnectorTransferResults", "KVConnectorWorkerMetadata", "MAX_CONCURRENCY_MODULE",
           "MAX_CONCURRENCY_NAME", "MLAAttentionSpec", "OFFLOADED_GROUP_ROLE", "Platform",
           "RESIDENCY_GROUP_ROLE", "SlidingWindowMLASpec", "SparseCacheRole", "SupportsHMA",
           "UniformTypeKVCacheSpecs", "VllmConfig", "admission_watermark_blocks",
           "assign_group_role", "block_is_cached", "composing_kv_transfer_config",
           "connector_is_registered", "default_kv_cache_groups", "group_managers",
           "hybrid_coordinator_class", "is_waiting_for_remote_kvs", "kv_cache_coordinator",
           "kv_load_failure_policy", "multi_connector_types", "num_allocated_pages",
           "offloading_group_ids", "per_group_prefix_hits", "prefix_cache_geometry",
           "register_connector", "register_residency_manager", "residency_manager_registered",
           "resolve_connector_class", "resolve_kv_cache_config_builder", "resolved_kv_cache_layout",
           "scheduler_classes", "scope_offloading", "set_admission_watermark_blocks"]

#: What ``Platform.get_kv_cache_config_builder_cls`` returns in vLLM 0.33 for every
#: in-tree platform. Our builder subclasses this one, so we only take over when the
#: platform would have used it; a vendor builder is never silently replaced.
DEFAULT_BUILDER_QUALNAME = "vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder"

# --------------------------------------------------------------------------------------
# Connector factory
# --------------------------------------------------------------------------------------


def connector_is_registered(name: str) -> bool:
    """Whether ``KVConnectorFactory`` already maps ``name`` to a loader.

    ``register_connector`` raises on a duplicate name, and the registry has no public
    query, so idempotent registration has to look at the private dict.
    """
    return name in KVConnectorFactory._registry


def register_connector(name: str, module_path: str, class_name: str) -> bool:
    """Register a lazily imported connector class; return False if already there."""
    if connector_is_registered(name):
        return False
    KVConnectorFactory.register_connector(name, module_path, class_name)
    return True


def resolve_connector_class(name: str) -> type:
    """The class the factory builds for ``kv_connector: name`` (imports it)."""
    return KVConnectorFactory.get_connector_class_by_name(name)


# --------------------------------------------------------------------------------------
# KV-cache planning
# --------------------------------------------------------------------------------------


def default_kv_cache_groups(
    vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
) -> list[KVCacheGroupSpec]:
    """vLLM's own grouping, for the layers our split does not own (e.g. draft layers)."""
    return get_kv_cache_groups(vllm_config, kv_cache_spec)


def resolved_kv_cache_layout(vllm_config: VllmConfig) -> KVCacheLayout:
    """The engine's resolved physical KV layout (raises if not resolved yet)."""
    return vllm_config.cache_config.get_resolved_kv_cache_layout()


def resolve_kv_cache_config_builder(vllm_config: VllmConfig) -> KVCacheConfigBuilder:
    """The builder instance vLLM would plan with for ``vllm_config`` (as core does)."""
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder

    return get_kv_cache_config_builder(vllm_config)


# --------------------------------------------------------------------------------------
# Scheduler (the connector's scheduler role and the CPU test harness drive these)
# --------------------------------------------------------------------------------------


def scheduler_classes() -> tuple[type[Scheduler], type[Scheduler]]:
    """``(Scheduler, AsyncScheduler)`` from ``vllm.v1.core.sched``.

    Imported lazily: the scheduler pulls in the structured-output stack, which the
    planner and the plugin never need.
    """
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler, AsyncScheduler


# --------------------------------------------------------------------------------------
# Residency-aware managers for the sparse-MLA groups
# --------------------------------------------------------------------------------------

#: Group role that selects our manager for a sparse-MLA group. vLLM resolves a group's
#: manager as ``KVCacheSpecRegistry.get_manager_class(spec, group.role)`` and a
#: role-registered manager wins (``kv_cache_spec_registry.py``); the role is looked up
#: as a plain ``dict`` key, so a string outside vLLM's ``KVCacheGroupRole`` enum works
#: and cannot collide with an in-tree role.
RESIDENCY_GROUP_ROLE = "vllm_hisparse_residency"


def residency_manager_registered() -> bool:
    """Whether ``RESIDENCY_GROUP_ROLE`` is mapped to a manager class."""
    from vllm.v1.kv_cache_spec_registry import _REGISTRY_ROLE_MANAGERS

    return RESIDENCY_GROUP_ROLE in _REGISTRY_ROLE_MANAGERS


#: ``KVCacheGroupSpec.role`` of the groups vLLM's ``OffloadingConnector`` offloads once
#: ``KVCacheConfig.hisparse_host_num_blocks`` is set (``offloading/config.py:39``,
#: ``get_offloading_group_ids``); no manager is registered for it in vLLM 0.33.
OFFLOADED_GROUP_ROLE = KVCacheGroupRole.HISPARSE_INDEXER


def register_residency_manager(manager_cls: type) -> None:
    """Map ``RESIDENCY_GROUP_ROLE`` and ``OFFLOADED_GROUP_ROLE`` to ``manager_cls``
    (idempotent; one manager class on every full-attention group, see ``managers.py``).

    Inert on its own: only a group whose ``role`` is one of those uses it, and only this
    package sets them (:func:`assign_group_role`, :func:`scope_offloading`).
    vLLM's built-in registrations run lazily on first lookup; we trigger them first so
    that ours never counts as "the registry is already populated".
    """
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register_role_manager(RESIDENCY_GROUP_ROLE, manager_cls)
    KVCacheSpecRegistry.register_role_manager(OFFLOADED_GROUP_ROLE, manager_cls)


def scope_offloading(kv_cache_config: KVCacheConfig, group_ids: tuple[int, ...],
                     host_num_blocks: int) -> None:
    """Make vLLM's ``OffloadingConnector`` offload exactly ``group_ids``.

    Public ``KVCacheConfig`` / ``KVCacheGroupSpec`` fields that vLLM 0.33's other
    connectors key on (reference map §3.5): with ``hisparse_host_num_blocks`` set,
    ``get_offloading_group_ids`` returns the groups whose role is
    ``HISPARSE_INDEXER`` (instead of every prefix-cacheable group), and the offloading
    worker registers those groups layer by layer. The same field makes vLLM's scheduler
    defer a consumer connector's async load into a reused block until in-flight steps
    are processed (``Scheduler.defer_async_loads``). Nothing else in vLLM reads them for
    a config without ``host_resident`` groups.
    """
    for group_id in group_ids:
        kv_cache_config.kv_cache_groups[group_id].role = OFFLOADED_GROUP_ROLE
    kv_cache_config.hisparse_host_num_blocks = int(host_num_blocks)


def offloading_group_ids(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """The groups vLLM's ``OffloadingConnector`` offloads for this config."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids,
    )

    return tuple(get_offloading_group_ids(kv_cache_config))


def per_group_prefix_hits(kv_cache_manager: Any, block_hashes: Any, max_tokens: int) -> tuple[int, ...]:
    """Each KV cache group's own device prefix-cache hit, in tokens, evaluated group by
    group (``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``, the lookup
    vLLM's ``OffloadingConnector`` bounds its loads with)."""
    _, hits = kv_cache_manager.coordinator.find_longest_cache_hit_per_group(block_hashes, max_tokens)
    return tuple(int(h) for h in hits)


#: Module and function behind vLLM's "Maximum concurrency for N tokens per request" line:
#: ``update_kv_cache_capacity`` (engine core, ``v1/engine/core.py``) calls
#: ``get_kv_cache_capacity``, which calls this function by its module-global name with the
#: scheduler's KV cache config, before the scheduler (and our connector) exists.
MAX_CONCURRENCY_MODULE = "vllm.v1.core.kv_cache_utils"
MAX_CONCURRENCY_NAME = "get_max_concurrency_for_kv_cache_config"


def block_is_cached(block: KVCacheBlock) -> bool:
    """Whether a block holds a prefix-cached page (vLLM's ``block_hash`` is set)."""
    return block.block_hash is not None


def is_waiting_for_remote_kvs(request: Any) -> bool:
    """Whether vLLM parked the request for a connector load (``WAITING_FOR_REMOTE_KVS``)."""
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def assign_group_role(kv_cache_config: KVCacheConfig, group_ids: tuple[int, ...]) -> None:
    """Mark the sparse-MLA groups of the scheduler's KV cache config for our manager.

    Must run before ``KVCacheManager`` is built. The scheduler-role connector is
    constructed inside ``Scheduler.__init__`` with the very ``kv_cache_config`` object
    that the scheduler passes to ``KVCacheManager`` right after (``scheduler.py``), so
    the connector's constructor is the place. The role field is a public dataclass field
    (``KVCacheGroupSpec.role``); nothing else in the scheduler reads it.
    """
    for group_id in group_ids:
        kv_cache_config.kv_cache_groups[group_id].role = RESIDENCY_GROUP_ROLE  # type: ignore[assignment]


def group_managers(kv_cache_manager: Any, group_ids: tuple[int, ...]) -> list[Any]:
    """The single-type managers of ``group_ids`` inside a ``KVCacheManager``."""
    managers = kv_cache_manager.coordinator.single_type_managers
    return [managers[i] for i in group_ids]


def kv_cache_coordinator(kv_cache_manager: Any) -> Any:
    """``KVCacheManager.coordinator``: the object that runs the per-group manager calls."""
    return kv_cache_manager.coordinator


def hybrid_coordinator_class() -> type:
    """``vllm.v1.core.kv_cache_coordinator.HybridKVCacheCoordinator``: the coordinator vLLM
    builds for several KV cache groups with prefix caching on (``get_kv_cache_coordinator``)."""
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    return HybridKVCacheCoordinator


def prefix_cache_geometry(kv_cache_manager: Any) -> tuple[bool, int]:
    """``(enable_caching, hash_block_size)`` of a ``KVCacheManager``: whether requests'
    ``block_hashes`` are maintained, and how many tokens one hash covers."""
    return bool(kv_cache_manager.enable_caching), int(kv_cache_manager.block_pool.hash_block_size)


def admission_watermark_blocks(kv_cache_manager: Any) -> int:
    """``KVCacheManager.watermark_blocks``: free blocks that the allocation of a WAITING or
    PREEMPTED request must leave over, while any request runs (``allocate_slots``:
    ``v1/core/kv_cache_manager.py:518-547,583``; from ``SchedulerConfig.watermark``)."""
    return int(kv_cache_manager.watermark_blocks)


def set_admission_watermark_blocks(kv_cache_manager: Any, num_blocks: int) -> None:
    """Set the watermark :func:`admission_watermark_blocks` reads. vLLM reads it at each
    ``allocate_slots`` call, so a value set before a waiting request's allocation (in
    ``get_num_new_matched_tokens``) gates exactly that admission; a failed allocation makes
    the scheduler stop admitting for the step, as when the pool is full."""
    kv_cache_manager.watermark_blocks = int(num_blocks)


def num_allocated_pages(blocks: Any) -> int:
    """Pages a request holds in its first KV cache group: ``KVCacheBlocks.blocks[0]`` of the
    blocks vLLM hands ``update_state_after_alloc`` (prefix hits included)."""
    return len(blocks.blocks[0]) if blocks is not None and blocks.blocks else 0


def kv_load_failure_policy(vllm_config: VllmConfig) -> str:
    """``kv_load_failure_policy`` the engine applies: ``"fail"`` (vLLM fails a request
    whose connector load failed) or ``"recompute"`` (vLLM rewinds its computed tokens).
    Under MultiConnector it is the top-level setting (the scheduler reads that one), not
    the child's copy (:func:`composing_kv_transfer_config`)."""
    kv = composing_kv_transfer_config(vllm_config)
    return str(getattr(kv, "kv_load_failure_policy", "fail")) if kv is not None else "fail"


def composing_kv_transfer_config(vllm_config: VllmConfig) -> Any:
    """The ``kv_transfer_config`` of the MultiConnector that is constructing this
    connector, else ``vllm_config``'s own.

    vLLM's ``MultiConnector.__init__`` builds each child with a copy of the config whose
    ``kv_transfer_config`` is the child's entry only (``multi_connector.py:184,245``), so
    a child cannot see its siblings, their order or the top-level settings. A child
    constructed by a MultiConnector has that ``__init__`` frame on the stack, with the
    whole config as its ``vllm_config`` argument; called from a connector's constructor,
    this finds it (the innermost one, for nested MultiConnectors)."""
    import inspect

    multi_connector = multi_connector_types()[0]
    frame = inspect.currentframe()
    try:
        caller = frame.f_back if frame is not None else None
        while caller is not None:
            if caller.f_code.co_name == "__init__" and isinstance(caller.f_locals.get("self"), multi_connector):
                parent = caller.f_locals.get("vllm_config")
                if parent is not None and parent.kv_transfer_config is not None:
                    return parent.kv_transfer_config
            caller = caller.f_back
    finally:
        del frame
    return vllm_config.kv_transfer_config


def multi_connector_types() -> tuple[type, type, type]:
    """``(MultiConnector, MultiKVConnectorMetadata, MultiKVConnectorWorkerMetadata)``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorMetadata,
        MultiKVConnectorWorkerMetadata,
    )

    return MultiConnector, MultiKVConnectorMetadata, MultiKVConnectorWorkerMetadata


# ======================================================================================
# Worker side: KV allocation, forward context and the sparse-MLA index group
# (used by the worker role: worker_side/role.py, worker_side/read_path.py, patches/;
#  existence checks in tests/vllm/test_compat_worker.py)
# ======================================================================================


def sparse_mla_index_group_class() -> type:
    """``vllm.v1.attention.backends.mla.index_group.SparseMLAIndexGroup``: the object every
    sparse-MLA layer of one indexer shares (``index_group.py:36``); its
    ``convert_logical_to_physical_topk`` (``:95``) is where decode batches turn logical
    top-k into physical KV rows (patched: ``patches.TOPK_CONVERSION_HOOK``).
    ``HiSparseMLAIndexGroup`` (vLLM's in-tree HiSparse) overrides the method, so the
    patch never runs for it."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    return SparseMLAIndexGroup


def indexer_topk_class() -> type:
    """``vllm.model_executor.layers.indexer_topk.SparseIndexerTopk``: the DSA indexer's decode
    top-k (``forward(logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)``,
    ``indexer_topk.py``), the last place the decode logits and their top-k meet (patched:
    ``patches.INDEXER_SCORES``). Its ``"torch"`` backend runs anywhere (the simulator's)."""
    from vllm.model_executor.layers.indexer_topk import SparseIndexerTopk

    return SparseIndexerTopk


def in_tree_hisparse_index_group_class() -> type:
    """vLLM's in-tree ``HiSparseMLAIndexGroup`` (we refuse to bind to one)."""
    from vllm.v1.attention.backends.mla.index_group import HiSparseMLAIndexGroup

    return HiSparseMLAIndexGroup


def static_forward_context(vllm_config: VllmConfig) -> dict[str, Any]:
    """Layer name → attention module of the constructed model (``config/compilation.py:757``);
    empty before the model is built (CPU tests)."""
    return vllm_config.compilation_config.static_forward_context


def layer_index_group(layer: Any) -> tuple[Any, int] | None:
    """``(index_group, index_in_group)`` of a sparse-MLA attention module, or None.

    ``MLAAttention.impl`` (``mla_attention.py:598``) is a ``SparseMLACommonImpl`` whose
    ``index_group`` / ``index_group_index`` are set at construction
    (``sparse_mla_attention.py:682-694``)."""
    impl = getattr(layer, "impl", None)
    group = getattr(impl, "index_group", None)
    if group is None:
        return None
    return group, int(impl.index_group_index)


def allocate_kv_cache(kv_cache_config: KVCacheConfig, device: Any, layout: KVCacheLayout,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
    """vLLM's own worker KV allocation (``v1/worker/utils.py:564``): one backing, one
    ``[B, H, N, C]`` view per layer at ``offset + l * layer_stride + b * block_stride``.
    The worker role reads these views; tests use this to build them on CPU."""
    from vllm.v1.worker.utils import allocate_kv_cache as _allocate

    return _allocate(kv_cache_config, device, layout, kernel_block_sizes)


def set_request_max_tokens(request: Any, max_tokens: int) -> None:
    """Make a running vLLM ``Request`` stop after ``max_tokens`` output tokens (the length
    ``check_stop`` compares ``num_output_tokens`` with; ``bench throughput`` sets when each
    cohort of its batch leaves)."""
    request.max_tokens = max_tokens


def scheduled_token_counts(scheduler_output: Any) -> dict[str, int]:
    """``SchedulerOutput.num_scheduled_tokens`` (request id → tokens this step)."""
    return dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})


# ======================================================================================
# Worker side (2): sparse-MLA backends' direct logical->physical conversions and the
# per-step attention metadata.
# (used by the worker role: worker_side/role.py, worker_side/read_path.py, patches/;
#  existence and signature checks in tests/vllm/test_compat_worker.py)
# ======================================================================================

#: Modules whose forward paths call ``sparse_utils.triton_convert_req_index_to_global_index``
#: through their own module-global name with vLLM's **batch** block table (bypassing the index
#: group), and the methods that do (vLLM 0.33.0 line numbers):
#:
#: * FlashMLA sparse: ``_forward_bf16_kv`` (mixed / prefill bf16 batches, ``:914``),
#:   ``_forward_fp8_kv_separate_prefill_decode`` (batches with prefill tokens, prefill tokens
#:   mapped to the upconvert workspace, ``:1047``), ``_forward_fp8_kv_mixed_batch`` (mixed
#:   fp8 batches, ``:1250``); ``_gather_prefill_chunk`` (``:955``) is PCP+DCP only;
#: * the generic ``SparseMLACommonImpl.forward_mqa`` (FlashInfer sparse, FlashAttention sparse)
#:   when ``group_conversion_decode_only`` and the batch is not a multi-layer decode batch
#:   (``sparse_mla_attention.py:773``);
#: * FlashInfer sparse SM120 ``forward_mqa`` (``flashinfer_mla_sparse_sm120.py:194``) and
#:   SM90 ``forward_mqa`` (``flashinfer_mla_sparse_sm90.py:618``), every batch.
#:
#: ``patches.DIRECT_CONVERSION_ROUTING`` replaces that module-global name in each of them
#: (``index_group.py``'s own name, used by the group method, is left alone: the group method
#: has its own patch). ROCm / XPU sparse backends are not covered.
DIRECT_CONVERSION_SITES: dict[str, tuple[str, ...]] = {
    "vllm.v1.attention.backends.mla.flashmla_sparse": (
        "FlashMLASparseImpl._forward_bf16_kv",
        "FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode",
        "FlashMLASparseImpl._forward_fp8_kv_mixed_batch",
    ),
    "vllm.model_executor.layers.attention.sparse_mla_attention": (
        "SparseMLACommonImpl.forward_mqa",
    ),
    "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120": (
        "FlashInferMLASparseSM120Impl.forward_mqa",
    ),
    "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90": (
        "FlashInferMLASparseSM90Impl.forward_mqa",
    ),
}

#: The name the sites call (defined in ``vllm.v1.attention.backends.mla.sparse_utils``).
DIRECT_CONVERSION_NAME = "triton_convert_req_index_to_global_index"

#: vLLM's null KV block id (``BlockPool`` block 0): what a block table names for a page
#: that has no device block.
NULL_BLOCK_ID = 0


def direct_conversion_function() -> Callable[..., Any]:
    """vLLM's ``triton_convert_req_index_to_global_index`` (``sparse_utils.py:493``)."""
    from vllm.v1.attention.backends.mla import sparse_utils

    return getattr(sparse_utils, DIRECT_CONVERSION_NAME)


def forward_context_attn_metadata() -> Any:
    """``get_forward_context().attn_metadata`` (layer name -> metadata; a list of such
    dicts under micro-batching) when a forward context is set, else None. In eager and
    piecewise steps ``start_load_kv`` runs inside the step's forward context
    (``v1/worker/gpu/model_runner.py:2068``); FULL-graph steps pass ``attn_metadata`` to it."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return getattr(get_forward_context(), "attn_metadata", None)


# --------------------------------------------------------------------------------------
# Parallel layout: whether the tensor-parallel ranks of a replica can share one host pool
# (vllm_hisparse/vllm/setup/host_sharing.py). Checked by
# tests/vllm/test_compat.py::test_parallel_layout_accessors.
# --------------------------------------------------------------------------------------


def instance_id(vllm_config: VllmConfig) -> str:
    """``VllmConfig.instance_id``: set when the config is built (``config/vllm.py``
    ``__post_init__``) and shipped, pickled, to the engine core and every worker of it."""
    return str(vllm_config.instance_id or "")


def data_parallel_rank(vllm_config: VllmConfig) -> int:
    """``ParallelConfig.data_parallel_rank``: this engine's data-parallel replica."""
    return int(vllm_config.parallel_config.data_parallel_rank)


def executor_backend_name(vllm_config: VllmConfig) -> str | None:
    """``ParallelConfig.distributed_executor_backend`` as a name (``"mp"``, ``"ray"``,
    ``"uni"``, ``"external_launcher"``; an executor class gives its class name)."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend is None or isinstance(backend, str):
        return backend
    return getattr(backend, "__name__", str(backend))


def nodes_per_replica(vllm_config: VllmConfig) -> int:
    """``ParallelConfig.nnodes_within_dp``: nodes one data-parallel replica spans."""
    return int(vllm_config.parallel_config.nnodes_within_dp)


def tensor_parallel_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank in its tensor-parallel group: vLLM's TP group once it exists (the
    worker initialises it before the connector binds the KV caches), else
    ``ParallelConfig.rank`` (set per worker by ``WorkerBase``) modulo the TP size."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    pc = vllm_config.parallel_config
    return int(pc.rank) % max(1, int(pc.tensor_parallel_size))


# --------------------------------------------------------------------------------------
# Config time (vllm_hisparse/vllm/setup/engine_checks.py). Checked by
# tests/vllm/test_compat.py::test_config_time_accessors.
# --------------------------------------------------------------------------------------


def is_submodel_config(vllm_config: VllmConfig) -> bool:
    """``ModelConfig.is_submodel_config``: a view of a validated config that
    ``VllmConfig.__post_init__`` skips."""
    return bool(getattr(vllm_config.model_config, "is_submodel_config", False))


def user_specified_block_size(vllm_config: VllmConfig) -> bool:
    """``CacheConfig.user_specified_block_size``; otherwise the engine process picks the block
    size with the attention backends (``Platform.update_block_size_for_backend``)."""
    return bool(getattr(vllm_config.cache_config, "user_specified_block_size", False))


def platform_supports_hybrid_kv_cache() -> bool:
    """``current_platform.support_hybrid_kv_cache()`` (False: vLLM always turns it off)."""
    from vllm.platforms import current_platform

    return bool(current_platform.support_hybrid_kv_cache())


def v2_model_runner_unsupported_features(vllm_config: VllmConfig) -> list[str]:
    """Why vLLM falls back to the V1 model runner
    (``VllmConfig._get_v2_model_runner_unsupported_features``); [] when it does not say."""
    method = getattr(vllm_config, "_get_v2_model_runner_unsupported_features", None)
    try:
        return [str(feature) for feature in method()] if callable(method) else []
    except Exception:  # a diagnostic only: never hide the real error behind this one
        return []


# ======================================================================================
# Used by the simulator (vllm_hisparse/vllm/simulation): the engine pieces it drives for
# real on CPU. Checked by tests/vllm/test_compat.py::test_simulator_internals_exist.
# ======================================================================================

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_planning import (  # noqa: E402
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import get_kv_quant_mode  # noqa: E402
from vllm.v1.metrics.utils import create_metric_per_engine  # noqa: E402  (metrics.py)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

SIMULATOR_INTERNALS = (
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
    SamplingParams, sha256, get_global_kv_cache_groups, get_kv_cache_configs,
    generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash,
    get_kv_quant_mode, ModelRunnerOutput, Request, StructuredOutputManager,
    create_metric_per_engine, KVOutputAggregator, SpeculativeConfig, DraftTokenIds,
)


# ======================================================================================
# P/D decode consumer: vLLM's NixlConnector protocol (used by pd/landings.py and
# nixl_transport.py; checked in tests/vllm/test_compat.py)
# ======================================================================================

#: ``kv_connector`` names of vLLM's pull-mode NIXL connector (a decode instance READs the
#: prefill's blocks), the only NIXL mode a host landing speaks.
NIXL_PULL_CONNECTORS = ("NixlConnector", "NixlPullConnector")


def nixl_handshake_types() -> tuple[bytes, type, type, Callable[..., str]]:
    """``(GET_META_MSG, NixlHandshakePayload, NixlAgentMetadata,
    compute_nixl_compatibility_hash)`` of vLLM's NixlConnector (``nixl/metadata.py``): the
    side-channel query, its answer, the registration inside it, and the hash both sides
    compare."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        GET_META_MSG,
        NixlAgentMetadata,
        NixlHandshakePayload,
        compute_nixl_compatibility_hash,
    )

    return GET_META_MSG, NixlHandshakePayload, NixlAgentMetadata, compute_nixl_compatibility_hash


def prefill_backoff_tokens(vllm_config: VllmConfig) -> int:
    """Trailing prompt tokens a NIXL decode instance recomputes instead of loading (vLLM's
    ``_prefill_backoff`` for models without Mamba or bounded replay, i.e. DSA models):
    ``num_prefill_lookahead_tokens - 1``, at least 0."""
    return max(0, int(vllm_config.num_prefill_lookahead_tokens) - 1)


# ======================================================================================
# vLLM's in-tree Hybrid HiSparse: only the scheduler benchmarks touch it, to compare
# against it (cli/benchmarks/vllm_baselines.py)
# ======================================================================================


def intree_hisparse() -> tuple[str, type, type, Callable[..., Any], tuple[type, ...]]:
    """``(connector name, HiSparseConfig, HiSparseConnectorWorkerMetadata,
    get_hisparse_kv_cache_groups, (HiSparseResidentSpec, HiSparseHotSpec))`` of vLLM's
    in-tree HiSparse. The name is read from vLLM's connector class: configuring it switches
    the in-tree path on, so the package holds no literal of it (tests/vllm/test_plugin.py)."""
    from vllm.config.attention import HiSparseConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import connector as intree
    from vllm.v1.hisparse.layout import get_hisparse_kv_cache_groups
    from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec

    return (intree.HiSparseConnector.__name__, HiSparseConfig, intree.HiSparseConnectorWorkerMetadata,
            get_hisparse_kv_cache_groups, (HiSparseResidentSpec, HiSparseHotSpec))
