"""The residency-aware manager for the sparse-MLA KV cache groups.

vLLM's ``FullAttentionManager`` owns one lease per block in a request's block table
and returns all of them to the pool when the request is freed (finish, abort *and*
preemption: ``Scheduler._preempt_request`` frees without any connector hook first).
Under residency the core policy owns the leases of a request's pages once it has
adopted them, releases some of them while the request runs, and returns the rest on
finish. Freeing them again through vLLM would be a double free.

:class:`ResidencyAwareManager` therefore asks its owner (the connector's scheduler
role, bound through :meth:`bind_residency`) which of a request's blocks vLLM must still
free: only those the policy never adopted (the tail vLLM allocated ahead, e.g. for
lookahead slots, or a request that never reached the policy). The owner learns of the
free at the same moment, for every path, and ends the request in the policy.

A page whose released block was reused becomes vLLM's null block in the request's
block table (:meth:`null_page`), so nothing that reads the table (other connectors, the
finish hook) sees a block the request no longer owns; a page restored to the device
gets its new block back (:meth:`set_page`).

On the sparse-MLA groups the manager keeps a device prefix-cache hit longer than the
one every group shares (``retains_longer_hit``, vLLM's hook for tiers that still hold a
prefix the other groups lost): when a connector loads the pages past the shared hit, the
sparse groups get their cached blocks back for the pages still on the device instead of
fresh ones. This is what makes ``OffloadingConnector`` correct next to us (it loads only
the indexer groups, up to the sparse groups' own hit), and it lets our host-prefix loads
skip the sparse-MLA pages still cached (``HostPrefixService``). vLLM trims the kept blocks
to the loaded range at allocation, so with nothing loaded it changes nothing.

Unbound (connector not configured, or not bound yet) the manager is exactly a
``FullAttentionManager``, apart from that retention. It is selected per group through a group role
(``compat.RESIDENCY_GROUP_ROLE``) registered with vLLM's ``KVCacheSpecRegistry``.

Which groups get it (:func:`residency_manager_group_ids`): the sparse-MLA groups (bound)
and every other group vLLM would give a plain ``FullAttentionManager`` (left unbound,
so they behave exactly as before). The reason is speed, not behaviour: vLLM calls the
same manager methods on every group in turn (``for manager in single_type_managers``)
and CPython specialises each attribute load and call site for one type. A coordinator
holding ``ResidencyAwareManager`` and ``FullAttentionManager`` side by side makes those
sites miss on every step (the cost, measured: docs/vllm-integration.md, "Scheduler
overhead").
"""

from __future__ import annotations

from typing import Any, Protocol

import dataclasses

from vllm_hisparse.vllm.compat import FullAttentionManager, KVCacheBlock, KVCacheGroupSpec, KVCacheSpecRegistry
from vllm_hisparse.vllm.setup.kv_plan import is_target_sparse_spec

#: ``KVCacheGroupSpec.role`` of a group nobody gave a role.
_DEFAULT_GROUP_ROLE = {f.name: f for f in dataclasses.fields(KVCacheGroupSpec)}["role"].default


def residency_manager_group_ids(kv_cache_config: Any, sparse_group_ids: tuple[int, ...]) -> tuple[int, ...]:
    """KV cache groups to build with :class:`ResidencyAwareManager`, ascending.

    ``sparse_group_ids`` (the groups the connector binds) plus every group without a
    role whose manager would otherwise be exactly ``FullAttentionManager`` (those stay
    unbound, i.e. behave as ``FullAttentionManager``): one manager class for all of them
    keeps vLLM's per-group call sites monomorphic (module docstring). Groups with another
    manager (sliding window, Mamba, ...) or a role of their own are left alone.
    """
    groups = kv_cache_config.kv_cache_groups
    bad = [g for g in sparse_group_ids if not 0 <= g < len(groups)]
    if bad:
        raise ValueError(f"sparse group ids {bad} out of range for {len(groups)} KV cache groups")
    ids = set(sparse_group_ids)
    for group_id, group in enumerate(groups):
        if group.role != _DEFAULT_GROUP_ROLE:
            continue
        if KVCacheSpecRegistry.get_manager_class(group.kv_cache_spec, group.role) is FullAttentionManager:
            ids.add(group_id)
    return tuple(sorted(ids))


class ResidencyOwner(Protocol):
    """What the manager needs from the connector's scheduler role."""

    def on_blocks_freed(self, group_index: int, request_id: str, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """The request's blocks in this sparse group are being freed (finish, abort or
        preemption). Return the ones vLLM must still return to the pool."""
        ...

    def import_null_pages(self, request_id: str, num_external_tokens: int, num_local_tokens: int) -> int:
        """Leading pages of a waiting request to leave null while vLLM allocates its
        external tokens (a P/D import landing in the host tier: ``pd/landings.py``)."""
        ...


class ResidencyAwareManager(FullAttentionManager):
    """``FullAttentionManager`` whose page leases may belong to the residency policy."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._owner: ResidencyOwner | None = None
        self._sparse_index = -1
        # Read by vLLM when it builds the KVCacheManager (module docstring).
        self.retains_longer_hit = is_target_sparse_spec(self.kv_cache_spec)

    def bind_residency(self, owner: ResidencyOwner, sparse_index: int) -> None:
        """Hand lease decisions for this group to ``owner``; ``sparse_index`` is this
        group's position among the sparse groups (0 = the bundle's lead group)."""
        self._owner = owner
        self._sparse_index = int(sparse_index)

    @property
    def residency_bound(self) -> bool:
        return self._owner is not None

    # ------------------------------------------------------- P/D host landing
    # A request whose imported prefix lands in the host tier gets vLLM's null block for
    # every sparse page but its tail (``pd/landings.py``). vLLM allocates external tokens with
    # ``allocate_external_computed_blocks`` (rare: overridden here) after sizing the
    # allocation with ``get_num_blocks_to_allocate`` (every request, every step: only
    # shadowed on the instance while a host landing is being offered).
    def track_import_offers(self, pending: bool) -> None:
        """Count offered host landings' null pages in vLLM's allocation check, or stop."""
        if pending:
            self.get_num_blocks_to_allocate = self._blocks_to_allocate_with_import
        else:
            self.__dict__.pop("get_num_blocks_to_allocate", None)

    def _blocks_to_allocate_with_import(self, request_id: str, num_tokens: int, new_computed_blocks,
                                        total_computed_tokens: int, num_local_computed_tokens: int,
                                        *args, **kwargs) -> int:
        num = FullAttentionManager.get_num_blocks_to_allocate(
            self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, *args, **kwargs)
        if self._owner is None or request_id in self.num_cached_block:
            return num
        skip = self._owner.import_null_pages(request_id, total_computed_tokens - num_local_computed_tokens,
                                             num_local_computed_tokens)
        return max(num - skip, 0)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int, *args, **kwargs) -> None:
        if self._owner is not None:
            skip = self._owner.import_null_pages(request_id, num_external_computed_tokens,
                                                 num_local_computed_tokens)
            if skip:
                self.req_to_blocks[request_id].extend([self._null_block] * skip)
        super().allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                  num_external_computed_tokens, *args, **kwargs)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        if self._owner is None:
            return super().pop_blocks_for_free(request_id)
        # Our own pop: the base trims leading null blocks, which would shift page
        # indices; the owner needs the table as it is (nulls included).
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        return self._owner.on_blocks_freed(self._sparse_index, request_id, blocks)

    # -------------------------------------------------------------- table edits
    def null_page(self, request_id: str, page: int) -> None:
        """The page's block was reused: the request reads this page from host now."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is not None and page < len(blocks):
            blocks[page] = self._null_block

    def set_page(self, request_id: str, page: int, block: KVCacheBlock) -> None:
        """The page is resident again in ``block`` (a restore the policy leased)."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is not None and page < len(blocks):
            blocks[page] = block
