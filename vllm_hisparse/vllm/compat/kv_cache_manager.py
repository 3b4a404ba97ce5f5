"""The scheduler-side KV cache manager: its block pool, blocks, coordinator and per-group
managers, the admission watermark, prefix-cache geometry and per-group prefix hits."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

__all__ = ["BlockPool", "FullAttentionManager", "KVCacheBlock", "NULL_BLOCK_ID",
           "admission_watermark_blocks", "block_is_cached", "group_managers",
           "hybrid_coordinator_class", "kv_cache_coordinator", "num_allocated_pages",
           "per_group_prefix_hits", "prefix_cache_geometry", "set_admission_watermark_blocks"]

#: vLLM's null KV block id (``BlockPool`` block 0): what a block table names for a page
#: that has no device block.
NULL_BLOCK_ID = 0


def per_group_prefix_hits(kv_cache_manager: Any, block_hashes: Any, max_tokens: int) -> tuple[int, ...]:
    """Each KV cache group's own device prefix-cache hit, in tokens, evaluated group by
    group (``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``, the lookup
    vLLM's ``OffloadingConnector`` bounds its loads with)."""
    _, hits = kv_cache_manager.coordinator.find_longest_cache_hit_per_group(block_hashes, max_tokens)
    return tuple(int(h) for h in hits)


def block_is_cached(block: KVCacheBlock) -> bool:
    """Whether a block holds a prefix-cached page (vLLM's ``block_hash`` is set)."""
    return block.block_hash is not None


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
