"""Real ``vllm.config`` objects for a tiny offline DSA model (no Hub access, no GPU).

``ModelConfig`` only reads ``config.json`` when the tokenizer is skipped, so a
directory holding a DeepSeek-V3.2-shaped config is enough to build a real
``VllmConfig``. Options vLLM itself normalises on a CPU-only platform (hybrid KV
manager, DCP, cudagraph mode) are set on the real object after construction, which
is what the engine core sees once they are resolved on a GPU host.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,  # noqa: F401  (re-exported for tests that need it)
    VllmConfig,
)

CONNECTOR = "HiSparseResidencyConnector"

DSV32_TINY = {
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


def write_model_dir(root: Path, *, with_index_topk: bool = True, index_topk: int | None = None) -> Path:
    """A directory with a tiny DSA (or, without index_topk, plain MLA) config.json.

    ``index_topk`` overrides the indexer's k (the default hot region is k rows, so a
    small k keeps scheduler tests on small device pools)."""
    config = dict(DSV32_TINY)
    if index_topk is not None:
        config["index_topk"] = index_topk
    if not with_index_topk:
        config = {k: v for k, v in config.items() if not k.startswith("index_")}
        config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
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
    hybrid_kv_cache_manager: bool = True,
    kv_cache_layout: str | None = "BLHNC",
) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir),
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
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
        parallel_config=ParallelConfig(pipeline_parallel_size=pipeline_parallel_size),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer,
    )
    # A CPU-only platform reports no hybrid-KV-manager support, so vLLM turns it off;
    # on a GPU it defaults to on. Set the GPU value on the real object.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid_kv_cache_manager
    # The engine core resolves the layout from the backends before planning; the DSA
    # backends resolve to BLHNC (block-outermost).
    vllm_config.cache_config.kv_cache_layout = kv_cache_layout
    return vllm_config
