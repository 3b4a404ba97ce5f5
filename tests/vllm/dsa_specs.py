"""DSA-shaped per-layer KV specs built from vLLM's real ``kv_cache_interface`` classes.

They mirror what vLLM 0.33's layers report: ``MLAAttention.get_kv_cache_spec``
(``fp8_ds_mla``: one 656 B opaque row per token, ``is_index_group_leader`` when the
layer runs an indexer) and ``DeepseekV32IndexerCache.get_kv_cache_spec`` (132 B rows:
128 fp8 values + a 4 B scale, ``cache_role=INDEXER``).
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole, get_kv_quant_mode

MLA_ROW_BYTES = 656
INDEXER_ROW_BYTES = 132


def sparse_mla_spec(block_size: int = 64, *, leader: bool = True) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
        state_content_bytes=MLA_ROW_BYTES,
        topk_buffer_width=2048,
        is_index_group_leader=leader,
    )


def indexer_spec(block_size: int = 64) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=INDEXER_ROW_BYTES,
        dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER,
    )


def mla_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def indexer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.indexer.k_cache"


def dsa_layer_specs(
    num_layers: int, *, leaders: set[int] | None = None, block_size: int = 64
) -> dict[str, MLAAttentionSpec]:
    """Per-layer specs in model order; ``leaders`` (default: all) run an indexer."""
    specs: dict[str, MLAAttentionSpec] = {}
    for layer in range(num_layers):
        leader = leaders is None or layer in leaders
        specs[mla_name(layer)] = sparse_mla_spec(block_size, leader=leader)
        if leader:
            specs[indexer_name(layer)] = indexer_spec(block_size)
    return specs


def deepseek_v32_specs() -> dict[str, MLAAttentionSpec]:
    """DeepSeek-V3.2: 61 layers, each with its own indexer."""
    return dsa_layer_specs(61)


def glm_index_share_specs() -> dict[str, MLAAttentionSpec]:
    """GLM-5.2-like: 78 layers; every third layer runs the indexer (IndexShare), the
    two after it reuse its top-k."""
    return dsa_layer_specs(78, leaders={layer for layer in range(78) if layer % 3 == 0})
