"""Capacity math: DeepSeek-V3.2 numbers worked by hand."""

from __future__ import annotations

import pytest

from vllm_hisparse.core import (
    ACTIVE_TAIL_PAGES,
    DEEPSEEK_V32_BF16,
    DEEPSEEK_V32_FP8,
    bytes_per_token,
    default_device_buffer_size_rows,
    host_memory,
    max_concurrency,
)

GIB = 1 << 30


def test_bytes_per_token_per_tier_deepseek_v32():
    """61 layers: fp8_ds_mla 656 B + indexer 132 B per row; bf16 1152 B."""
    fp8 = bytes_per_token(DEEPSEEK_V32_FP8)
    assert fp8.device_full_bytes == 61 * (656 + 132) == 48_068
    assert fp8.device_mixed_bytes == 61 * 132 == 8_052
    assert fp8.host_bytes == 61 * 656 == 40_016
    assert bytes_per_token(DEEPSEEK_V32_BF16).host_bytes == 61 * 1152


def test_default_hot_region_is_top_k_times_decode_rows_plus_one():
    assert default_device_buffer_size_rows(DEEPSEEK_V32_FP8) == 4096
    assert default_device_buffer_size_rows(DEEPSEEK_V32_FP8, max_decode_query_len=2) == 6144


def test_host_memory_logical_vs_physical():
    """host_pool_gib is per DP replica; private TP pools multiply the physical footprint."""
    shared = host_memory(384, DEEPSEEK_V32_FP8, tp_size=8, dp_replicas_per_node=1, shared_across_tp=True)
    block_bytes = 64 * 656 * 61
    assert shared.host_block_bytes == block_bytes
    assert shared.num_host_blocks == 384 * GIB // block_bytes
    assert shared.usable_logical_gib <= 384 and shared.usable_logical_gib > 383.9
    assert shared.physical_gib_per_node == pytest.approx(shared.usable_logical_gib)
    private = host_memory(384, DEEPSEEK_V32_FP8, tp_size=8, dp_replicas_per_node=2, shared_across_tp=False)
    assert private.physical_gib_per_node == pytest.approx(16 * private.usable_logical_gib)


def test_max_concurrency_admission_vs_steady_state():
    """32K context, 4096 hot rows, 60 GiB of device KV, 384 GiB host."""
    geo = DEEPSEEK_V32_FP8
    device = 60 * GIB
    host_blocks = host_memory(384, geo).num_host_blocks
    c = max_concurrency(geo, device_kv_bytes=device, num_host_blocks=host_blocks, context_tokens=32768,
                        device_buffer_size_rows=4096, admission_window_tokens=8192)
    assert c.device_bytes_full_request == 32768 * 48_068
    steady = 32768 * 8_052 + (4096 + ACTIVE_TAIL_PAGES * 64) * 61 * 656
    assert c.device_bytes_steady_request == steady
    assert c.full_only == device // (32768 * 48_068)  # 40
    assert c.steady_state_device == device // steady
    assert c.steady_state_host == host_blocks // 512
    assert c.steady_state == min(c.steady_state_device, c.steady_state_host)
    admit = 32768 * 8_052 + 8192 * 61 * 656
    assert c.at_admission == min(1 + (device - admit) // steady, c.steady_state_host)
    assert c.full_only < c.at_admission <= c.steady_state_device
    assert c.steady_state_device / c.full_only > 3  # ~3.7x: the point of the hierarchy


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
