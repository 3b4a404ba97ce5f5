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

Unbound (connector not configured, or not bound yet) the manager is exactly a
``FullAttentionManager``. It is selected per group through a group role
(``compat.RESIDENCY_GROUP_ROLE``) registered with vLLM's ``KVCacheSpecRegistry``.
"""

from __future__ import annotations

from typing import Protocol

from vllm_hisparse.vllm.compat import FullAttentionManager, KVCacheBlock


class ResidencyOwner(Protocol):
    """What the manager needs from the connector's scheduler role."""

    def on_blocks_freed(self, group_index: int, request_id: str, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """The request's blocks in this sparse group are being freed (finish, abort or
        preemption). Return the ones vLLM must still return to the pool."""
        ...


class ResidencyAwareManager(FullAttentionManager):
    """``FullAttentionManager`` whose page leases may belong to the residency policy."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._owner: ResidencyOwner | None = None
        self._sparse_index = -1

    def bind_residency(self, owner: ResidencyOwner, sparse_index: int) -> None:
        """Hand lease decisions for this group to ``owner``; ``sparse_index`` is this
        group's position among the sparse groups (0 = the bundle's lead group)."""
        self._owner = owner
        self._sparse_index = int(sparse_index)

    @property
    def residency_bound(self) -> bool:
        return self._owner is not None

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
