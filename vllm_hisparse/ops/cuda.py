"""CUDA implementations of the data-plane ops (DESIGN.md §4), launched through ``vllm_hisparse._C``.

The functions here assume inputs already validated by :mod:`vllm_hisparse.ops` (dtype, device,
shape, contiguity) and only add the checks the kernels themselves need (row sizes, alignment).
Every launch goes on the current CUDA stream of the tensors' device, allocates nothing after
the first call on a device and never synchronizes, so the ops can be captured in CUDA graphs.

Errors of ``resolve`` (DESIGN.md §4.1 rule 7) are recorded by the kernel in a 4-word device
buffer owned by this module (one per device; the first error wins), and the winning thread
also writes the record into a pinned host mirror over UVA. Every later call reads that mirror
(a plain memory read: no copy, no event, no sync) and raises
:class:`~vllm_hisparse.ops.errors.ResolveError` once an error has landed there.
:func:`check_errors` synchronizes the device and raises at once.
The request that failed gets ``out_rows = -1`` and ``miss_count = 0`` and keeps its ``slot_pos``,
``lru`` and ``stats`` untouched; the other requests of the launch are resolved normally.
"""

from __future__ import annotations

import os
import threading
from typing import Sequence

import torch

from vllm_hisparse.ops import _extension
from vllm_hisparse.ops.errors import ResolveError

__all__ = [
    "available",
    "check_errors",
    "copy_blocks",
    "gather_rows",
    "mirror_rows",
    "resolve",
    "set_max_tokens_per_request",
    "set_resolve_threads",
    "set_copy_tuning",
]

# Largest number of query tokens (1 + speculative tokens) of one request: sizes the
# shared-memory hash of resolve. A request whose union overflows it fails with
# ResolveErrorCode.UNION_CAPACITY; within a launch the bound is also capped by T.
_max_tokens_per_request = 4
# Threads per resolve CTA: 0 = default (1024) or 512 (only when D <= 8192). The environment
# variable HISPARSE_RESOLVE_THREADS sets the initial value (tests run both).
_resolve_threads = int(os.environ.get("HISPARSE_RESOLVE_THREADS", "0") or 0)
# Row-copy tuning (0 = the kernel's defaults, measured in benchmarks/bench_kernels.py).
# pair_major: work order of the (layer, pair) items. True: the layers of one (src, dst) pair
# are adjacent items, so a warp reads all layers of a row together (one or two translation
# pages in a position-major host pool). False: layer by layer. None (default): pair-major for
# a launch whose layers are row-strided on either side, layer-major for dense layers
# (measured on the H200 with a 24 GiB pool: docs/kernels.md "Host pool layout").
_copy_tuning = {"rows_per_warp": 0, "ctas_per_sm": 0, "pair_major": None}


def _module():
    module, why = _extension.load()
    if module is None or not getattr(module, "has_data_plane", False):
        raise RuntimeError(why or "vllm_hisparse._C was built without the data-plane kernels")
    return module


def available() -> bool:
    """True when the compiled extension provides the kernels."""
    module, _ = _extension.load()
    return module is not None and bool(getattr(module, "has_data_plane", False))


def set_max_tokens_per_request(n: int) -> None:
    """Bound on query tokens per request (default 4) used to size resolve's shared memory."""
    global _max_tokens_per_request
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"max tokens per request must be a positive int, got {n!r}")
    _max_tokens_per_request = n


def set_resolve_threads(n: int) -> None:
    """Threads per resolve CTA: 0 (default, 1024) or 512 (used only when D <= 8192)."""
    global _resolve_threads
    if n not in (0, 512, 1024):
        raise ValueError(f"resolve threads must be 0 (default), 512 or 1024, got {n!r}")
    _resolve_threads = n


def set_copy_tuning(rows_per_warp: int = 0, ctas_per_sm: int = 0,
                    pair_major: bool | None = None) -> None:
    """Rows in flight per warp (1, 2, 4, 8, 16; 0 = default), grid cap per SM (0 = default)
    and the work order (True: all layers of a row together; False: layer by layer; None:
    the default, pair-major exactly when the layer views are row-strided)."""
    if rows_per_warp not in (0, 1, 2, 4, 8, 16):
        raise ValueError(f"rows_per_warp must be 0, 1, 2, 4, 8 or 16, got {rows_per_warp!r}")
    if not isinstance(ctas_per_sm, int) or ctas_per_sm < 0:
        raise ValueError(f"ctas_per_sm must be a non-negative int, got {ctas_per_sm!r}")
    _copy_tuning["rows_per_warp"] = rows_per_warp
    _copy_tuning["ctas_per_sm"] = ctas_per_sm
    _copy_tuning["pair_major"] = None if pair_major is None else bool(pair_major)


# --------------------------------------------------------------------------------------
# error records
# --------------------------------------------------------------------------------------


class _ErrorState:
    """Error record of one device: a 4-word device buffer (the kernel's first-error-wins word)
    and a pinned host mirror that the kernel itself writes over UVA (details first, code last,
    with system fences), so the host polls it with a plain memory read: no copy, no event, no
    extra graph node, no sync."""

    def __init__(self, device: torch.device):
        self.device = device
        self.record = torch.zeros(4, dtype=torch.int32, device=device)
        self.host = torch.zeros(4, dtype=torch.int32).pin_memory()
        self.host_view = self.host.numpy()  # plain reads of the pinned words
        self.lock = threading.Lock()

    def poll(self) -> None:
        """Raise if a launch that has completed recorded an error; never waits."""
        if int(self.host_view[0]) != 0:
            self._raise(self.host_view.tolist())

    def check(self) -> None:
        """Wait for the device, then raise if any launch recorded an error."""
        torch.cuda.synchronize(self.device)
        words = self.record.tolist()
        if words[0] != 0:
            self._raise(words)

    def _raise(self, words: list[int]) -> None:
        code, row, a, b = (int(w) for w in words)
        # Clear both copies so the error is raised once. The device word is cleared on the
        # current stream (ordered after the launches that may still be writing it).
        self.host_view[:] = 0
        if not torch.cuda.is_current_stream_capturing():
            self.record.zero_()
        raise ResolveError(code, row, a, b)


_states: dict[int, _ErrorState] = {}
_states_lock = threading.Lock()


def _error_state(device: torch.device) -> _ErrorState:
    index = device.index if device.index is not None else torch.cuda.current_device()
    state = _states.get(index)
    if state is None:
        with _states_lock:
            state = _states.get(index)
            if state is None:
                state = _ErrorState(torch.device("cuda", index))
                _states[index] = state
    return state


def check_errors(device: torch.device | int | str | None = None) -> None:
    """Synchronize ``device`` (default: every device used so far) and raise the recorded
    :class:`ResolveError`, if any."""
    if device is None:
        states = list(_states.values())
    else:
        states = [_error_state(torch.device(device) if not isinstance(device, int)
                               else torch.device("cuda", device))]
    for state in states:
        state.check()


class _on_device:
    """Make ``device`` current for the launch when it is not already (cheap when it is)."""

    def __init__(self, device: torch.device):
        self.index = device.index
        self.prev = None

    def __enter__(self):
        if self.index is not None:
            cur = torch.cuda.current_device()
            if cur != self.index:
                self.prev = cur
                torch.cuda.set_device(self.index)
        return self

    def __exit__(self, *exc):
        if self.prev is not None:
            torch.cuda.set_device(self.prev)
        return False


# --------------------------------------------------------------------------------------
# resolve
# --------------------------------------------------------------------------------------


def resolve(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru, block_size,
            out_rows, miss_src, miss_dst, miss_count, stats=None) -> None:
    """DESIGN.md §4.1 on the GPU; see :func:`vllm_hisparse.ops.reference.resolve`.

    Errors surface on a later call (or :func:`check_errors`) as :class:`ResolveError`.
    """
    _resolve(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru, block_size,
             out_rows, miss_src, miss_dst, miss_count, stats)


def _resolve(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru, block_size,
             out_rows, miss_src, miss_dst, miss_count, stats=None, debug_times=None) -> None:
    """resolve; ``debug_times`` (int64 [10] on the device) receives %globaltimer stamps of the
    phase ends of CTA 0 (benchmarks; stamps 0-6, clock64 at 7-8, see docs/kernels.md), and
    ``debug_times[9]`` is raised by one for every request that the fast path hands to the
    general path."""
    if debug_times is not None and (debug_times.dtype != torch.int64 or debug_times.numel() < 10
                                    or debug_times.device != topk.device):
        raise ValueError("debug_times must be an int64 tensor of >= 10 elements on the device "
                         "of topk")
    device = topk.device
    state = _error_state(device)
    with state.lock:
        state.poll()
    num_tokens, k = topk.shape
    if num_tokens == 0:
        return
    module = _module()
    num_rows, num_pages = residency.shape
    num_slots = slot_pos.shape[1]
    with _on_device(device):
        stream = torch.cuda.current_stream(device)
        module.resolve(
            topk.data_ptr(), token_rows.data_ptr(), residency.data_ptr(),
            host_blocks.data_ptr(), hot_blocks.data_ptr(), slot_pos.data_ptr(), lru.data_ptr(),
            out_rows.data_ptr(), miss_src.data_ptr(), miss_dst.data_ptr(),
            miss_count.data_ptr(), 0 if stats is None else stats.data_ptr(),
            state.record.data_ptr(), state.host.data_ptr(), num_tokens, k, num_rows,
            num_pages, num_slots, int(block_size), _max_tokens_per_request, stream.cuda_stream,
            0 if debug_times is None else debug_times.data_ptr(), _resolve_threads)


def resolve_launch_info(num_tokens: int, k: int, num_slots: int, block_size: int,
                        num_pages: int = 0) -> dict:
    """Threads, shared memory, hash capacity (physical entries), union capacity (the
    UNION_CAPACITY bound) and staged page rows that :func:`resolve` would launch with;
    ``num_pages`` = P of the launch (0: unknown, no staging)."""
    return _module().resolve_launch_info(num_tokens, k, num_slots, block_size,
                                         _max_tokens_per_request, _resolve_threads, num_pages)


def _set_resolve_debug(variant: int = 0, stop: int = 0) -> None:
    """Benchmarks and tests only: ``variant`` 0 = the default (the fast-path kernel, which
    hands the requests it cannot take to the general path), 2 = the general kernel alone for
    every request (same-session comparisons; 1, the previous kernel, was removed); ``stop`` > 0
    makes every CTA of later launches return at that stop point (1 = at entry, the launch
    floor; then after each barrier, see docs/kernels.md). Outputs are then incomplete."""
    if variant not in (0, 2) or stop not in range(6):
        raise ValueError(f"variant must be 0 or 2 and stop in 0..5, got {variant!r}, "
                         f"{stop!r}")
    _module().set_resolve_debug(variant, stop)


# --------------------------------------------------------------------------------------
# row copies
# --------------------------------------------------------------------------------------


def _row_stride(name: str, t: torch.Tensor, row_bytes: int) -> int:
    """Bytes between consecutive rows of a uint8 layer view (dense or row-strided)."""
    if t.shape[0] <= 1 or t.is_contiguous():
        return row_bytes
    stride = int(t.stride(0))
    if int(t.stride(1)) != 1 or stride < row_bytes or stride % 16:
        raise ValueError(f"{name}: the CUDA row copies need rows with contiguous bytes and a "
                         f"row stride that is a multiple of 16 and >= {row_bytes} B; got "
                         f"strides {t.stride()}")
    return stride


def _layer_table(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor]):
    """Row size and runs of consecutive layers with equal (src, dst) row strides:
    ``[(src_stride, dst_stride, [src ptrs], [dst ptrs]), ...]`` (one launch per run)."""
    row_bytes = int(src_layers[0].shape[1])
    if row_bytes % 16 != 0:
        raise ValueError(f"the CUDA row copies need rows of a multiple of 16 bytes; got "
                         f"{row_bytes} B (use the reference ops for this layout)")
    runs: list[tuple[int, int, list[int], list[int]]] = []
    for i, (s, d) in enumerate(zip(src_layers, dst_layers)):
        if int(s.shape[1]) != row_bytes:
            raise ValueError(f"src_layers[{i}] has rows of {s.shape[1]} B but layer 0 has "
                             f"{row_bytes} B; one launch copies one row size")
        ps, pd = s.data_ptr(), d.data_ptr()
        if ps % 16 or pd % 16:
            raise ValueError(f"layer {i}: the CUDA row copies need 16-byte aligned layers "
                             f"(src at {ps:#x}, dst at {pd:#x})")
        ss = _row_stride(f"src_layers[{i}]", s, row_bytes)
        ds = _row_stride(f"dst_layers[{i}]", d, row_bytes)
        if runs and runs[-1][0] == ss and runs[-1][1] == ds:
            runs[-1][2].append(ps)
            runs[-1][3].append(pd)
        else:
            runs.append((ss, ds, [ps], [pd]))
    return row_bytes, runs


def _copy(mode: int, src_layers, dst_layers, a, b, count, n_outer: int, n_inner: int,
          rows_per_warp: int | None = None, ctas_per_sm: int | None = None,
          pair_major: bool | None = None, max_ctas: int = 0) -> None:
    if n_outer == 0 or n_inner == 0:
        return
    module = _module()
    row_bytes, runs = _layer_table(src_layers, dst_layers)
    device = a.device
    rpw = _copy_tuning["rows_per_warp"] if rows_per_warp is None else rows_per_warp
    cps = _copy_tuning["ctas_per_sm"] if ctas_per_sm is None else ctas_per_sm
    pm = _copy_tuning["pair_major"] if pair_major is None else bool(pair_major)
    with _on_device(device):
        stream = torch.cuda.current_stream(device)
        for src_stride, dst_stride, src, dst in runs:
            order = pm if pm is not None else (src_stride != row_bytes or dst_stride != row_bytes)
            module.copy_rows(mode, src, dst, row_bytes, int(src_layers[0].shape[0]),
                             int(dst_layers[0].shape[0]), a.data_ptr(), b.data_ptr(),
                             0 if count is None else count.data_ptr(), n_outer, n_inner, rpw,
                             cps, stream.cuda_stream, src_stride, dst_stride, int(order),
                             max_ctas)


def gather_rows(src_layers, dst_layers, miss_src, miss_dst, miss_count) -> None:
    """Execute a miss plan for every layer in one launch (DESIGN.md §4.2).

    Sources are typically pinned host memory read by GPU threads over UVA. Ids outside a
    layer's rows are skipped (the reference raises); counts are clamped to ``[0, K]``.
    """
    _copy(_module().COPY_PLAN, src_layers, dst_layers, miss_src, miss_dst, miss_count,
          int(miss_src.shape[0]), int(miss_src.shape[1]))


def gather_rows_tuned(src_layers, dst_layers, miss_src, miss_dst, miss_count, *,
                      rows_per_warp: int | None, ctas_per_sm: int | None,
                      pair_major: bool | None = None, max_ctas: int = 0) -> None:
    """:func:`gather_rows` with explicit tuning: ``rows_per_warp`` / ``ctas_per_sm`` (None =
    the process-wide setting, 0 = the kernel's default), ``max_ctas`` a cap on the whole grid
    (0 = none; the side-stream prefetch keeps to a few SMs with it)."""
    if isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas < 0:
        raise ValueError(f"max_ctas must be a non-negative int, got {max_ctas!r}")
    _copy(_module().COPY_PLAN, src_layers, dst_layers, miss_src, miss_dst, miss_count,
          int(miss_src.shape[0]), int(miss_src.shape[1]), rows_per_warp, ctas_per_sm,
          pair_major, max_ctas)


def copy_blocks(src_layers, dst_layers, src_blocks, dst_blocks, block_size) -> None:
    """Page copies (spill device→host, restore host→device) for every layer in one launch.

    Entries with -1 on either side are skipped, so fixed-size id buffers stay capturable.
    """
    _copy(_module().COPY_BLOCKS, src_layers, dst_layers, src_blocks, dst_blocks, None,
          int(src_blocks.shape[0]), int(block_size))


def mirror_rows(src_layers, dst_layers, src_rows, dst_rows) -> None:
    """Row copies (newly written rows device→pinned host) for every layer in one launch;
    entries with -1 on either side are skipped."""
    _copy(_module().COPY_PAIRS, src_layers, dst_layers, src_rows, dst_rows, None,
          int(src_rows.shape[0]), 1)


def host_alloc_registered(nbytes: int, mode: str) -> dict:
    """mmap ``nbytes`` with 4 KiB pages (``"4k"``), transparent huge pages (``"thp"``) or
    ``MAP_HUGETLB`` (``"hugetlb"``), fault it in and ``cudaHostRegister`` it (benchmarks)."""
    modes = {"4k": 0, "thp": 1, "hugetlb": 2}
    if mode not in modes:
        raise ValueError(f"mode must be one of {sorted(modes)}, got {mode!r}")
    return _module().host_alloc_registered(int(nbytes), modes[mode])


def host_free_registered(ptr: int, nbytes: int) -> int:
    return _module().host_free_registered(int(ptr), int(nbytes))
