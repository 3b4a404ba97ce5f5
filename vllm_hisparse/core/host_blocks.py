"""The pinned host block pool, as the scheduler sees it: ids, reference counts, prefix identity.

Protocol (every call is O(blocks touched)):

* ``allocate(n)``    take ``n`` blocks with one lease each, evicting the least recently used
                     *unreferenced published* blocks if the free list is short; all or nothing;
                     raises :class:`HostPoolExhausted` (back-pressure) when even eviction cannot
                     cover it.
* ``touch(ids)``     one more lease per id (a prefix hit shares a published block).
* ``free(ids)``      one lease less per id; at zero a published block stays cached (evictable,
                     LRU), an unpublished one returns to the free list.
* ``publish(id, h)`` give a block the prefix identity ``h``. The caller must only publish a
                     block whose copy the worker reported *completed*; publication of a block
                     still in flight would let another request read garbage.
* ``lookup(hs)``     longest prefix of ``hs`` whose blocks are published (no lease taken).

The pool never holds data; the worker owns the pinned memory with the same block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Iterable, Sequence

import numpy as np

from vllm_hisparse.core.errors import HostPoolExhausted, ProtocolError


class HostBlockPool:
    """Reference-counted host blocks with prefix identity and LRU eviction.

    Args:
        num_blocks: capacity in blocks (``capacity.host_blocks_for_budget`` sizes it from a
            byte budget).
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"host pool needs at least one block, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.ref_counts = np.zeros(self.num_blocks, dtype=np.int32)
        # Stack of never-published free blocks; pop from the end.
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._is_free = np.ones(self.num_blocks, dtype=bool)
        # Published identity, both directions.
        self._hash_to_block: dict[Hashable, int] = {}
        self._block_to_hash: dict[int, Hashable] = {}
        # Unreferenced published blocks, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    # -- queries ----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (never published, or unpublished)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced published blocks (evictable)."""
        return len(self._evictable)

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks ``allocate`` can hand out right now (free + evictable)."""
        return len(self._free) + len(self._evictable)

    def is_published(self, block_id: int) -> bool:
        """True when the block carries a prefix identity."""
        return block_id in self._block_to_hash

    def is_free(self, block_id: int) -> bool:
        """True when the block is on the free list (no lease, no identity)."""
        return bool(self._is_free[block_id])

    def lookup(self, block_hashes: Sequence[Hashable]) -> list[int]:
        """Blocks of the longest published prefix of ``block_hashes`` (no lease taken)."""
        hits = []
        for block_hash in block_hashes:
            block_id = self._hash_to_block.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # -- leases -----------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks (all or nothing), evicting LRU cached blocks if needed.

        Raises:
            HostPoolExhausted: fewer than ``num_blocks`` free + evictable blocks. Nothing
                was changed; the caller should make the request wait.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        available = self.num_allocatable_blocks
        if num_blocks > available:
            raise HostPoolExhausted(
                f"host pool: {num_blocks} blocks requested, {available} free or evictable",
                num_requested=num_blocks,
                num_available=available,
            )
        taken = []
        for _ in range(num_blocks):
            if self._free:
                block_id = self._free.pop()
                self._is_free[block_id] = False
            else:
                block_id, _ = self._evictable.popitem(last=False)
                self._unpublish(block_id)
                self.num_evictions += 1
            self.ref_counts[block_id] = 1
            taken.append(block_id)
        return taken

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more lease per id; a cached block stops being evictable."""
        for block_id in block_ids:
            block_id = int(block_id)
            self._check_range(block_id)
            if self._is_free[block_id]:
                raise ProtocolError(f"host block {block_id} touched while free")
            if self.ref_counts[block_id] == 0:
                self._evictable.pop(block_id, None)
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one lease per id. Published blocks stay cached until evicted."""
        for block_id in block_ids:
            block_id = int(block_id)
            self._check_range(block_id)
            if self.ref_counts[block_id] <= 0:
                raise ProtocolError(f"host block {block_id} freed with no lease held")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if block_id in self._block_to_hash:
                    self._evictable[block_id] = None  # most recently used end
                else:
                    self._free.append(block_id)
                    self._is_free[block_id] = True

    # -- prefix identity --------------------------------------------------------------
    def publish(self, block_id: int, block_hash: Hashable) -> bool:
        """Give a held block the identity ``block_hash``.

        Only call this once the worker reported the block's copy *completed*.
        Returns False (and changes nothing) when the hash is already published by another
        block, or this block already has an identity: the first durable copy wins.
        """
        block_id = int(block_id)
        self._check_range(block_id)
        if self.ref_counts[block_id] <= 0:
            raise ProtocolError(f"host block {block_id} published without a lease")
        if block_hash in self._hash_to_block or block_id in self._block_to_hash:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        return True

    def evict_all_cached(self) -> int:
        """Drop every unreferenced published block (reset of the host prefix cache)."""
        count = 0
        while self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._unpublish(block_id)
            self._free.append(block_id)
            self._is_free[block_id] = True
            count += 1
        return count

    # -- internals --------------------------------------------------------------------
    def _unpublish(self, block_id: int) -> None:
        block_hash = self._block_to_hash.pop(block_id)
        del self._hash_to_block[block_hash]

    def _check_range(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ProtocolError(f"host block {block_id} out of range")
