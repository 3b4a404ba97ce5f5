"""Every access this package makes to a vLLM 0.33 internal, in one place.

vLLM's connector API is public, but planning, scheduling and the factory registry are
internal and move between releases. Each internal is reached through one small named
function or constant below, so an upgrade touches one file and
``tests/vllm/test_compat.py`` (which checks every name and signature relied on here)
says exactly what moved.

The one patch this package applies lives here too: ``install_planner_hook`` wraps
``Platform.get_kv_cache_config_builder_cls`` so that an engine whose
``kv_transfer_config`` names ``HiSparseResidencyConnector`` plans its KV cache with
our builder. It is idempotent and inert for every other configuration.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# Public-ish building blocks (stable since the V1 connector API landed).
from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# Internal: KV-cache planning (engine core and, for profiling, the workers).
from vllm.platforms.interface import Platform
from vllm.v1.core.kv_cache_config_builder import KVCacheConfigBuilder
from vllm.v1.core.kv_cache_planning import (
    DefaultKVCacheConfigBuilder,
    get_kv_cache_groups,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

# Internal: the scheduler-side KV cache manager, its block pool and manager registry.
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

__all__ = [
    "AttentionSpec",
    "BlockPool",
    "FullAttentionManager",
    "KVCacheBlock",
    "KVCacheSpecRegistry",
    "KVConnectorOutput",
    "RESIDENCY_GROUP_ROLE",
    "assign_group_role",
    "group_managers",
    "kv_load_failure_policy",
    "prefix_cache_geometry",
    "multi_connector_types",
    "register_residency_manager",
    "residency_manager_registered",
    "CUDAGraphMode",
    "DEFAULT_BUILDER_QUALNAME",
    "DefaultKVCacheConfigBuilder",
    "HiddenStateCacheSpec",
    "KVCacheConfig",
    "KVCacheConfigBuilder",
    "KVCacheGroupSpec",
    "KVCacheLayout",
    "KVCacheSpec",
    "KVConnectorBase_V1",
    "KVConnectorFactory",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "MLAAttentionSpec",
    "SlidingWindowMLASpec",
    "SparseCacheRole",
    "SupportsHMA",
    "UniformTypeKVCacheSpecs",
    "VllmConfig",
    "connector_is_registered",
    "default_kv_cache_groups",
    "install_planner_hook",
    "planner_hook_installed",
    "register_connector",
    "remove_planner_hook",
    "resolve_connector_class",
    "resolve_kv_cache_config_builder",
    "resolved_kv_cache_layout",
    "scheduler_classes",
]

#: What ``Platform.get_kv_cache_config_builder_cls`` returns in vLLM 0.33 for every
#: in-tree platform. Our builder subclasses this one, so we only take over when the
#: platform would have used it; a vendor builder is never silently replaced.
DEFAULT_BUILDER_QUALNAME = "vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder"

#: Attribute set on our wrapper so a second ``install_planner_hook`` is a no-op.
_HOOK_MARKER = "__vllm_hisparse_planner_hook__"


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


def _current_builder_hook() -> Any:
    # The attribute on the class is a classmethod object; look in __dict__ so we see
    # the descriptor itself rather than a bound method.
    return Platform.__dict__["get_kv_cache_config_builder_cls"]


def planner_hook_installed() -> bool:
    """Whether ``install_planner_hook`` has wrapped the platform lookup."""
    return getattr(_current_builder_hook().__func__, _HOOK_MARKER, False)


def install_planner_hook(select_builder: Callable[[VllmConfig], str | None]) -> bool:
    """Route KV-cache planning to our builder when ``select_builder`` says so.

    vLLM 0.33 resolves the planner as
    ``current_platform.get_kv_cache_config_builder_cls(vllm_config)`` (a classmethod
    defined only on ``Platform``; no in-tree platform overrides it). We wrap that
    classmethod on the base class: the wrapper asks ``select_builder(vllm_config)``
    for a qualified class name and falls through to vLLM's answer when it returns
    ``None``. So the patch changes nothing unless the config names our connector.

    Idempotent: returns False (and changes nothing) if already installed.
    """
    descriptor = _current_builder_hook()
    original = descriptor.__func__
    if getattr(original, _HOOK_MARKER, False):
        return False

    @functools.wraps(original)
    def get_kv_cache_config_builder_cls(cls: type, vllm_config: VllmConfig) -> str:
        platform_choice = original(cls, vllm_config)
        ours = select_builder(vllm_config)
        if ours is None:
            return platform_choice
        if platform_choice != DEFAULT_BUILDER_QUALNAME:
            # A vendor platform plans its own KV cache; we refuse to replace it
            # rather than silently drop its placement rules.
            raise ValueError(
                "HiSparseResidencyConnector needs to plan the KV cache itself, but "
                f"platform {cls.__name__} selects the KV cache config builder "
                f"{platform_choice!r}; only {DEFAULT_BUILDER_QUALNAME!r} is supported."
            )
        return ours

    setattr(get_kv_cache_config_builder_cls, _HOOK_MARKER, True)
    get_kv_cache_config_builder_cls.__vllm_hisparse_original__ = original  # type: ignore[attr-defined]
    Platform.get_kv_cache_config_builder_cls = classmethod(get_kv_cache_config_builder_cls)  # type: ignore[assignment]
    return True


def remove_planner_hook() -> bool:
    """Undo ``install_planner_hook`` (tests only); returns False if not installed."""
    wrapper = _current_builder_hook().__func__
    if not getattr(wrapper, _HOOK_MARKER, False):
        return False
    Platform.get_kv_cache_config_builder_cls = classmethod(  # type: ignore[assignment]
        wrapper.__vllm_hisparse_original__
    )
    return True


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


def register_residency_manager(manager_cls: type) -> None:
    """Map ``RESIDENCY_GROUP_ROLE`` to ``manager_cls`` (idempotent).

    Inert on its own: only a group whose ``role`` is ``RESIDENCY_GROUP_ROLE`` uses it,
    and only :func:`assign_group_role` (called by our connector) sets that role.
    vLLM's built-in registrations run lazily on first lookup; we trigger them first so
    that ours never counts as "the registry is already populated".
    """
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register_role_manager(RESIDENCY_GROUP_ROLE, manager_cls)


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


def prefix_cache_geometry(kv_cache_manager: Any) -> tuple[bool, int]:
    """``(enable_caching, hash_block_size)`` of a ``KVCacheManager``: whether requests'
    ``block_hashes`` are maintained, and how many tokens one hash covers."""
    return bool(kv_cache_manager.enable_caching), int(kv_cache_manager.block_pool.hash_block_size)


def kv_load_failure_policy(vllm_config: VllmConfig) -> str:
    """``kv_transfer_config.kv_load_failure_policy``: ``"fail"`` (vLLM fails a request
    whose connector load failed) or ``"recompute"`` (vLLM rewinds its computed tokens)."""
    kv = vllm_config.kv_transfer_config
    return str(getattr(kv, "kv_load_failure_policy", "fail")) if kv is not None else "fail"


def multi_connector_types() -> tuple[type, type, type]:
    """``(MultiConnector, MultiKVConnectorMetadata, MultiKVConnectorWorkerMetadata)``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorMetadata,
        MultiKVConnectorWorkerMetadata,
    )

    return MultiConnector, MultiKVConnectorMetadata, MultiKVConnectorWorkerMetadata


# ======================================================================================
# Worker side: KV allocation, forward context and the sparse-MLA top-k conversion hook
# (section owned by the worker role: worker_side.py, attention_hook.py;
#  existence checks in tests/vllm/test_compat_worker.py)
# ======================================================================================

#: Attribute set on our wrapper of ``SparseMLAIndexGroup.convert_logical_to_physical_topk``
#: so a second install is a no-op.
_TOPK_HOOK_MARKER = "__vllm_hisparse_topk_hook__"


def sparse_mla_index_group_class() -> type:
    """``vllm.v1.attention.backends.mla.index_group.SparseMLAIndexGroup``: the object every
    sparse-MLA layer of one indexer shares (``index_group.py:36``); its
    ``convert_logical_to_physical_topk`` (``:95``) is where decode batches turn logical
    top-k into physical KV rows. ``HiSparseMLAIndexGroup`` (vLLM's in-tree HiSparse)
    overrides the method, so our wrapper never runs for it."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    return SparseMLAIndexGroup


def in_tree_hisparse_index_group_class() -> type:
    """vLLM's in-tree ``HiSparseMLAIndexGroup`` (we refuse to bind to one)."""
    from vllm.v1.attention.backends.mla.index_group import HiSparseMLAIndexGroup

    return HiSparseMLAIndexGroup


def topk_conversion_hook_installed() -> bool:
    """Whether ``install_topk_conversion_hook`` wrapped the group method."""
    method = sparse_mla_index_group_class().__dict__["convert_logical_to_physical_topk"]
    return getattr(method, _TOPK_HOOK_MARKER, False)


def install_topk_conversion_hook(body: Callable[..., Any]) -> bool:
    """Route ``SparseMLAIndexGroup.convert_logical_to_physical_topk`` through ``body``.

    ``body(group, original, layer_index, logical_topk, attn_metadata, *,
    block_stride_rows, return_valid_counts)`` receives vLLM's method bound to ``group`` as
    ``original`` and must call it for groups it does not own (the wrapper is on the class,
    so it sees every sparse-MLA model in the process). Idempotent; returns False if already
    installed. Applied by the worker role when it binds KV caches, never at import.
    """
    cls = sparse_mla_index_group_class()
    original = cls.__dict__["convert_logical_to_physical_topk"]
    if getattr(original, _TOPK_HOOK_MARKER, False):
        return False

    @functools.wraps(original)
    def convert_logical_to_physical_topk(self, layer_index, logical_topk_indices, attn_metadata,
                                         *, block_stride_rows, return_valid_counts):
        return body(self, original.__get__(self), layer_index, logical_topk_indices,
                    attn_metadata, block_stride_rows=block_stride_rows,
                    return_valid_counts=return_valid_counts)

    setattr(convert_logical_to_physical_topk, _TOPK_HOOK_MARKER, True)
    convert_logical_to_physical_topk.__vllm_hisparse_original__ = original  # type: ignore[attr-defined]
    cls.convert_logical_to_physical_topk = convert_logical_to_physical_topk
    return True


def remove_topk_conversion_hook() -> bool:
    """Undo ``install_topk_conversion_hook`` (tests only); False if not installed."""
    cls = sparse_mla_index_group_class()
    wrapper = cls.__dict__["convert_logical_to_physical_topk"]
    if not getattr(wrapper, _TOPK_HOOK_MARKER, False):
        return False
    cls.convert_logical_to_physical_topk = wrapper.__vllm_hisparse_original__
    return True


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
    return group, int(getattr(impl, "index_group_index"))


def allocate_kv_cache(kv_cache_config: KVCacheConfig, device: Any, layout: KVCacheLayout,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
    """vLLM's own worker KV allocation (``v1/worker/utils.py:564``): one backing, one
    ``[B, H, N, C]`` view per layer at ``offset + l * layer_stride + b * block_stride``.
    The worker role reads these views; tests use this to build them on CPU."""
    from vllm.v1.worker.utils import allocate_kv_cache as _allocate

    return _allocate(kv_cache_config, device, layout, kernel_block_sizes)


def scheduled_token_counts(scheduler_output: Any) -> dict[str, int]:
    """``SchedulerOutput.num_scheduled_tokens`` (request id → tokens this step)."""
    return dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})


# ======================================================================================
# Worker side (2): sparse-MLA backends' direct logical->physical conversions, the layer
# context they run in, and the per-step attention metadata.
# (section owned by the worker role: worker_side.py, attention_hook.py;
#  existence and signature checks in tests/vllm/test_compat_worker.py)
# ======================================================================================

import contextlib as _contextlib
import contextvars as _contextvars
import importlib as _importlib

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
#: ``install_direct_conversion_routing`` replaces that module-global name in each of them
#: (``index_group.py``'s own name, used by the group method, is left alone: the group method
#: has its own hook). ROCm / XPU sparse backends are not covered.
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

_ROUTING_MARKER = "__vllm_hisparse_direct_conversion__"
_LAYER_ROUTE_MARKER = "__vllm_hisparse_layer_context__"

#: ``(index_group, index_in_group, attn_metadata)`` of the sparse-MLA layer whose
#: ``forward_mqa`` is running, or None outside one.
_CURRENT_SPARSE_LAYER: _contextvars.ContextVar[tuple[Any, int, Any] | None] = \
    _contextvars.ContextVar("vllm_hisparse_sparse_layer", default=None)


def direct_conversion_function() -> Callable[..., Any]:
    """vLLM's ``triton_convert_req_index_to_global_index`` (``sparse_utils.py:493``)."""
    from vllm.v1.attention.backends.mla import sparse_utils

    return getattr(sparse_utils, DIRECT_CONVERSION_NAME)


@_contextlib.contextmanager
def sparse_layer_context(group: Any, layer_index: int, attn_metadata: Any):
    """Mark the code inside as the attention of member ``layer_index`` of ``group``."""
    token = _CURRENT_SPARSE_LAYER.set((group, int(layer_index), attn_metadata))
    try:
        yield
    finally:
        _CURRENT_SPARSE_LAYER.reset(token)


def current_sparse_layer() -> tuple[Any, int, Any] | None:
    """The layer context set by :func:`sparse_layer_context`, or None."""
    return _CURRENT_SPARSE_LAYER.get()


def direct_conversion_routing_installed() -> bool:
    """Whether every module of ``DIRECT_CONVERSION_SITES`` calls our wrapper."""
    return all(getattr(getattr(_importlib.import_module(m), DIRECT_CONVERSION_NAME), _ROUTING_MARKER,
                       False) for m in DIRECT_CONVERSION_SITES)


def install_direct_conversion_routing(body: Callable[..., Any]) -> bool:
    """Route the backends' direct conversions through ``body`` while a layer context is set.

    The wrapper replaces the module-global ``triton_convert_req_index_to_global_index`` of
    every module of ``DIRECT_CONVERSION_SITES``. Outside a :func:`sparse_layer_context` it
    calls vLLM's function unchanged; inside one it calls ``body(context, original, *args,
    **kwargs)``, ``context`` being ``(index_group, index_in_group, attn_metadata)``.
    Idempotent (returns False when already installed); applied by the worker role when it
    binds, never at import.
    """
    if direct_conversion_routing_installed():
        return False
    original = direct_conversion_function()

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        context = _CURRENT_SPARSE_LAYER.get()
        if context is None:
            return original(*args, **kwargs)
        return body(context, original, *args, **kwargs)

    setattr(routed, _ROUTING_MARKER, True)
    routed.__vllm_hisparse_original__ = original  # type: ignore[attr-defined]
    for module_name in DIRECT_CONVERSION_SITES:
        setattr(_importlib.import_module(module_name), DIRECT_CONVERSION_NAME, routed)
    return True


def remove_direct_conversion_routing() -> bool:
    """Undo :func:`install_direct_conversion_routing` (tests only); False if not installed."""
    removed = False
    for module_name in DIRECT_CONVERSION_SITES:
        module = _importlib.import_module(module_name)
        current = getattr(module, DIRECT_CONVERSION_NAME)
        if getattr(current, _ROUTING_MARKER, False):
            setattr(module, DIRECT_CONVERSION_NAME, current.__vllm_hisparse_original__)
            removed = True
    return removed


def route_layer_forward(impl: Any) -> bool:
    """Make ``impl.forward_mqa`` (one bound sparse-MLA layer, instance attribute only) run
    inside :func:`sparse_layer_context` of its index group, so the direct conversion sites
    know whose binding to use. ``MLAAttention.forward_impl`` calls
    ``self.impl.forward_mqa(q, kv_cache, attn_metadata, layer)`` (``mla_attention.py:1134``).
    Idempotent; returns False when already routed."""
    current = impl.forward_mqa
    if getattr(current, _LAYER_ROUTE_MARKER, False):
        return False
    bound = current

    @functools.wraps(bound)
    def forward_mqa(q: Any, kv_c_and_k_pe_cache: Any, attn_metadata: Any, layer: Any) -> Any:
        with sparse_layer_context(impl.index_group, impl.index_group_index, attn_metadata):
            return bound(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    setattr(forward_mqa, _LAYER_ROUTE_MARKER, True)
    impl.forward_mqa = forward_mqa
    return True


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
# (vllm_hisparse/vllm/host_sharing.py). Checked by
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
)
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
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

SIMULATOR_INTERNALS = (
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
    SamplingParams, sha256, get_global_kv_cache_groups, get_kv_cache_configs,
    generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash,
    get_kv_quant_mode, ModelRunnerOutput, Request, StructuredOutputManager,
    create_metric_per_engine,
)
