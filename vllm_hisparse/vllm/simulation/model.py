"""A tiny offline DSA model for vLLM's real config objects: generated, never downloaded.

``ModelConfig`` reads only ``config.json`` when the tokenizer is skipped, so a directory
holding a DeepSeek-V3.2-shaped config is enough to build a real ``VllmConfig``; the per-layer
KV cache specs are built from vLLM's own ``kv_cache_interface`` classes, as vLLM 0.33's layers
report them (``MLAAttention.get_kv_cache_spec``: one 656 B ``fp8_ds_mla`` row per token,
``is_index_group_leader`` when the layer runs an indexer; ``DeepseekV32IndexerCache``: 132 B
rows, ``cache_role=INDEXER``). Options vLLM itself normalises on a CPU-only platform (hybrid
KV manager, KV layout) are set on the real object after construction, which is what the
engine core sees once they are resolved on a GPU host.

Used by ``vllm-hisparse simulate``, the scheduler benchmarks and the tests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from vllm_hisparse.vllm.compat import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    MLAAttentionSpec,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SparseCacheRole,
    SpeculativeConfig,
    VllmConfig,
    get_kv_quant_mode,
)

CONNECTOR = "HiSparseResidencyConnector"
MLA_ROW_BYTES = 656
BF16_MLA_ROW_BYTES = 1152
INDEXER_ROW_BYTES = 132

DSV32_TINY: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_topk": 2048,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 65536,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
}


def write_model_dir(root: Path, *, with_index_topk: bool = True, index_topk: int | None = None,
                    num_hidden_layers: int | None = None,
                    max_position_embeddings: int | None = None) -> Path:
    """A directory with a tiny DSA (or, without index_topk, plain MLA) ``config.json``.

    ``index_topk`` overrides the indexer's k (the default hot region is k rows, so a small k
    keeps runs on small device pools); ``max_position_embeddings`` raises the model's length
    limit (64K) for longer workloads."""
    config = dict(DSV32_TINY)
    if index_topk is not None:
        config["index_topk"] = index_topk
    if num_hidden_layers is not None:
        config["num_hidden_layers"] = num_hidden_layers
    if max_position_embeddings is not None:
        config["max_position_embeddings"] = max(config["max_position_embeddings"],
                                                max_position_embeddings)
    if not with_index_topk:
        config = {k: v for k, v in config.items() if not k.startswith("index_")}
        config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def kv_transfer_config(
    extra: dict[str, Any] | None = None, *, under_multi: bool = False
) -> KVTransferConfig:
    """Our connector, alone or as a MultiConnector child next to another connector."""
    extra = {"host_pool_gib": 4} if extra is None else extra
    if not under_multi:
        return KVTransferConfig(
            kv_connector=CONNECTOR, kv_role="kv_both", kv_connector_extra_config=extra
        )
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": CONNECTOR, "kv_role": "kv_both",
                 "kv_connector_extra_config": extra},
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 28}},
            ]
        },
    )


def make_vllm_config(
    model_dir: Path,
    *,
    kv_transfer: KVTransferConfig | None = None,
    max_model_len: int = 8192,
    block_size: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    enable_prefix_caching: bool = True,
    async_scheduling: bool = False,
    pipeline_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    hybrid_kv_cache_manager: bool = True,
    kv_cache_layout: str | None = "BLHNC",
    device: str = "cpu",
    num_speculative_tokens: int = 0,
) -> VllmConfig:
    """A real ``VllmConfig`` over ``model_dir`` (no tokenizer, no Hub access); with
    ``num_speculative_tokens`` > 0, MTP speculative decoding of that many drafts."""
    model_config = ModelConfig(
        model=str(model_dir),
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    # TP > 1: vLLM's multiprocess executor ("mp") on one node, as it picks by default.
    parallel_config = ParallelConfig(pipeline_parallel_size=pipeline_parallel_size,
                                     tensor_parallel_size=tensor_parallel_size)
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        ),
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        ),
        parallel_config=parallel_config,
        device_config=DeviceConfig(device),
        kv_transfer_config=kv_transfer,
        speculative_config=(
            SpeculativeConfig(method="mtp", num_speculative_tokens=num_speculative_tokens,
                              target_model_config=model_config,
                              target_parallel_config=parallel_config)
            if num_speculative_tokens else None),
    )
    # A CPU-only platform reports no hybrid-KV-manager support, so vLLM turns it off;
    # on a GPU it defaults to on. Set the GPU value on the real object.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid_kv_cache_manager
    # The engine core resolves the layout from the backends before planning; the DSA
    # backends resolve to BLHNC (block-outermost).
    vllm_config.cache_config.kv_cache_layout = kv_cache_layout
    return vllm_config


# ---------------------------------------------------------------------------- KV specs


#: Sparse-MLA row formats the specs can take: ``fp8_ds_mla`` (DeepSeek-V3.2) and bf16 (GLM-5.x).
MLA_ROW_FORMATS = {MLA_ROW_BYTES: "fp8_ds_mla", BF16_MLA_ROW_BYTES: "auto"}


def sparse_mla_spec(block_size: int = 64, *, leader: bool = True,
                    row_bytes: int = MLA_ROW_BYTES) -> MLAAttentionSpec:
    """One sparse-MLA layer's spec: 656 B ``fp8_ds_mla`` rows, or 1152 B bf16 rows (576
    elements) with ``row_bytes=1152``."""
    if row_bytes not in MLA_ROW_FORMATS:
        raise ValueError(f"sparse-MLA rows of {row_bytes} B: expected one of "
                         f"{', '.join(map(str, MLA_ROW_FORMATS))}")
    if row_bytes == BF16_MLA_ROW_BYTES:
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, max_tp_shards=1,
                                head_size=576, dtype=torch.bfloat16, cache_dtype_str="auto",
                                topk_buffer_width=2048, is_index_group_leader=leader)
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
    num_layers: int, *, leaders: set[int] | None = None, block_size: int = 64,
    num_draft_layers: int = 0, row_bytes: int = MLA_ROW_BYTES,
) -> dict[str, MLAAttentionSpec]:
    """Per-layer specs in model order; ``leaders`` (default: all) run an indexer, the layers
    after a leader reuse its top-k (GLM-5.x IndexShare). ``num_draft_layers`` MTP layers
    (each a DSA layer with its own indexer, ``is_draft=True``) follow the target layers.
    ``row_bytes``: the sparse-MLA row format (:func:`sparse_mla_spec`)."""
    specs: dict[str, MLAAttentionSpec] = {}
    for layer in range(num_layers):
        leader = leaders is None or layer in leaders
        specs[mla_name(layer)] = sparse_mla_spec(block_size, leader=leader, row_bytes=row_bytes)
        if leader:
            specs[indexer_name(layer)] = indexer_spec(block_size)
    for layer in range(num_layers, num_layers + num_draft_layers):
        specs[mla_name(layer)] = dataclasses.replace(sparse_mla_spec(block_size), is_draft=True)
        specs[indexer_name(layer)] = dataclasses.replace(indexer_spec(block_size), is_draft=True)
    return specs


def deepseek_v32_specs() -> dict[str, MLAAttentionSpec]:
    """DeepSeek-V3.2: 61 layers, each with its own indexer."""
    return dsa_layer_specs(61)


def glm_index_share_specs() -> dict[str, MLAAttentionSpec]:
    """GLM-5.2-like: 78 layers; every third layer runs the indexer (IndexShare), the two
    after it reuse its top-k."""
    return dsa_layer_specs(78, leaders={layer for layer in range(78) if layer % 3 == 0})
