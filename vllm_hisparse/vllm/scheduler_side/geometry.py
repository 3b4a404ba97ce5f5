"""What the scheduler role's parts know about the engine and never change: block size,
KV cache groups, step budgets, the configured limits. Read once, when the role is built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.setup.config import HiSparseResidencyConfig
from vllm_hisparse.vllm.setup.kv_plan import indexer_group_ids, sparse_group_ids


@dataclass(frozen=True)
class SchedulerGeometry:
    """Engine facts shared by the scheduler role's parts (module docstring)."""

    block_size: int
    sparse_group_ids: tuple[int, ...]
    indexer_group_ids: tuple[int, ...]
    num_kv_groups: int
    max_model_len: int
    max_chunk_tokens: int  # vLLM's max_num_batched_tokens: one step's prefill budget
    max_decode_query_len: int  # more known tokens left than this is a prefill (R1)
    hot_blocks_per_request: int
    eager_host_mirror: bool
    load_failure_policy: str  # vLLM's kv_load_failure_policy

    @classmethod
    def of_engine(cls, vllm_config: Any, hisparse_config: HiSparseResidencyConfig,
                  kv_cache_config: Any) -> SchedulerGeometry:
        return cls(
            block_size=hisparse_config.block_size,
            sparse_group_ids=sparse_group_ids(kv_cache_config),
            indexer_group_ids=indexer_group_ids(kv_cache_config),
            num_kv_groups=len(kv_cache_config.kv_cache_groups),
            max_model_len=vllm_config.model_config.max_model_len,
            max_chunk_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            max_decode_query_len=max(1, int(hisparse_config.max_decode_query_len)),
            hot_blocks_per_request=hisparse_config.hot_blocks_per_request,
            eager_host_mirror=hisparse_config.eager_host_mirror,
            load_failure_policy=compat.kv_load_failure_policy(vllm_config),
        )

    @property
    def num_sparse_groups(self) -> int:
        return len(self.sparse_group_ids)

    def bundles_for_pages(self, pages: int) -> int:
        """Policy blocks (page bundles of the sparse groups) that free the vLLM blocks
        ``pages`` pages need in every KV cache group."""
        return cdiv(pages * self.num_kv_groups, len(self.sparse_group_ids))

    def host_pages_for(self, request: Any) -> int:
        """Host pages that back ``request`` for its whole length (prompt + ``max_tokens``,
        capped at ``max_model_len``)."""
        max_tokens = getattr(request, "max_tokens", None) or 0
        total = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        return cdiv(max(total, 1), self.block_size)
