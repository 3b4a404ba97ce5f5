"""CUDA implementations of the data-plane ops (docs/design.md, "Op contracts"), launched through ``vllm_hisparse._C``.

The functions here assume inputs already validated by :mod:`vllm_hisparse.ops` (dtype, device,
shape, contiguity) and only add the checks the kernels themselves need (row sizes, alignment).
Every launch goes on the current CUDA stream of the tensors' device, allocates nothing after
the first call on a device and never synchronizes, so the ops can be captured in CUDA graphs.
Each op takes the launch tuning of its backend (``tuning=``, a
:class:`~vllm_hisparse.ops.tuning.KernelTuning` carried by :func:`vllm_hisparse.ops.select`);
nothing here is process-wide. Benchmarks and tests reach the kernels' probes (phase stamps,
stop points, the general kernel alone) through :mod:`vllm_hisparse.ops.probe`.

Errors of ``resolve`` (docs/design.md, "resolve", errors) are recorded by the kernel in a 4-word device
buffer owned by this module (one per device; the first error wins), and the winning thread
also writes the record into a pinned host mirror over UVA. Every later call reads that mirror
(a plain memory read: no copy, no event, no sync) and raises
:class:`~vllm_hisparse.ops.errors.ResolveError` once an error has landed there.
:func:`check_errors` synchronizes the device and raises at once; :func:`poll_errors` raises
without waiting (for launches replayed in a CUDA graph, which no later call sees).
The request that failed gets ``out_rows = -1`` and ``miss_count = 0`` and keeps its ``slot_pos``,
``lru`` and ``stats`` untouched; the other requests of the launch are resolved normally.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Sequence

import torch

from vllm_hisparse.core.trace import SCORE_CLASS_WIDTH
from vllm_hisparse.ops import _extension
from vllm_hisparse.ops.errors import ResolveError
from vllm_hisparse.ops.tuning import DEFAULT_TUNING, KernelTuning

__all__ = [
    "available",
    "check_errors",
    "copy_blocks",
    "gather_rows",
    "gather_rows_tuned",
    "merge_rows",
    "merge_table_rows",
    "mirror_rows",
    "poll_errors",
    "resolve",
    "resolve_launch_info",
    "token_state_rows",
    "score_threshold",
    "slot_classes",
]


def _module():
    why = _extension.data_plane_error()
    if why:
        raise RuntimeError(why)
    return _extension.load()[0]


def available() -> bool:
    """True when the compiled extension provides the kernels."""
    return not _extension.data_plane_error()


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


def poll_errors(device: torch.device | int | str) -> None:
    """Raise the :class:`ResolveError` a completed launch on ``device`` recorded, if any,
    without waiting (a plain read of the pinned mirror). Every launch polls it first; this is
    for launches that no later call sees, such as those replayed in a CUDA graph."""
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    state = _error_state(device)
    with state.lock:
        state.poll()


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
            out_rows, miss_src, miss_dst, miss_count, stats=None, slot_class=None, *,
            tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """docs/design.md, "resolve" on the GPU; see :func:`vllm_hisparse.ops.reference.resolve`.

    ``tuning``: the backend's :class:`~vllm_hisparse.ops.tuning.KernelTuning` (CTA size and
    the token bound that sizes the shared-memory hash). Errors surface on a later call (or
    :func:`check_errors`) as :class:`ResolveError`.
    """
    _launch_resolve(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru,
                    block_size, out_rows, miss_src, miss_dst, miss_count, stats, tuning,
                    slot_class=slot_class)


def _launch_resolve(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru,
                    block_size, out_rows, miss_src, miss_dst, miss_count, stats,
                    tuning: KernelTuning, probe: dict | None = None,
                    slot_class=None) -> None:
    """One launch: the production entry point, or with ``probe`` (``times`` address, ``stop``,
    ``general_only``; :mod:`vllm_hisparse.ops.probe`) the probe entry point."""
    device = topk.device
    state = _error_state(device)
    with state.lock:
        state.poll()
    num_tokens, k = topk.shape
    if num_tokens == 0:
        return
    module = _module()
    num_rows, num_pages = residency.shape
    params = module.ResolveParams(
        topk=topk.data_ptr(), token_rows=token_rows.data_ptr(), residency=residency.data_ptr(),
        host_blocks=host_blocks.data_ptr(), hot_blocks=hot_blocks.data_ptr(),
        slot_pos=slot_pos.data_ptr(), lru=lru.data_ptr(), out_rows=out_rows.data_ptr(),
        miss_src=miss_src.data_ptr(), miss_dst=miss_dst.data_ptr(),
        miss_count=miss_count.data_ptr(), stats=0 if stats is None else stats.data_ptr(),
        error=state.record.data_ptr(), error_host=state.host.data_ptr(), num_tokens=num_tokens,
        k=k, num_rows=num_rows, num_pages=num_pages, num_slots=slot_pos.shape[1],
        block_size=int(block_size))
    if slot_class is not None:  # the general kernel's class instantiation runs the launch
        params.slot_class = slot_class.data_ptr()
    with _on_device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        if probe is None:
            module.resolve(params, threads=tuning.resolve_threads,
                           max_tokens_per_request=tuning.max_tokens_per_request, stream=stream)
        else:
            module.resolve_probe(params, threads=tuning.resolve_threads,
                                 max_tokens_per_request=tuning.max_tokens_per_request,
                                 stream=stream, **probe)


def resolve_launch_info(num_tokens: int, k: int, num_slots: int, block_size: int,
                        num_pages: int = 0, *, tuning: KernelTuning = DEFAULT_TUNING) -> dict:
    """Threads, shared memory, hash capacity (physical entries), union capacity (the
    UNION_CAPACITY bound), staged page rows and whether the fast path is taken, for a
    :func:`resolve` launch under ``tuning``; ``num_pages`` = P of the launch (0: unknown, no
    staging). Host code only: runs without a GPU."""
    return _module().resolve_launch_info(num_tokens, k, num_slots, block_size, num_pages,
                                         threads=tuning.resolve_threads,
                                         max_tokens_per_request=tuning.max_tokens_per_request)


# --------------------------------------------------------------------------------------
# score classes
# --------------------------------------------------------------------------------------


def _score_dtype(module, logits: torch.Tensor) -> int:
    return module.SCORE_FLOAT32 if logits.dtype == torch.float32 else module.SCORE_BFLOAT16


def score_threshold(logits, topk, threshold, width, *,
                    tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """One launch; see :func:`vllm_hisparse.ops.reference.score_threshold` (``tuning``: taken
    for the backend's uniform call, the launch has no choices)."""
    rows, cols = logits.shape
    if rows == 0:
        return
    module = _module()
    with _on_device(logits.device):
        stream = torch.cuda.current_stream(logits.device).cuda_stream
        module.score_threshold(logits.data_ptr(), topk.data_ptr(), threshold.data_ptr(),
                               width.data_ptr(), int(logits.stride(0)), int(topk.stride(0)),
                               float(SCORE_CLASS_WIDTH), rows, cols, int(topk.shape[1]),
                               _score_dtype(module, logits), stream)


def slot_classes(logits, threshold, width, next_n, batch_state_rows, slot_pos, slot_class, *,
                 tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """One launch; see :func:`vllm_hisparse.ops.reference.slot_classes`. A state row outside
    ``[0, R)`` is skipped (the reference raises)."""
    rows, cols = logits.shape
    num_rows, num_slots = slot_pos.shape
    requests = rows // next_n
    if requests == 0 or num_rows == 0 or num_slots == 0:
        return
    module = _module()
    with _on_device(logits.device):
        stream = torch.cuda.current_stream(logits.device).cuda_stream
        module.slot_classes(logits.data_ptr(), threshold.data_ptr(), width.data_ptr(),
                            batch_state_rows.data_ptr(), slot_pos.data_ptr(),
                            slot_class.data_ptr(), int(logits.stride(0)), requests, int(next_n),
                            cols, num_rows, num_slots, _score_dtype(module, logits), stream)


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
          tuning: KernelTuning, max_ctas: int = 0) -> None:
    if n_outer == 0 or n_inner == 0:
        return
    module = _module()
    row_bytes, runs = _layer_table(src_layers, dst_layers)
    device = a.device
    with _on_device(device):
        stream = torch.cuda.current_stream(device)
        for src_stride, dst_stride, src, dst in runs:
            order = tuning.copy_pair_major
            if order is None:
                order = src_stride != row_bytes or dst_stride != row_bytes
            module.copy_rows(mode, src, dst, row_bytes, int(src_layers[0].shape[0]),
                             int(dst_layers[0].shape[0]), a.data_ptr(), b.data_ptr(),
                             0 if count is None else count.data_ptr(), n_outer, n_inner,
                             tuning.copy_rows_per_warp, tuning.copy_ctas_per_sm,
                             stream.cuda_stream, src_stride, dst_stride, int(order), max_ctas)


def gather_rows(src_layers, dst_layers, miss_src, miss_dst, miss_count, *,
                tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """Execute a miss plan for every layer in one launch (docs/design.md, "Copies").

    Sources are typically pinned host memory read by GPU threads over UVA. Ids outside a
    layer's rows are skipped (the reference raises); counts are clamped to ``[0, K]``.
    """
    _copy(_module().COPY_PLAN, src_layers, dst_layers, miss_src, miss_dst, miss_count,
          int(miss_src.shape[0]), int(miss_src.shape[1]), tuning)


def gather_rows_tuned(src_layers, dst_layers, miss_src, miss_dst, miss_count, *,
                      rows_per_warp: int | None = None, ctas_per_sm: int | None = None,
                      pair_major: bool | None = None, max_ctas: int = 0,
                      tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """:func:`gather_rows` with per-launch overrides of ``tuning``: ``rows_per_warp`` /
    ``ctas_per_sm`` (None = the tuning's value, 0 = the kernel's default), ``pair_major``
    (None = the tuning's order), ``max_ctas`` a cap on the whole grid (0 = none; the
    side-stream prefetch keeps to a few SMs with it)."""
    if isinstance(max_ctas, bool) or not isinstance(max_ctas, int) or max_ctas < 0:
        raise ValueError(f"max_ctas must be a non-negative int, got {max_ctas!r}")
    overrides = {}
    if rows_per_warp is not None:
        overrides["copy_rows_per_warp"] = rows_per_warp
    if ctas_per_sm is not None:
        overrides["copy_ctas_per_sm"] = ctas_per_sm
    if pair_major is not None:
        overrides["copy_pair_major"] = bool(pair_major)
    if overrides:
        tuning = dataclasses.replace(tuning, **overrides)
    _copy(_module().COPY_PLAN, src_layers, dst_layers, miss_src, miss_dst, miss_count,
          int(miss_src.shape[0]), int(miss_src.shape[1]), tuning, max_ctas)


def copy_blocks(src_layers, dst_layers, src_blocks, dst_blocks, block_size, *,
                tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """Page copies (spill device→host, restore host→device) for every layer in one launch.

    Entries with -1 on either side are skipped, so fixed-size id buffers stay capturable.
    """
    _copy(_module().COPY_BLOCKS, src_layers, dst_layers, src_blocks, dst_blocks, None,
          int(src_blocks.shape[0]), int(block_size), tuning)


def mirror_rows(src_layers, dst_layers, src_rows, dst_rows, *,
                tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """Row copies (newly written rows device→pinned host) for every layer in one launch;
    entries with -1 on either side are skipped."""
    _copy(_module().COPY_PAIRS, src_layers, dst_layers, src_rows, dst_rows, None,
          int(src_rows.shape[0]), 1, tuning)


# --------------------------------------------------------------------------------------
# finishing a conversion
# --------------------------------------------------------------------------------------


def token_state_rows(batch_rows, step_table, out, limit=None, *,
                     tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """One launch of :func:`vllm_hisparse.ops.reference.token_state_rows`."""
    num_tokens = batch_rows.shape[0]
    if num_tokens == 0:
        return
    device = batch_rows.device
    bound = num_tokens if limit is None else max(0, min(int(limit), num_tokens))
    with _on_device(device):
        _module().token_state_rows(
            batch_rows.data_ptr(), batch_rows.dtype == torch.int64, step_table.data_ptr(),
            out.data_ptr(), num_tokens, step_table.shape[0] - 1, bound,
            torch.cuda.current_stream(device).cuda_stream)


def merge_rows(ours, token_rows, theirs, from_stride_rows, to_stride_rows, out, counts=None, *,
               tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """One launch of :func:`vllm_hisparse.ops.reference.merge_rows` (one CTA per token)."""
    num_tokens, k = ours.shape
    if _empty_merge(num_tokens, k, counts):
        return
    device = ours.device
    with _on_device(device):
        _module().merge_rows(
            ours.data_ptr(), token_rows.data_ptr(), theirs.data_ptr(), out.data_ptr(),
            0 if counts is None else counts.data_ptr(), num_tokens, k, int(from_stride_rows),
            int(to_stride_rows), torch.cuda.current_stream(device).cuda_stream)


def _empty_merge(num_tokens: int, k: int, counts) -> bool:
    """True (and every count 0) when a merge has no entry: nothing to launch."""
    if num_tokens and k:
        return False
    if counts is not None and num_tokens:
        counts.zero_()
    return True


def merge_table_rows(ours, token_rows, topk, batch_rows, block_table, block_size,
                     from_stride_rows, to_stride_rows, out, counts=None, *,
                     tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """One launch of :func:`vllm_hisparse.ops.reference.merge_table_rows` (merge_rows'
    kernel in its table mode)."""
    num_tokens, k = ours.shape
    if _empty_merge(num_tokens, k, counts):
        return
    device = ours.device
    num_rows, num_pages = block_table.shape
    with _on_device(device):
        _module().merge_table_rows(
            ours.data_ptr(), token_rows.data_ptr(), topk.data_ptr(), batch_rows.data_ptr(),
            block_table.data_ptr(), num_rows, num_pages, block_table.stride(0), int(block_size),
            out.data_ptr(), 0 if counts is None else counts.data_ptr(), num_tokens, k,
            int(from_stride_rows), int(to_stride_rows),
            torch.cuda.current_stream(device).cuda_stream)
