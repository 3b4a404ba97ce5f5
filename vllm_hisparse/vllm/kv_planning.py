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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_hisparse.core.capacity import CapacityReport, EngineLayout, concurrency_report, host_blocks_for_budget
from vllm_hisparse.core.kv_layout import MAX_SPLIT_GROUPS, SplitChoice, choose_split
from vllm_hisparse.core.units import GIB, cdiv
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
from vllm_hisparse.vllm.offloading_scope import scope_planned_config
from vllm_hisparse.vllm.config import (
    CONNECTOR_NAME,
    HiSparseConfigError,
    HiSparseResidencyConfig,
    is_connector_configured,
    resolve_config,
)

#: Qualified name the planner hook hands to vLLM.
BUILDER_QUALNAME = "vllm_hisparse.vllm.kv_planning.HiSparseKVCacheConfigBuilder"


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
    from vllm_hisparse.vllm.host_sharing import plan_host_pool_sharing

    return plan_host_pool_sharing(vllm_config).host_copies


def select_builder(vllm_config: VllmConfig) -> str | None:
    """Planner-hook callback: our builder iff the connector is configured."""
    return BUILDER_QUALNAME if is_connector_configured(vllm_config) else None


# --------------------------------------------------------------------------------------
# Capacity and the startup table
# --------------------------------------------------------------------------------------


def format_capacity_table(report: CapacityReport) -> str:
    """The startup table logged once per engine (plain text, one row per quantity)."""
    rows = [
        ("device blocks", f"{report.device_blocks:,}"),
        ("bytes per block", f"{report.bytes_per_block:,} B"),
        (
            "KV cache groups",
            f"{report.num_sparse_groups} sparse-MLA + {report.num_indexer_groups} indexer",
        ),
        ("host blocks", f"{report.host_blocks:,} x {report.host_block_bytes:,} B"),
        ("host pool, logical", f"{report.logical_host_gib:.2f} GiB"),
        (
            "host pool, physical",
            f"{report.physical_host_gib:.2f} GiB ({report.host_copies} pinned "
            f"cop{'y' if report.host_copies == 1 else 'ies'})",
        ),
        ("hot rows per request", f"{report.hot_rows_per_request:,} per sparse-MLA layer"),
        ("max concurrency, no residency", f"{report.max_concurrency_without_residency:,} "
         "(full residency: every page on the device)"),
        ("max concurrency, admission", f"{report.max_concurrency_at_admission:,}"),
        ("max concurrency, steady state", f"{report.max_concurrency_steady:,} "
         "(hybrid residency: hot rows + tail on the device)"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{CONNECTOR_NAME} KV capacity (max_model_len requests):"]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)


def engine_capacity_report(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: HiSparseResidencyConfig
) -> CapacityReport:
    """The capacity report for a planned engine at ``max_model_len`` (what the connector
    logs at startup); ``config`` is the connector's parsed config (``resolve_config``,
    parsed once). The figures come from ``core.capacity.concurrency_report``, the function behind
    ``vllm-hisparse plan`` too."""
    return concurrency_report(engine_layout(vllm_config, kv_cache_config, config),
                    vllm_config.model_config.max_model_len)


def engine_layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: HiSparseResidencyConfig
) -> EngineLayout:
    """The planned engine's KV layout (device pool, groups, host pool, hot region, window)."""
    groups = kv_cache_config.kv_cache_groups
    sparse_ids = sparse_group_ids(kv_cache_config)
    indexer_ids = indexer_group_ids(kv_cache_config)
    host_blocks = planned_host_blocks(vllm_config, kv_cache_config, config)
    device_tensors = [t for t in kv_cache_config.kv_cache_tensors if not t.host_resident]
    bytes_per_block = device_tensors[0].size // kv_cache_config.num_blocks if device_tensors else 0
    return EngineLayout(
        device_blocks=kv_cache_config.num_blocks,
        bytes_per_block=bytes_per_block,
        num_sparse_groups=len(sparse_ids),
        num_indexer_groups=len(indexer_ids),
        num_other_groups=len(groups) - len(sparse_ids) - len(indexer_ids),
        host_blocks=host_blocks,
        host_block_bytes=sum(host_page_bytes(kv_cache_config)),
        host_copies=host_copies_per_replica(vllm_config),
        block_size=config.block_size,
        hot_blocks_per_request=config.hot_blocks_per_request,
        admission_window_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
    )


def _layer_specs(group: KVCacheGroupSpec) -> list[KVCacheSpec]:
    spec = group.kv_cache_spec
    return list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
