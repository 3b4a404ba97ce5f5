"""KV-cache planning: the builder vLLM plans with (and the default one ours subclasses), the
spec and layout classes of a plan, vLLM's own grouping, the startup capacity line's function,
and vLLM's worker-side allocation of a finished plan."""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.platforms.interface import Platform
from vllm.v1.core.kv_cache_config_builder import KVCacheConfigBuilder
from vllm.v1.core.kv_cache_planning import DefaultKVCacheConfigBuilder, get_kv_cache_groups
from vllm.v1.kv_cache_interface import (AttentionSpec, HiddenStateCacheSpec, KVCacheConfig,
                                        KVCacheGroupSpec, KVCacheSpec, MLAAttentionSpec, SlidingWindowMLASpec,
                                        SparseCacheRole, UniformTypeKVCacheSpecs)
from vllm.v1.kv_cache_layout import KVCacheLayout

__all__ = ["allocate_kv_cache", "AttentionSpec", "DEFAULT_BUILDER_QUALNAME",
           "default_kv_cache_groups", "DefaultKVCacheConfigBuilder", "get_kv_cache_groups",
           "HiddenStateCacheSpec", "KVCacheConfig", "KVCacheConfigBuilder", "KVCacheGroupSpec",
           "KVCacheLayout", "KVCacheSpec", "MAX_CONCURRENCY_MODULE", "max_concurrency_module",
           "MAX_CONCURRENCY_NAME", "MLAAttentionSpec", "Platform",
           "resolve_kv_cache_config_builder", "resolved_kv_cache_layout", "SlidingWindowMLASpec",
           "SparseCacheRole", "UniformTypeKVCacheSpecs"]

#: What ``Platform.get_kv_cache_config_builder_cls`` returns in vLLM 0.33 for every
#: in-tree platform. Our builder subclasses this one, so we only take over when the
#: platform would have used it; a vendor builder is never silently replaced.
DEFAULT_BUILDER_QUALNAME = "vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder"

#: Module and function behind vLLM's "Maximum concurrency for N tokens per request" line:
#: ``update_kv_cache_capacity`` (engine core, ``v1/engine/core.py``) calls
#: ``get_kv_cache_capacity``, which calls this function by its module-global name with the
#: scheduler's KV cache config, before the scheduler (and our connector) exists.
MAX_CONCURRENCY_MODULE = "vllm.v1.core.kv_cache_utils"
MAX_CONCURRENCY_NAME = "get_max_concurrency_for_kv_cache_config"


def max_concurrency_module() -> Any:
    """:data:`MAX_CONCURRENCY_MODULE`, imported (the capacity line patches its global)."""
    import importlib

    return importlib.import_module(MAX_CONCURRENCY_MODULE)


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


def allocate_kv_cache(kv_cache_config: KVCacheConfig, device: Any, layout: KVCacheLayout,
                      kernel_block_sizes: list[int] | None = None) -> dict[str, Any]:
    """vLLM's own worker KV allocation (``v1/worker/utils.py:564``): one backing, one
    ``[B, H, N, C]`` view per layer at ``offset + l * layer_stride + b * block_stride``.
    The worker role reads these views; tests use this to build them on CPU."""
    from vllm.v1.worker.utils import allocate_kv_cache as _allocate

    return _allocate(kv_cache_config, device, layout, kernel_block_sizes)
