"""Argument checks shared by the public ops and their reference twins.

Every message names the argument and says what was expected, so a bad call fails at the
boundary instead of inside a kernel. Checks look at metadata only (dtype, device, shape,
contiguity) except :func:`check_row_ids`, which the reference twins use on data they already
hold on the host side of the computation.
"""

from __future__ import annotations

from typing import Sequence

import torch

MAX_HOT_SLOTS = 32768  # lru is int16: slot ids must fit


def _fail(message: str) -> None:
    raise ValueError(message)


def check_tensor(name: str, t: object, dtype: torch.dtype, ndim: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` with ``ndim`` dimensions (on ``device`` if given)."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        _fail(f"{name} must have dtype {dtype}, got {t.dtype}")
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        _fail(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, expected {device} (the device of the other indices)")
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], why: str) -> None:
    if tuple(t.shape) != shape:
        _fail(f"{name} must have shape {shape} ({why}), got {tuple(t.shape)}")


def check_block_size(block_size: object) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        _fail(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def check_resolve_args(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru,
                       block_size, out_rows, miss_src, miss_dst, miss_count, stats) -> None:
    """Metadata checks of ``resolve`` (DESIGN.md §4.1 argument table)."""
    bs = check_block_size(block_size)
    dev = check_tensor("topk", topk, torch.int32, 2).device
    num_tokens, k = topk.shape
    check_tensor("token_rows", token_rows, torch.int32, 1, dev)
    check_shape("token_rows", token_rows, (num_tokens,), "one state row per topk row")
    check_tensor("residency", residency, torch.int32, 2, dev)
    num_rows, num_pages = residency.shape
    check_tensor("host_blocks", host_blocks, torch.int32, 2, dev)
    check_shape("host_blocks", host_blocks, (num_rows, num_pages), "same [R, P] as residency")
    check_tensor("slot_pos", slot_pos, torch.int32, 2, dev)
    if slot_pos.shape[0] != num_rows:
        _fail(f"slot_pos must have {num_rows} rows (R of residency), got {slot_pos.shape[0]}")
    num_slots = slot_pos.shape[1]
    if num_slots % bs != 0:
        _fail(f"slot_pos has D = {num_slots} hot slots, not a multiple of block_size = {bs}")
    if num_slots > MAX_HOT_SLOTS:
        _fail(f"slot_pos has D = {num_slots} hot slots; at most {MAX_HOT_SLOTS} fit an int16 lru")
    check_tensor("hot_blocks", hot_blocks, torch.int32, 2, dev)
    check_shape("hot_blocks", hot_blocks, (num_rows, num_slots // bs), "[R, D // block_size]")
    check_tensor("lru", lru, torch.int16, 2, dev)
    check_shape("lru", lru, (num_rows, num_slots), "same [R, D] as slot_pos")
    for name, t in (("out_rows", out_rows), ("miss_src", miss_src), ("miss_dst", miss_dst)):
        check_tensor(name, t, torch.int32, 2, dev)
        check_shape(name, t, (num_tokens, k), "same [T, K] as topk")
    check_tensor("miss_count", miss_count, torch.int32, 1, dev)
    check_shape("miss_count", miss_count, (num_tokens,), "one count per topk row")
    if stats is not None:
        check_tensor("stats", stats, torch.int64, 1, dev)
        check_shape("stats", stats, (3,), "(resident, hot hit, miss) counters")


def check_row_view(name: str, t: object, device: torch.device | None = None) -> torch.Tensor:
    """A uint8 ``[rows, row_bytes]`` layer view: contiguous, or **row-strided** (the bytes of a
    row contiguous, ``stride(0)`` a multiple of 16 and ``>= row_bytes``), which is how one
    layer of a position-major host pool looks (DESIGN.md §4.2, docs/kernels.md)."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.uint8:
        _fail(f"{name} must have dtype {torch.uint8}, got {t.dtype}")
    if t.dim() != 2:
        _fail(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        rows, row_bytes = t.shape
        s0, s1 = t.stride()
        if not (s1 == 1 and s0 >= row_bytes and s0 % 16 == 0):
            _fail(f"{name} must be contiguous or row-strided (contiguous rows, row stride a "
                  f"multiple of 16 and >= row_bytes = {row_bytes}); got strides {t.stride()} "
                  f"for shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, expected {device} (the device of the other indices)")
    return t


def check_layer_lists(src_layers: Sequence[torch.Tensor],
                      dst_layers: Sequence[torch.Tensor]) -> None:
    """Two equally long, non-empty lists of uint8 ``[rows, row_bytes]`` tensors (contiguous or
    row-strided, see :func:`check_row_view`), pairwise equal ``row_bytes``, all sources on one
    device and all destinations on one device."""
    for name, layers in (("src_layers", src_layers), ("dst_layers", dst_layers)):
        if isinstance(layers, torch.Tensor) or not isinstance(layers, Sequence):
            _fail(f"{name} must be a list or tuple of tensors, got {type(layers).__name__}")
        if len(layers) == 0:
            _fail(f"{name} is empty: pass at least one layer")
    if len(src_layers) != len(dst_layers):
        _fail(f"src_layers has {len(src_layers)} layers but dst_layers has {len(dst_layers)}")
    src_dev = src_layers[0].device if isinstance(src_layers[0], torch.Tensor) else None
    dst_dev = dst_layers[0].device if isinstance(dst_layers[0], torch.Tensor) else None
    for i, (s, d) in enumerate(zip(src_layers, dst_layers)):
        check_row_view(f"src_layers[{i}]", s, src_dev)
        check_row_view(f"dst_layers[{i}]", d, dst_dev)
        if s.shape[1] != d.shape[1]:
            _fail(f"src_layers[{i}] has rows of {s.shape[1]} B but dst_layers[{i}] has rows "
                  f"of {d.shape[1]} B")
        if s.shape[0] != src_layers[0].shape[0] or d.shape[0] != dst_layers[0].shape[0]:
            _fail(f"layer {i} has {s.shape[0]} source / {d.shape[0]} destination rows; every "
                  f"layer of a list must have the same number of rows")


def check_gather_args(src_layers, dst_layers, miss_src, miss_dst, miss_count) -> None:
    check_layer_lists(src_layers, dst_layers)
    dev = check_tensor("miss_src", miss_src, torch.int32, 2).device
    check_tensor("miss_dst", miss_dst, torch.int32, 2, dev)
    check_shape("miss_dst", miss_dst, tuple(miss_src.shape), "same [T, K] as miss_src")
    check_tensor("miss_count", miss_count, torch.int32, 1, dev)
    check_shape("miss_count", miss_count, (miss_src.shape[0],), "one count per miss_src row")


def check_block_copy_args(src_layers, dst_layers, src_blocks, dst_blocks, block_size) -> None:
    check_layer_lists(src_layers, dst_layers)
    bs = check_block_size(block_size)
    for name, layers in (("src_layers", src_layers), ("dst_layers", dst_layers)):
        if layers[0].shape[0] % bs != 0:
            _fail(f"{name} have {layers[0].shape[0]} rows, not a multiple of block_size = {bs}")
    dev = check_tensor("src_blocks", src_blocks, torch.int32, 1).device
    check_tensor("dst_blocks", dst_blocks, torch.int32, 1, dev)
    check_shape("dst_blocks", dst_blocks, tuple(src_blocks.shape), "one destination per source")


def check_row_copy_args(src_layers, dst_layers, src_rows, dst_rows) -> None:
    check_layer_lists(src_layers, dst_layers)
    dev = check_tensor("src_rows", src_rows, torch.int32, 1).device
    check_tensor("dst_rows", dst_rows, torch.int32, 1, dev)
    check_shape("dst_rows", dst_rows, tuple(src_rows.shape), "one destination per source")


def check_row_ids(name: str, ids: torch.Tensor, limit: int) -> None:
    """Data check used by the reference twins: every id in ``[0, limit)``."""
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= limit).any())):
        bad = ids[(ids < 0) | (ids >= limit)][0]
        _fail(f"{name} holds {int(bad)}, outside [0, {limit})")
