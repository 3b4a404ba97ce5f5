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
