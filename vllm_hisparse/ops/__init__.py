"""Data-plane ops of docs/design.md, "Op contracts": ``resolve``, ``gather_rows``, ``copy_blocks``, ``mirror_rows``,
and the ops that finish an attention layer's top-k conversion around ``resolve``:
``token_state_rows`` (each token's state row) and ``merge_rows`` (resolve's rows merged into
the engine's, translated, optionally compacted), or ``merge_table_rows`` (the same, with the
engine's rows computed from its block table in the same pass; docs/kernels.md "Finishing a
conversion");
and the score ops of score-aware eviction, ``score_threshold`` and ``slot_classes``
(:mod:`vllm_hisparse.ops.reference_scores`).

Each public function validates every tensor (dtype, device, shape, contiguity) and raises a
``ValueError`` naming the argument, then runs the CUDA kernel when the index tensors are on a
CUDA device and the extension ``vllm_hisparse._C`` provides it, and the pure-torch twin in
:mod:`vllm_hisparse.ops.reference` otherwise (the fallback is logged once).

:func:`select` returns the same functions bound to one backend (``"auto"``, ``"cuda"`` or
``"reference"``) and one :class:`KernelTuning` (``select("cuda", resolve_threads=512)``), which is
how the connector's ``ops_backend`` setting is applied. The module-level functions are the
``"auto"`` backend with the default tuning.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import torch

from vllm_hisparse.ops import (_checks, _conversion_checks, _extension, cuda, host_ranges,
                               reference, reference_scores)
from vllm_hisparse.ops.errors import ResolveError, ResolveErrorCode
from vllm_hisparse.ops.tuning import DEFAULT_TUNING, KernelTuning

__all__ = [
    "Backend",
    "DEFAULT_TUNING",
    "KernelTuning",
    "ResolveError",
    "ResolveErrorCode",
    "copy_blocks",
    "gather_rows",
    "merge_rows",
    "merge_table_rows",
    "mirror_rows",
    "reference",
    "resolve",
    "score_threshold",
    "select",
    "token_state_rows",
    "slot_classes",
]

BACKENDS = ("auto", "cuda", "reference")


def _kernels(device: torch.device, backend: str):
    """The CUDA op module to use for tensors on ``device``, or None for the reference."""
    if backend == "reference" or device.type != "cuda":
        if backend == "cuda":
            raise ValueError(f"ops backend 'cuda' needs CUDA index tensors, got {device}")
        return None
    if _extension.warn_if_unavailable():
        return cuda
    if backend == "cuda":
        raise RuntimeError("ops backend 'cuda' was requested but the CUDA kernels are not "
                           "available: " + (_extension.data_plane_error() or "see the log"))
    return None


def _check_zero_copy_sources(layers: Sequence[torch.Tensor], device: torch.device,
                             name: str) -> None:
    """CUDA copies read host layers over UVA: they must be pinned (or registered by us,
    ``host_ranges``)."""
    for i, t in enumerate(layers):
        if t.device.type == "cpu" and not (t.is_pinned() or host_ranges.covers(t)):
            raise ValueError(f"{name}[{i}] is a CPU tensor that is not pinned; the CUDA copy "
                             f"reads host memory directly and needs pinned memory")
        if t.device.type == "cuda" and t.device != device:
            raise ValueError(f"{name}[{i}] is on {t.device}, the indices on {device}")


def _resolve(backend: str, tuning: KernelTuning, topk, token_rows, residency, host_blocks,
             hot_blocks, slot_pos, lru, block_size, out_rows, miss_src, miss_dst, miss_count,
             stats=None, slot_class=None) -> None:
    _checks.check_resolve_args(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos,
                               lru, block_size, out_rows, miss_src, miss_dst, miss_count, stats,
                               slot_class)
    kernels = _kernels(topk.device, backend)
    if kernels is None:
        reference._resolve_unchecked(topk, token_rows, residency, host_blocks, hot_blocks,
                                     slot_pos, lru, block_size, out_rows, miss_src, miss_dst,
                                     miss_count, stats, slot_class)
        return
    if _checks.value_checks_enabled():  # the reference always checks
        _checks.check_resolve_values(topk, token_rows, residency, host_blocks, hot_blocks,
                                     slot_pos, lru, block_size)
    kernels.resolve(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru,
                    block_size, out_rows, miss_src, miss_dst, miss_count, stats, slot_class,
                    tuning=tuning)


def _copy(name: str, check, backend: str, tuning: KernelTuning, src_layers, dst_layers,
          ids: torch.Tensor, *rest) -> None:
    """Shared dispatch of the copy ops: checks, then kernel or reference twin ``name``."""
    check(src_layers, dst_layers, ids, *rest)
    kernels = _kernels(ids.device, backend)
    if kernels is None:
        getattr(reference, name)(src_layers, dst_layers, ids, *rest)
        return
    if _checks.value_checks_enabled():  # the reference twins always check
        _checks.COPY_VALUE_CHECKS[name](src_layers, dst_layers, ids, *rest)
    _check_zero_copy_sources(src_layers, ids.device, "src_layers")
    _check_zero_copy_sources(dst_layers, ids.device, "dst_layers")
    getattr(kernels, name)(src_layers, dst_layers, ids, *rest, tuning=tuning)


def _gather_rows(backend: str, tuning: KernelTuning, src_layers, dst_layers, miss_src,
                 miss_dst, miss_count) -> None:
    _copy("gather_rows", _checks.check_gather_args, backend, tuning, src_layers, dst_layers,
          miss_src, miss_dst, miss_count)


def _copy_blocks(backend: str, tuning: KernelTuning, src_layers, dst_layers, src_blocks,
                 dst_blocks, block_size) -> None:
    _copy("copy_blocks", _checks.check_block_copy_args, backend, tuning, src_layers, dst_layers,
          src_blocks, dst_blocks, block_size)


def _mirror_rows(backend: str, tuning: KernelTuning, src_layers, dst_layers, src_rows,
                 dst_rows) -> None:
    _copy("mirror_rows", _checks.check_row_copy_args, backend, tuning, src_layers, dst_layers,
          src_rows, dst_rows)


def _token_state_rows(backend: str, tuning: KernelTuning, batch_rows, step_table, out,
                      limit=None) -> None:
    _conversion_checks.check_token_state_rows_args(batch_rows, step_table, out, limit)
    kernels = _kernels(batch_rows.device, backend)
    (reference if kernels is None else kernels).token_state_rows(
        batch_rows, step_table, out, limit, **({} if kernels is None else {"tuning": tuning}))


def _merge_rows(backend: str, tuning: KernelTuning, ours, token_rows, theirs, from_stride_rows,
                to_stride_rows, out, counts=None) -> None:
    _conversion_checks.check_merge_rows_args(ours, token_rows, theirs, from_stride_rows,
                                             to_stride_rows, out, counts)
    kernels = _kernels(ours.device, backend)
    (reference if kernels is None else kernels).merge_rows(
        ours, token_rows, theirs, from_stride_rows, to_stride_rows, out, counts,
        **({} if kernels is None else {"tuning": tuning}))


def _merge_table_rows(backend: str, tuning: KernelTuning, ours, token_rows, topk, batch_rows,
                      block_table, block_size, from_stride_rows, to_stride_rows, out,
                      counts=None) -> None:
    args = (ours, token_rows, topk, batch_rows, block_table, block_size, from_stride_rows,
            to_stride_rows, out, counts)
    _conversion_checks.check_merge_table_rows_args(*args)
    kernels = _kernels(ours.device, backend)
    (reference if kernels is None else kernels).merge_table_rows(
        *args, **({} if kernels is None else {"tuning": tuning}))


def _score_threshold(backend: str, tuning: KernelTuning, logits, topk, threshold,
                     width) -> None:
    _checks.check_score_threshold_args(logits, topk, threshold, width)
    kernels = _kernels(logits.device, backend)
    if kernels is None:
        reference_scores._score_threshold_unchecked(logits, topk, threshold, width)
        return
    kernels.score_threshold(logits, topk, threshold, width, tuning=tuning)


def _slot_classes(backend: str, tuning: KernelTuning, logits, threshold, width, next_n,
                  batch_state_rows, slot_pos, slot_class) -> None:
    args = (logits, threshold, width, next_n, batch_state_rows, slot_pos, slot_class)
    _checks.check_slot_classes_args(*args)
    kernels = _kernels(logits.device, backend)
    if kernels is None:
        _checks.check_slot_classes_values(*args)  # the twin always checks
        reference_scores._slot_classes_unchecked(*args)
        return
    if _checks.value_checks_enabled():
        _checks.check_slot_classes_values(*args)
    kernels.slot_classes(*args, tuning=tuning)


@dataclasses.dataclass(frozen=True)
class Backend:
    """The ops bound to one backend name and one kernel tuning; see :func:`select`."""

    name: str
    tuning: KernelTuning
    resolve: Callable[..., None]
    gather_rows: Callable[..., None]
    copy_blocks: Callable[..., None]
    mirror_rows: Callable[..., None]
    token_state_rows: Callable[..., None]
    merge_rows: Callable[..., None]
    merge_table_rows: Callable[..., None]
    score_threshold: Callable[..., None]
    slot_classes: Callable[..., None]


def select(backend: str = "auto", **tuning) -> Backend:
    """The ops bound to ``backend``: ``"auto"`` (CUDA kernels for CUDA tensors when built,
    else reference), ``"cuda"`` (kernels or a clear error) or ``"reference"`` (always the
    pure-torch twins, on any device).

    ``tuning``: fields of :class:`KernelTuning` for the CUDA launches of this backend
    (``resolve_threads``, ``max_tokens_per_request``, ``copy_rows_per_warp``,
    ``copy_ctas_per_sm``, ``copy_pair_major``); omitted fields keep their measured defaults.
    """
    if backend not in BACKENDS:
        raise ValueError(f"ops backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    kernel_tuning = KernelTuning.from_options(tuning) if tuning else DEFAULT_TUNING

    def bind(fn):
        def bound(*args, **kwargs):
            return fn(backend, kernel_tuning, *args, **kwargs)
        twin = getattr(reference, fn.__name__.lstrip("_"))
        functools.update_wrapper(bound, twin)  # name, docstring and signature of the twin
        return bound

    return Backend(backend, kernel_tuning, bind(_resolve), bind(_gather_rows),
                   bind(_copy_blocks), bind(_mirror_rows), bind(_token_state_rows),
                   bind(_merge_rows), bind(_merge_table_rows), bind(_score_threshold),
                   bind(_slot_classes))


_auto = select("auto")
resolve = _auto.resolve
gather_rows = _auto.gather_rows
copy_blocks = _auto.copy_blocks
mirror_rows = _auto.mirror_rows
token_state_rows = _auto.token_state_rows
merge_rows = _auto.merge_rows
merge_table_rows = _auto.merge_table_rows
score_threshold = _auto.score_threshold
slot_classes = _auto.slot_classes
