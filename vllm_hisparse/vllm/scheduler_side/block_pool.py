"""``core.DevicePool`` over vLLM's ``BlockPool``: one policy block = one block per sparse group.

The core policy thinks in *pages*: one device block per page. vLLM plans a DSA model's
sparse-MLA layers into ``G`` groups (``kv_planner``), and every group holds its own
block for every page, all drawn from the one shared ``BlockPool``. A page of the policy
is therefore a **bundle** of ``G`` vLLM blocks, one per sparse group, and the bundle
moves as a whole: released together, re-pinned together, lost together.

A bundle is named by its *lead* block: the block of the first sparse group. That is
the id the policy (and the worker's command) carries. ``bundle_block_ids(lead)`` gives
every group's block for the worker.

Bundles come from two places:

* pages vLLM's managers allocated (or prefix-hit) for a request: the connector passes
  the ``G`` block objects to :meth:`adopt`, which registers the bundle and returns the
  lead id; the lease the engine took is the policy's from then on;
* blocks the policy asks for (hot regions, restores): :meth:`get_new_blocks` takes
  ``G`` vLLM blocks per policy block.

Readable-until-reused: :meth:`release_readable` calls ``BlockPool.unpin_blocks`` on
every member with one vLLM reuse watcher. When vLLM hands *any* member out again the
page is gone for every group, so the policy's callback fires with the lead id. A
stale watcher (a member that left its bundle since) is ignored.

Free-block counts are in policy units: ``vLLM free blocks // G``. The pool is shared
with the indexer groups, so this is the capacity for new *sparse pages* if nothing
else allocated, which is what the policy's watermarks need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from vllm_hisparse.core.errors import DevicePoolExhausted, ProtocolError
from vllm_hisparse.vllm.compat import BlockPool, KVCacheBlock

ReuseCallback = Callable[[int], None]


class BlockPoolDevicePool:
    """A ``core.DevicePool`` whose blocks are bundles of ``num_groups`` vLLM blocks."""

    def __init__(self, block_pool: BlockPool, num_groups: int) -> None:
        if num_groups <= 0:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.block_pool = block_pool
        self.num_groups = int(num_groups)
        # The null block (id 0) is never handed out.
        self.num_blocks = (block_pool.num_gpu_blocks - 1) // self.num_groups
        # lead block id -> the bundle's blocks, in sparse-group order.
        self._bundles: dict[int, tuple[KVCacheBlock, ...]] = {}
        # member block id -> lead id of the bundle it was last registered in.
        self._lead_of: dict[int, int] = {}
        # lead id -> policy callbacks waiting for the bundle's reuse.
        self._watchers: dict[int, list[ReuseCallback]] = {}
        self.num_reused_readable = 0

    # ------------------------------------------------------------------ bundles
    def adopt(self, blocks: Sequence[KVCacheBlock]) -> int:
        """Register one page's blocks (one per sparse group, leases already taken by the
        engine) as a bundle; return its lead id. The caller's lease becomes the policy's."""
        if len(blocks) != self.num_groups:
            raise ProtocolError(f"a page needs {self.num_groups} blocks (one per sparse group), got {len(blocks)}")
        lead = blocks[0]
        if lead.is_null:
            raise ProtocolError("cannot adopt the null block as a page")
        self._register(tuple(blocks))
        return lead.block_id

    def bundle(self, lead_id: int) -> tuple[KVCacheBlock, ...]:
        """The blocks of bundle ``lead_id`` (one per sparse group)."""
        bundle = self._bundles.get(lead_id)
        if bundle is None:
            raise ProtocolError(f"device block {lead_id} is not a registered page bundle")
        return bundle

    def bundle_block_ids(self, lead_id: int) -> list[int]:
        """Block id of bundle ``lead_id`` in every sparse group (what the worker indexes)."""
        return [b.block_id for b in self.bundle(lead_id)]

    def _register(self, bundle: tuple[KVCacheBlock, ...]) -> None:
        lead_id = bundle[0].block_id
        self._bundles[lead_id] = bundle
        for block in bundle:
            self._lead_of[block.block_id] = lead_id

    def _members(self, block_ids: Iterable[int]) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        for lead_id in block_ids:
            out.extend(self.bundle(int(lead_id)))
        return out

    # ------------------------------------------------------------------ DevicePool
    def get_num_free_blocks(self) -> int:
        """Whole bundles the pool could hand out now (released-readable blocks included)."""
        return self.block_pool.get_num_free_blocks() // self.num_groups

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` bundles (``num_blocks * G`` vLLM blocks); all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        available = self.get_num_free_blocks()
        if num_blocks > available:
            raise DevicePoolExhausted(
                f"device pool: {num_blocks} page bundles requested, {available} free",
                num_requested=num_blocks,
                num_available=available,
            )
        # get_new_blocks fires the reuse watchers of the blocks it hands out (ours
        # included) before returning, so released pages are lost before we register.
        blocks = self.block_pool.get_new_blocks(num_blocks * self.num_groups)
        leads = []
        g = self.num_groups
        for i in range(num_blocks):
            bundle = tuple(blocks[i * g : (i + 1) * g])
            self._register(bundle)
            leads.append(bundle[0].block_id)
        return leads

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one lease on every member of each bundle."""
        members = self._members(block_ids)
        if members:
            self.block_pool.free_blocks(members)

    def release_readable(self, block_ids: Iterable[int], on_reuse: ReuseCallback) -> None:
        """Drop one lease per member, keeping the bundle readable until any member is reused."""
        leads = [int(b) for b in block_ids]
        members = self._members(leads)
        for lead_id in leads:
            watchers = self._watchers.setdefault(lead_id, [])
            if on_reuse not in watchers:
                watchers.append(on_reuse)
        if members:
            self.block_pool.unpin_blocks(members, self._on_vllm_reuse)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more lease on every member (re-pins a released, unreused bundle)."""
        members = self._members(block_ids)
        if members:
            self.block_pool.touch(members)

    # ------------------------------------------------------------------ reuse
    def _on_vllm_reuse(self, block: KVCacheBlock) -> None:
        """vLLM handed out a member of a released bundle: the whole page is gone."""
        lead_id = self._lead_of.get(block.block_id)
        if lead_id is None:
            return
        bundle = self._bundles.get(lead_id)
        if bundle is None or all(b is not block for b in bundle):
            return  # the member left this bundle since it was released
        watchers = self._watchers.pop(lead_id, None)
        if not watchers:
            return
        self.num_reused_readable += 1
        for callback in watchers:
            callback(lead_id)
