"""Readers of a finished KV plan: which groups are sparse-MLA or indexer groups, the bytes
of one page and of one host block, and the host blocks the plan's pool holds.

Everything after planning asks these (the connector roles, the Offloading scope, the
capacity report); none of them imports the planner (``kv_planner``) that made the plan.
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_hisparse.core.capacity import host_blocks_for_budget
from vllm_hisparse.core.units import GIB, cdiv
from vllm_hisparse.vllm.compat import (
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    VllmConfig,
)
from vllm_hisparse.vllm.setup.config import (
    BUILDER_QUALNAME,
    CONNECTOR_NAME,
    HiSparseConfigError,
    HiSparseResidencyConfig,
)
from vllm_hisparse.vllm.setup.host_sharing import plan_host_pool_sharing


def is_target_sparse_spec(spec: KVCacheSpec) -> bool:
    """Whether a layer spec is a target-model sparse-MLA layer (residency moves its rows)."""
    return (
        isinstance(spec, MLAAttentionSpec)
        and spec.cache_role is SparseCacheRole.SPARSE
        and not spec.is_draft
        and not isinstance(spec, (HiddenStateCacheSpec, SlidingWindowMLASpec))
    )


def is_sparse_group(group: KVCacheGroupSpec) -> bool:
    """Whether a planned group holds target-model sparse-MLA layers (releasable)."""
    specs = _layer_specs(group)
    return bool(specs) and all(is_target_sparse_spec(s) for s in specs)


def sparse_group_ids(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """Ids of the sparse-MLA groups in a planned config, checking the split happened.

    The connector calls this at construction: if a platform bypassed our planner the
    sparse-MLA layers would share blocks with the indexer, and releasing a page would
    silently drop indexer KV.
    """
    ids = []
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        names = group.layer_names
        if is_sparse_group(group):
            ids.append(group_id)
        elif isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs) and any(
            isinstance(s, MLAAttentionSpec) and s.cache_role is SparseCacheRole.SPARSE and not s.is_draft
            for s in group.kv_cache_spec.kv_cache_specs.values()
        ):
            raise HiSparseConfigError(
                f"{CONNECTOR_NAME}: KV cache group {group_id} mixes sparse-MLA layers "
                f"with other layers ({names[:3]}...): the planner hook did not run; "
                "accepted: the default platform KV cache config builder, so that "
                f"{BUILDER_QUALNAME} plans the cache."
            )
    if not ids:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: no sparse-MLA KV cache group in the KV cache config; "
            "accepted: a DSA model planned by the vllm_hisparse planner."
        )
    return tuple(ids)


def group_page_bytes(group: KVCacheGroupSpec) -> int:
    """Bytes of one page of every layer of ``group``.

    The engine hands the scheduler each group collapsed to its first layer's spec
    (``generate_scheduler_kv_cache_config``); the layers of a group share one page size
    (``UniformTypeKVCacheSpecs``), so a collapsed group is its layer count times that
    page. The workers' config keeps the per-layer specs: the same number either way."""
    spec = group.kv_cache_spec
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return spec.page_size_bytes
    return spec.page_size_bytes * len(group.layer_names)


def host_block_bytes(groups: Iterable[KVCacheGroupSpec]) -> int:
    """Bytes of one page of every layer of ``groups`` (summed)."""
    return sum(group_page_bytes(group) for group in groups)


def indexer_group_ids(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """Ids of the planned groups that hold only DSA indexer layers (always resident)."""
    sparse = set(sparse_group_ids(kv_cache_config))
    return tuple(
        i
        for i, group in enumerate(kv_cache_config.kv_cache_groups)
        if i not in sparse
        and all(
            isinstance(s, MLAAttentionSpec) and s.cache_role is SparseCacheRole.INDEXER
            for s in _layer_specs(group)
        )
    )


def host_page_bytes(kv_cache_config: KVCacheConfig) -> tuple[int, int]:
    """``(sparse_mla_bytes, indexer_bytes)`` of one host block.

    A host block holds one page of every sparse-MLA layer (the rows residency moves)
    and one page of every indexer layer: a host-prefix hit must load both, since the
    indexer scores every position of a request's context."""
    groups = kv_cache_config.kv_cache_groups
    return (
        host_block_bytes(groups[i] for i in sparse_group_ids(kv_cache_config)),
        host_block_bytes(groups[i] for i in indexer_group_ids(kv_cache_config)),
    )


def check_host_pool_holds_one_request(
    config: HiSparseResidencyConfig,
    *,
    host_block_bytes: int,
    host_copies: int,
    max_model_len: int,
) -> int:
    """Host blocks the budget buys; raise unless one ``max_model_len`` request fits.

    ``host_block_bytes`` is one page of every sparse-MLA and indexer layer
    (``sum(host_page_bytes(...))``); ``host_copies`` is how many ranks of the replica pin
    their own copy (:func:`host_copies_per_replica`).
    """
    host_blocks = host_blocks_for_budget(config.host_pool_bytes, host_block_bytes, host_copies)
    needed_blocks = cdiv(max_model_len, config.block_size)
    if host_blocks < needed_blocks:
        needed_gib = needed_blocks * host_block_bytes * host_copies / GIB
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: host_pool_gib={config.host_pool_gib:g} buys "
            f"{host_blocks} host blocks, fewer than one max_model_len={max_model_len} "
            f"request needs ({needed_blocks} blocks of {host_block_bytes} B x "
            f"{host_copies} cop{'y' if host_copies == 1 else 'ies'}); accepted: "
            f"host_pool_gib >= {needed_gib:.3f} or a smaller max_model_len."
        )
    return host_blocks


def planned_host_blocks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                        config: HiSparseResidencyConfig, *, check_one_request: bool = True) -> int:
    """Host blocks of the planned engine's pool: what the scheduler role (its capacity
    report), the worker role and, composed with OffloadingConnector, the plan's
    ``hisparse_host_num_blocks`` all count. One host block is one page of every sparse-MLA
    and indexer layer (:func:`host_page_bytes`), per :func:`host_copies_per_replica`.

    With ``check_one_request``, raise unless one ``max_model_len`` request fits
    (:func:`check_host_pool_holds_one_request`)."""
    host_block_bytes = sum(host_page_bytes(kv_cache_config))
    host_copies = host_copies_per_replica(vllm_config)
    if not check_one_request:
        return host_blocks_for_budget(config.host_pool_bytes, host_block_bytes, host_copies)
    return check_host_pool_holds_one_request(
        config, host_block_bytes=host_block_bytes, host_copies=host_copies,
        max_model_len=vllm_config.model_config.max_model_len)


def host_copies_per_replica(vllm_config: VllmConfig) -> int:
    """How many copies of the host pool a DP replica pins.

    Sparse-MLA KV is not sharded across TP ranks (``max_tp_shards=1``), so every rank
    holds the same rows. The ranks of a replica on one node (multiprocess executor) share
    one pool: 1 copy. Otherwise each rank pins its own copy and ``host_pool_gib`` is
    divided by TP (``host_sharing.plan_host_pool_sharing``).
    """
    return plan_host_pool_sharing(vllm_config).host_copies


def _layer_specs(group: KVCacheGroupSpec) -> list[KVCacheSpec]:
    spec = group.kv_cache_spec
    return list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
