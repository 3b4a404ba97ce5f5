"""KV-cache planning when HiSparseResidencyConnector is configured: the group split.

vLLM 0.33's default planner puts a DSA model's sparse-MLA layers and its indexer
layers into ONE KV cache group, so one block id holds a page of every MLA layer AND
every indexer layer. Residency releases sparse-MLA pages while the indexer keeps
scoring every position, so the two must be in different groups: a released MLA block
must not take indexer KV with it.

The split (``split_kv_cache_groups``):

* **sparse-MLA groups**: the target model's ``MLAAttentionSpec(cache_role=SPARSE)``
  layers, cut into *index units* (an index leader, ``is_index_group_leader``, plus the
  IndexShare followers after it, which reuse its top-k). A unit is never split across
  groups: the hot region and the resolved rows of one index unit live in one group's
  blocks.
* **indexer groups**: the ``cache_role=INDEXER`` layers. They stay fully resident.
* **other groups**: anything else (draft/MTP layers, non-DSA layers) keeps vLLM's own
  grouping and residency.

vLLM's pool gives every group the same block (``bytes_per_block`` = the largest
group's summed page bytes, block-outermost layout), so a group whose pages sum to less
wastes the rest. Each request holds one block per group per page, so device bytes per
page of tokens = ``num_groups * bytes_per_block``. We pick the split (contiguous
packing of units and of indexer layers) that minimises that product, with at most
``MAX_SPLIT_GROUPS`` groups to bound per-group scheduler work. For DeepSeek-V3.2
(61 x 41,984 B MLA pages, 61 x 8,448 B indexer pages, block 64) that is 5 MLA groups
(13/13/13/13/9 layers) + 1 indexer group at 545,792 B per block: 3,274,752 B per page
of tokens against 3,076,352 B of payload (94 % dense). See docs/vllm-integration.md.

Layout: groups with different page sizes can only share a pool in a block-outermost
layout (``BLHNC``), which is also what the sparse-MLA and indexer backends read; the
connector requires it and the builder checks it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_hisparse.core.kv_layout import MAX_SPLIT_GROUPS, SplitChoice, choose_split
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.compat import (
    DefaultKVCacheConfigBuilder,
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
    is_connector_configured,
)
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.setup.kv_plan import (
    check_host_pool_holds_one_request,
    host_block_bytes,
    host_copies_per_replica,
    is_target_sparse_spec,
)
from vllm_hisparse.vllm.setup.offloading_scope import scope_planned_config

# --------------------------------------------------------------------------------------
# Layer classification
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerClasses:
    """The layers of one model, by the residency treatment they get."""

    sparse: dict[str, MLAAttentionSpec]
    """Target-model sparse-MLA layers, in layer order: host-backed, releasable."""
    indexer: dict[str, MLAAttentionSpec]
    """Indexer K-cache layers, in layer order: always resident."""
    other: dict[str, KVCacheSpec]
    """Everything else: vLLM's grouping, always resident."""


def _layer_order_key(indexed_name: tuple[int, str]) -> tuple[int, int]:
    position, name = indexed_name
    # "model.layers.12.self_attn.attn" -> 12; names without a number keep dict order.
    match = re.search(r"\.(\d+)(?:\.|$)", name)
    return (int(match.group(1)) if match else -1, position)


def _in_layer_order(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    ordered = sorted(enumerate(specs), key=_layer_order_key)
    return {name: specs[name] for _, name in ordered}


def classify_layers(kv_cache_spec: dict[str, KVCacheSpec]) -> LayerClasses:
    """Split a model's per-layer specs into sparse-MLA, indexer and other layers."""
    sparse: dict[str, MLAAttentionSpec] = {}
    indexer: dict[str, MLAAttentionSpec] = {}
    other: dict[str, KVCacheSpec] = {}
    for name, spec in kv_cache_spec.items():
        is_plain_mla = isinstance(spec, MLAAttentionSpec) and not isinstance(
            spec, (HiddenStateCacheSpec, SlidingWindowMLASpec)
        )
        if not is_plain_mla or spec.is_draft:
            # Draft (MTP) layers are small and rewritten by every draft pass; they
            # stay resident under vLLM's own grouping.
            other[name] = spec
        elif spec.model_version == "deepseek_v4":
            raise HiSparseConfigError(
                f"{CONNECTOR_NAME} does not support DeepSeek-V4 layers (layer {name}); "
                "accepted: DeepSeek-V3.2 / GLM-5.x style DSA layers."
            )
        elif spec.cache_role is SparseCacheRole.INDEXER:
            indexer[name] = spec
        else:
            sparse[name] = spec
    if not sparse or not indexer:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME} found {len(sparse)} sparse-MLA and {len(indexer)} "
            "indexer KV layers; accepted: a DSA model with both (HF config index_topk)."
        )
    return LayerClasses(_in_layer_order(sparse), _in_layer_order(indexer), other)


def index_units(sparse: dict[str, MLAAttentionSpec]) -> list[list[str]]:
    """Sparse layers cut into index units: a leader and the followers after it.

    DeepSeek-V3.2 has an indexer on every layer, so every unit is one layer. GLM-5.x
    IndexShare layers without an indexer (``is_index_group_leader=False``) reuse the
    top-k of the nearest leader before them.
    """
    units: list[list[str]] = []
    for name, spec in sparse.items():
        if spec.is_index_group_leader:
            units.append([name])
        elif units:
            units[-1].append(name)
        else:
            raise HiSparseConfigError(
                f"{CONNECTOR_NAME}: sparse-MLA layer {name} reuses another layer's "
                "top-k but no index leader precedes it; accepted: IndexShare followers "
                "after their leader (is_index_group_leader=True)."
            )
    return units


# --------------------------------------------------------------------------------------
# Building the groups
# --------------------------------------------------------------------------------------


def _uniform_group(names: Sequence[str], specs: dict[str, KVCacheSpec]) -> KVCacheGroupSpec:
    # UniformTypeKVCacheSpecs keeps one spec per layer, so IndexShare leaders and
    # followers (specs differing only in is_index_group_leader) share a group.
    group_spec = UniformTypeKVCacheSpecs.from_specs({name: specs[name] for name in names})
    if group_spec is None:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: layers {list(names)} cannot share a KV cache group "
            "(different block sizes or spec types); accepted: one block_size for "
            "every sparse-MLA and indexer layer."
        )
    return KVCacheGroupSpec(list(names), group_spec)


@dataclass(frozen=True)
class SplitGroups:
    """The planned groups, with which ones are ours."""

    groups: list[KVCacheGroupSpec]
    sparse_group_ids: tuple[int, ...]
    indexer_group_ids: tuple[int, ...]
    choice: SplitChoice


def split_kv_cache_groups(
    vllm_config: VllmConfig,
    kv_cache_spec: dict[str, KVCacheSpec],
    *,
    max_groups: int = MAX_SPLIT_GROUPS,
) -> SplitGroups:
    """Plan sparse-MLA, indexer and other groups (sparse first, then indexer, then other)."""
    classes = classify_layers(kv_cache_spec)
    block_sizes = {s.block_size for s in (*classes.sparse.values(), *classes.indexer.values())}
    if len(block_sizes) != 1:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: sparse-MLA and indexer layers use block sizes "
            f"{sorted(block_sizes)}; accepted: one block_size for all of them."
        )
    units = index_units(classes.sparse)
    indexer_names = list(classes.indexer)
    alignment = math.lcm(
        *(s.get_block_stride_alignment() for s in (*classes.sparse.values(), *classes.indexer.values()))
    )
    try:
        choice = choose_split(
            [sum(classes.sparse[n].page_size_bytes for n in unit) for unit in units],
            [classes.indexer[n].page_size_bytes for n in indexer_names],
            alignment=alignment,
            max_groups=max_groups,
        )
    except ValueError as exc:
        raise HiSparseConfigError(f"{CONNECTOR_NAME}: {exc}") from None
    groups = [
        _uniform_group([n for u in part for n in units[u]], classes.sparse)
        for part in choice.sparse_parts
    ]
    sparse_ids = tuple(range(len(groups)))
    groups += [
        _uniform_group([indexer_names[i] for i in part], classes.indexer)
        for part in choice.indexer_parts
    ]
    indexer_ids = tuple(range(len(sparse_ids), len(groups)))
    if classes.other:
        groups += compat.default_kv_cache_groups(vllm_config, dict(classes.other))
    return SplitGroups(groups, sparse_ids, indexer_ids, choice)




class HiSparseKVCacheConfigBuilder(DefaultKVCacheConfigBuilder):
    """vLLM KV-cache config builder that splits sparse-MLA from indexer layers.

    Selected through the planner hook (``patches.PLANNER_HOOK``) only when the
    engine's kv_transfer_config names HiSparseResidencyConnector. Tensor placement is
    vLLM's own: block-outermost, one backing, every group aliasing from byte 0.
    """

    def get_kv_cache_groups(
        self, vllm_config: VllmConfig, kv_cache_spec: dict[str, KVCacheSpec]
    ) -> list[KVCacheGroupSpec]:
        config = resolve_config(vllm_config)  # fail with the config error before planning
        if vllm_config.model_config.supports_kv_cache_grouping:
            raise HiSparseConfigError(
                f"{CONNECTOR_NAME} plans the KV cache groups itself; accepted: a model "
                "that does not declare its own get_kv_cache_groups."
            )
        layout = compat.resolved_kv_cache_layout(vllm_config)
        if not layout.is_block_outermost:
            raise HiSparseConfigError(
                f"{CONNECTOR_NAME}: KV cache layout {layout.name} cannot pack groups of "
                "different page sizes into one block; accepted: BLHNC "
                "(set VLLM_KV_CACHE_LAYOUT=BLHNC)."
            )
        split = split_kv_cache_groups(vllm_config, kv_cache_spec)
        if vllm_config.model_config.original_max_model_len != -1:
            # With auto-fit (-1) max_model_len is not final yet; the connector checks
            # again at construction, after auto-fit.
            check_host_pool_holds_one_request(
                config,
                host_block_bytes=host_block_bytes(
                    split.groups[i] for i in split.sparse_group_ids + split.indexer_group_ids
                ),
                host_copies=host_copies_per_replica(vllm_config),
                max_model_len=vllm_config.model_config.max_model_len,
            )
        return split.groups

    def get_kv_cache_config_from_groups(
        self, vllm_config: VllmConfig, kv_cache_groups: list[KVCacheGroupSpec], num_blocks: int
    ) -> KVCacheConfig:
        """vLLM's placement; composed with OffloadingConnector, the plan also scopes it to
        the non-sparse groups (``offloading_scope``), so every process gets that scope."""
        config = super().get_kv_cache_config_from_groups(vllm_config, kv_cache_groups, num_blocks)
        scope_planned_config(vllm_config, config, resolve_config(vllm_config))
        return config


def select_builder(vllm_config: VllmConfig) -> str | None:
    """Planner-hook callback: our builder iff the connector is configured."""
    return BUILDER_QUALNAME if is_connector_configured(vllm_config) else None


