"""Groups that move in lockstep: one KV cache group's answer stands for all of them.

Our plan splits a DSA model's layers into several KV cache groups (``kv_planner``: five
sparse-MLA groups and one indexer group for DeepSeek-V3.2) where vLLM's default planner
makes one. vLLM's ``KVCacheCoordinator`` then runs every per-request, per-step manager
call once per group (``for manager in single_type_managers``): at 256 running requests
that loop, not the work inside it, nearly doubled vLLM's own ``schedule()`` +
``update_from_output()`` (docs/benchmarks.md, "Scheduler cost against stock vLLM", has the
figures).

The groups of our plan are all full attention with one block size, and vLLM allocates,
caches and frees them together, so every request holds the same number of blocks in each
of them and has cached the same number of blocks in each. A decode step that needs no new
block in the first group needs none in any, and one that completes no block there
completes none anywhere. :class:`LockstepCoordinator` answers those steps from the first
group alone and runs vLLM's own loop otherwise:

* ``get_num_blocks_to_allocate`` for a running request (no new prefix hit): the first
  group's count times the number of groups;
* ``allocate_new_blocks``: nothing to allocate in the first group means nothing anywhere;
* ``cache_blocks``: no newly full block in the first group means none anywhere;
* ``remove_skipped_blocks``: full attention never skips a block (vLLM's managers return at
  once); the loop is dropped.

It is vLLM's ``HybridKVCacheCoordinator`` with those four methods overridden, put on the
scheduler's coordinator object (``patches.LOCKSTEP_COORDINATOR``) only when
:func:`lockstep_groups` holds; every other path (prefix-cache lookups, admission with hits,
frees) is vLLM's. ``tests/vllm/test_lockstep.py`` runs workloads with prefix hits,
preemptions and chunked prefills with and without it and compares every scheduler output.
"""

from __future__ import annotations

from typing import Any

from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm import compat


def lockstep_groups(coordinator: Any) -> bool:
    """Whether every KV cache group of ``coordinator`` moves in lockstep with the first:
    a hybrid coordinator whose managers are all full attention (``FullAttentionManager``
    or our subclass of it), with one block size equal to the hash block size (no partial
    prefix hits), one caching setting and no EAGLE last-block drop. (The prefix-cache
    retention interval only changes sliding-window groups.)"""
    if type(coordinator) is not compat.hybrid_coordinator_class():
        return False
    managers = coordinator.single_type_managers
    if len(managers) < 2:
        return False
    full = compat.FullAttentionManager
    first = managers[0]
    return (
        all(isinstance(m, full) and type(m).remove_skipped_blocks is full.remove_skipped_blocks
            for m in managers)
        and all(m.block_size == first.block_size for m in managers)
        and first.block_size == coordinator.hash_block_size
        and len({m.enable_caching for m in managers}) == 1
        and len({m.kv_cache_spec.prefix_cacheable for m in managers}) == 1
        and not coordinator.drop_eagle_group_ids
        and not any(m.use_eagle for m in managers)
        and not coordinator.enable_partial_hash_hits
    )


class LockstepCoordinator(compat.hybrid_coordinator_class()):  # type: ignore[misc]
    """vLLM's hybrid coordinator, answering lockstep steps from the first group (module
    docstring). Put on an existing coordinator object; it adds no state."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks,
                                   num_encoder_tokens: int, total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        first = self.single_type_managers[0]
        if request_id in first.num_cached_block and not apply_admission_cap:
            # A running request: no new prefix hit, the same table length in every group.
            held = len(first.req_to_blocks.get(request_id, ()))
            return max(cdiv(num_tokens, first.block_size) - held, 0) * len(self.single_type_managers)
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, num_encoder_tokens, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0):
        first = self.single_type_managers[0]
        blocks = first.req_to_blocks.get(request_id)
        if blocks is not None and cdiv(num_tokens, first.block_size) <= len(blocks):
            return self._no_new_blocks
        return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model,
                                           num_encoder_tokens)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        first = self.single_type_managers[0]
        if not first.enable_caching or not first.kv_cache_spec.prefix_cacheable:
            return
        num_tokens = self.get_num_cacheable_tokens(num_computed_tokens, 0)
        num_hashed = len(request.block_hashes) * first.block_pool.hash_block_size
        full = min(num_tokens, num_hashed) // first.block_size
        if first.num_cached_block.get(request.request_id, 0) >= full:
            return
        super().cache_blocks(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None  # full attention skips nothing (lockstep_groups checks the managers)

    @property
    def _no_new_blocks(self) -> tuple[list, ...]:
        # A fresh tuple of empty lists each time: callers may extend them.
        return tuple([] for _ in self.single_type_managers)
