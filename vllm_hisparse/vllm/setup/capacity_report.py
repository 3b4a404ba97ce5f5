"""The capacity report of a planned engine: what the connector logs once at startup and what
the plugin's max-concurrency line reads."""

from __future__ import annotations

from vllm_hisparse.core.capacity import CapacityReport, EngineLayout, concurrency_report
from vllm_hisparse.vllm.compat import KVCacheConfig, VllmConfig
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME, HiSparseResidencyConfig
from vllm_hisparse.vllm.setup.kv_plan import (
    host_copies_per_replica,
    host_page_bytes,
    indexer_group_ids,
    planned_host_blocks,
    sparse_group_ids,
)


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

