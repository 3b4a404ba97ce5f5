"""Host memory this process registered with ``cudaHostRegister``, by address range.

The CUDA copy ops read and write host layers directly over UVA, so they refuse CPU tensors
that are not pinned (``Tensor.is_pinned()``). PyTorch does not report every registered range
as pinned: a file-backed ``MAP_SHARED`` mapping (the host pool that tensor-parallel ranks
share, ``worker/host_pool.py``) registers fine and is GPU-accessible, yet ``is_pinned()`` says
False. Whoever registers a range records it here, and the ops accept tensors that lie inside
a recorded range.
"""

from __future__ import annotations

import bisect
import threading

import torch

_lock = threading.Lock()
_starts: list[int] = []
_ends: list[int] = []


def add(ptr: int, num_bytes: int) -> None:
    """Record ``[ptr, ptr + num_bytes)`` as registered (call after ``cudaHostRegister``)."""
    if num_bytes <= 0:
        raise ValueError(f"host_ranges.add: num_bytes must be > 0, got {num_bytes}")
    with _lock:
        i = bisect.bisect_left(_starts, ptr)
        _starts.insert(i, int(ptr))
        _ends.insert(i, int(ptr) + int(num_bytes))


def remove(ptr: int) -> None:
    """Forget the range that starts at ``ptr`` (call before ``cudaHostUnregister``)."""
    with _lock:
        i = bisect.bisect_left(_starts, ptr)
        if i < len(_starts) and _starts[i] == ptr:
            del _starts[i]
            del _ends[i]


def extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to one past its last element (strided views included)."""
    if t.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def covers(t: torch.Tensor) -> bool:
    """Whether every byte of CPU tensor ``t`` lies in one recorded range."""
    start = t.data_ptr()
    end = start + extent_bytes(t)
    with _lock:
        i = bisect.bisect_right(_starts, start) - 1
        return i >= 0 and _ends[i] >= end
