"""What the residency policy needs from a GPU block pool, plus an in-memory implementation.

The protocol is deliberately close to vLLM's ``BlockPool`` so that an adapter is thin:

=====================  =====================================================================
``get_new_blocks(n)``  take ``n`` free blocks (reference count 1 each); all or nothing
``free_blocks(ids)``   drop one lease per id; at zero the block's content is garbage
``release_readable``   drop one lease, but the content stays readable until the pool hands
                       the block to someone else; ``on_reuse(block_id)`` is called then
``touch(ids)``         take one more lease; a zero-lease block leaves the free queue, so a
                       released-but-unreused block can be re-pinned without a copy
``get_num_free_blocks`` free blocks, released-readable ones included
=====================  =====================================================================

Reuse callbacks are notifications, not ownership: the policy keeps its own map of which
page a released block backs and ignores callbacks that no longer match it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable, Protocol, runtime_checkable

import numpy as np

from vllm_hisparse.core.errors import DevicePoolExhausted, ProtocolError

ReuseCallback = Callable[[int], None]


@runtime_checkable
class DevicePool(Protocol):
    """A reference-counted pool of device KV blocks (ids ``0 .. num_blocks-1``)."""

    num_blocks: int

    def get_num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` could hand out now (released-readable ones included)."""
        ...

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks with one lease each; raise ``DevicePoolExhausted`` if short."""
        ...

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one lease per id. A block whose count reaches zero becomes free."""
        ...

    def release_readable(self, block_ids: Iterable[int], on_reuse: ReuseCallback) -> None:
        """Drop one lease per id, keeping the content readable until the block is reused.

        ``on_reuse(block_id)`` is called (synchronously, inside ``get_new_blocks``) when the
        block is handed out again.
        """
        ...

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more lease per id (re-pins a zero-lease block that was not reused yet)."""
        ...


class InMemoryDevicePool:
    """A ``DevicePool`` for the policy without vLLM's block pool (tests, ``bench core-step``).

    Free blocks sit in one ordered queue: plainly freed blocks go to the *front* (their
    content is garbage, so reuse them first); released-readable blocks go to the *back*
    (their content may still be read, so reuse them last). That ordering keeps readable
    copies alive as long as the pool can afford it.
    """

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.ref_counts = np.zeros(self.num_blocks, dtype=np.int32)
        self._free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.num_blocks))
        self._watchers: dict[int, list[ReuseCallback]] = {}
        # Counters for tests and metrics.
        self.num_reused_readable = 0

    # -- queries ----------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        """Number of zero-lease blocks (free or released-readable)."""
        return len(self._free_queue)

    def is_free(self, block_id: int) -> bool:
        """True when the block has no lease."""
        return block_id in self._free_queue

    def is_readable_released(self, block_id: int) -> bool:
        """True when the block has no lease but someone still watches its content."""
        return block_id in self._free_queue and block_id in self._watchers

    # -- protocol ---------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` from the front of the free queue (all or nothing)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        available = len(self._free_queue)
        if num_blocks > available:
            raise DevicePoolExhausted(
                f"device pool: {num_blocks} blocks requested, {available} free",
                num_requested=num_blocks,
                num_available=available,
            )
        taken = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            self.ref_counts[block_id] = 1
            taken.append(block_id)
        # Notify after every block is taken so that callbacks see a consistent pool.
        for block_id in taken:
            watchers = self._watchers.pop(block_id, None)
            if watchers:
                self.num_reused_readable += 1
                for callback in watchers:
                    callback(block_id)
        return taken

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one lease per id; garbage blocks go to the front of the free queue."""
        for block_id in block_ids:
            self._drop_lease(int(block_id))
            if self.ref_counts[block_id] == 0:
                self._free_queue[block_id] = None
                if block_id not in self._watchers:
                    self._free_queue.move_to_end(block_id, last=False)

    def release_readable(self, block_ids: Iterable[int], on_reuse: ReuseCallback) -> None:
        """Drop one lease per id; readable blocks go to the back of the free queue."""
        for block_id in block_ids:
            block_id = int(block_id)
            self._drop_lease(block_id)
            watchers = self._watchers.setdefault(block_id, [])
            if on_reuse not in watchers:
                watchers.append(on_reuse)
            if self.ref_counts[block_id] == 0:
                self._free_queue[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more lease per id, pulling zero-lease blocks out of the free queue."""
        for block_id in block_ids:
            block_id = int(block_id)
            if not 0 <= block_id < self.num_blocks:
                raise ProtocolError(f"device block {block_id} out of range")
            if self.ref_counts[block_id] == 0:
                del self._free_queue[block_id]
            self.ref_counts[block_id] += 1

    # -- internals --------------------------------------------------------------------
    def _drop_lease(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ProtocolError(f"device block {block_id} out of range")
        if self.ref_counts[block_id] <= 0:
            raise ProtocolError(f"device block {block_id} freed with no lease held")
        self.ref_counts[block_id] -= 1
