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

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

__all__ = [
    "AttentionSpec",
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
