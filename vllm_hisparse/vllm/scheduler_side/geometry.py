"""What the scheduler role's parts know about the engine and never change: block size,
KV cache groups, step budgets, the configured limits. Read once, when the role is built,
together with the residency policy's configuration derived from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hisparse.core.policy import PolicyConfig
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

    def policy_config(self, sched: Any, kv_cache_config: Any, hisparse_config: HiSparseResidencyConfig) -> PolicyConfig:
        """The residency policy's configuration for this engine (``sched``: vLLM's
        ``SchedulerConfig``)."""
        bs = self.block_size
        low, high = self._pressure_watermarks(sched, kv_cache_config)
        return PolicyConfig(
            block_size=bs,
            max_num_rows=sched.max_num_seqs,
            max_pages_per_request=cdiv(self.max_model_len, bs),
            device_buffer_size_rows=hisparse_config.device_buffer_size,
            admission_window_pages=cdiv(self.max_chunk_tokens, bs),
            eager_host_mirror=self.eager_host_mirror,
            low_watermark_blocks=low,
            high_watermark_blocks=high,
            hot_sizing=hisparse_config.hot_sizing(),
        )

    def _pressure_watermarks(self, sched: Any, kv_cache_config: Any) -> tuple[int, int]:
        """Pressure watermarks, in page bundles, sized to what one vLLM step allocates.

        The policy relieves pressure only at the end of a step, after vLLM allocated
        (and, failing that, preempted). So the low watermark covers the most one step
        can ask for: a full prefill budget of pages plus one page crossing per running
        request, in every group, converted to bundles of the sparse groups (capped at
        half the pool). The high watermark adds one hot region and 5 % of the pool on
        top (hysteresis). On top of that, demand the connector sees is reported each
        step (``note_device_demand``): the next chunks of prefilling requests, a waiting
        request vLLM could not admit, an allocation that failed.

        A low watermark of decode growth only, relying on the reported demand for prefills
        and admissions, was measured and was not a clear win (docs/vllm-integration.md), so
        the worst-case sizing stays.
        """
        num_sparse = self.num_sparse_groups
        step_pages = cdiv(self.max_chunk_tokens, self.block_size) + min(
            sched.max_num_seqs, self.max_chunk_tokens
        )
        step_blocks = step_pages * self.num_kv_groups
        bundles = (kv_cache_config.num_blocks - 1) // num_sparse
        low = min(cdiv(step_blocks, num_sparse), bundles // 2)
        high = min(low + self.hot_blocks_per_request + cdiv(bundles, 20), bundles)
        return low, max(high, low)
