"""DSA-shaped per-layer KV specs built from vLLM's real ``kv_cache_interface`` classes.

The builders live in the package (``vllm_hisparse.vllm.simulation.model``) because
``vllm-hisparse simulate`` needs them too; this module re-exports them for the tests.
"""

from __future__ import annotations

from vllm_hisparse.vllm.simulation.model import (  # noqa: F401  (re-exports)
    INDEXER_ROW_BYTES,
    MLA_ROW_BYTES,
    deepseek_v32_specs,
    dsa_layer_specs,
    glm_index_share_specs,
    indexer_name,
    indexer_spec,
    mla_name,
    sparse_mla_spec,
)
