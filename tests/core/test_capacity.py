"""Capacity math: DeepSeek-V3.2 numbers worked by hand."""

from __future__ import annotations

import pytest

from vllm_hisparse.core import (
    ACTIVE_TAIL_PAGES,
    DEEPSEEK_V32_BF16,
    DEEPSEEK_V32_FP8,
    concurrency_report,
    choose_split,
    default_device_buffer_size_rows,
    layout_for_geometry,
)
from vllm_hisparse.core.capacity import host_blocks_for_budget

GIB = 1 << 30


def test_bytes_per_token_per_tier_deepseek_v32():
    """61 layers: fp8_ds_mla 656 B + indexer 132 B per row; bf16 1152 B. The host holds
    both rows of every layer (a host-prefix hit loads the indexer page too)."""
    fp8 = DEEPSEEK_V32_FP8
    assert fp8.device_full_bytes_per_token == 61 * (656 + 132) == 48_068
    assert fp8.device_indexer_bytes_per_token == 61 * 132 == 8_052
    assert fp8.host_bytes_per_token == 61 * (656 + 132) == 48_068
    assert DEEPSEEK_V32_BF16.host_bytes_per_token == 61 * (1152 + 132)
    assert DEEPSEEK_V32_FP8.host_block_bytes == 64 * 48_068 == 3_076_352


def test_default_hot_region_is_top_k_times_decode_rows_plus_one():
    assert default_device_buffer_size_rows(DEEPSEEK_V32_FP8) == 4096
    assert default_device_buffer_size_rows(DEEPSEEK_V32_FP8, max_decode_query_len=2) == 6144


def test_host_blocks_for_budget_rounds_down_and_divides_by_the_copies():
    """host_pool_gib is per DP replica: ranks that each pin a private copy split it."""
    block_bytes = DEEPSEEK_V32_FP8.host_block_bytes
    assert host_blocks_for_budget(10 * block_bytes + block_bytes // 2, block_bytes, 1) == 10
    assert host_blocks_for_budget(384 * GIB, block_bytes, 1) == 384 * GIB // block_bytes == 134_027
    assert host_blocks_for_budget(384 * GIB, block_bytes, 8) == 384 * GIB // (8 * block_bytes) == 16_753
    assert host_blocks_for_budget(block_bytes - 1, block_bytes, 1) == 0
    for bad in ((0, 1), (block_bytes, 0)):
        with pytest.raises(ValueError, match="must be positive"):
            host_blocks_for_budget(GIB, *bad)


def test_the_layout_plan_sizes_is_the_planners():
    """DeepSeek-V3.2 (61 units of one layer, 61 indexer layers): 5 sparse-MLA groups of
    13/13/13/13/9 layers + 1 indexer group at 545,792 B per block, as the planner splits it
    (docs/vllm-integration.md, worked byte table); 60 GiB buy 118,038 such blocks."""
    layout = layout_for_geometry(DEEPSEEK_V32_FP8, device_kv_bytes=60 * GIB, host_pool_bytes=384 * GIB,
                                 device_buffer_size_rows=4096, admission_window_tokens=8192)
    assert (layout.num_sparse_groups, layout.num_indexer_groups, layout.bytes_per_block) == (5, 1, 545_792)
    assert layout.device_blocks == 60 * GIB // 545_792 == 118_038
    assert layout.host_blocks == 384 * GIB // 3_076_352
    assert layout.hot_blocks_per_request == 64


def test_capacity_at_32k_worked_by_hand():
    """32K tokens = 512 pages; 6 groups; hot region 64 pages; window 8192 tokens = 128 pages."""
    layout = layout_for_geometry(DEEPSEEK_V32_FP8, device_kv_bytes=60 * GIB, host_pool_bytes=384 * GIB,
                                 device_buffer_size_rows=4096, admission_window_tokens=8192)
    c = concurrency_report(layout, 32768)
    usable = layout.device_blocks - 1
    assert c.max_concurrency_without_residency == usable // (6 * 512) == 38
    assert c.max_concurrency_steady_device == usable // (512 + 5 * (64 + ACTIVE_TAIL_PAGES)) == 140
    assert c.max_concurrency_at_admission == usable // (512 + 5 * (128 + 64)) == 80
    assert c.max_concurrency_host == layout.host_blocks // 512 == 261
    assert c.max_concurrency_steady == 140
    assert c.max_concurrency_steady / c.max_concurrency_without_residency > 3  # the point
    # A short context: the hot region and window are capped at the request's own pages.
    short = concurrency_report(layout, 1024)
    assert short.max_concurrency_steady_device == short.max_concurrency_without_residency


def test_choose_split_minimises_bytes_per_token_page():
    # Two 10-byte units, one 10-byte indexer layer: 2 sparse groups + 1 indexer at 10 B
    # (30 B/page) beats 1 + 1 at 20 B (40 B/page).
    choice = choose_split([10, 10], [10])
    assert (choice.sparse_parts, choice.indexer_parts, choice.bytes_per_block) == ([[0], [1]], [[0]], 10)
    # The group budget wins over density.
    tight = choose_split([10, 10], [10], max_groups=2)
    assert (tight.sparse_parts, tight.bytes_per_block) == ([[0, 1]], 20)
    # Alignment rounds the block up.
    assert choose_split([10], [3], alignment=16).bytes_per_block == 16
    with pytest.raises(ValueError, match="max_groups must be >= 2"):
        choose_split([1], [1], max_groups=1)


def test_critical_path_layers_with_index_share_prefetch():
    from dataclasses import replace

    from vllm_hisparse.core.capacity import GLM_52_FP8, critical_path_layers

    # An indexer in every layer: nothing to prefetch.
    assert critical_path_layers(DEEPSEEK_V32_FP8) == 61
    # GLM-5.2: 78 layers over 21 leaders = 15 groups of 4 and 6 of 3; 2 layers of each exposed.
    assert critical_path_layers(GLM_52_FP8) == 21 * 2 == 42
    assert critical_path_layers(GLM_52_FP8, first_launch_layers=1) == 21
    geo = lambda layers, groups: replace(DEEPSEEK_V32_FP8, num_sparse_layers=layers,
                                         num_indexer_layers=groups)
    assert critical_path_layers(geo(8, 1)) == 2      # the benchmark's default geometry
    assert critical_path_layers(geo(8, 2)) == 4      # groups of 4 (GLM-5.2-like)
    assert critical_path_layers(geo(5, 3)) == 2 + 2 + 1  # groups of 2, 2 and 1
    assert critical_path_layers(geo(5, 3), first_launch_layers=3) == 5
    with pytest.raises(ValueError, match="first_launch_layers must be >= 1"):
        critical_path_layers(geo(8, 1), first_launch_layers=0)
    with pytest.raises(ValueError, match="9 index groups for 8 sparse layers"):
        critical_path_layers(geo(8, 9))
