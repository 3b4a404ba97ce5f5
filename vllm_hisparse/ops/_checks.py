"""Argument checks shared by the public ops and their reference twins.

Every message names the argument and says what was expected, so a bad call fails at the
boundary instead of inside a kernel. Two kinds (docs/design.md, "Input checks"):

* ``check_*_args``: metadata only (type, dtype, device incl. ``meta``, shape, contiguity,
  outputs sharing memory with other arguments). No device sync; both backends, every call.
* ``check_*_values`` and :func:`check_lru_rows`: data-dependent (negative ids, int32 row
  overflow, duplicate destinations, a corrupt ``lru``). Torch ops only, so they run on CPU and
  CUDA tensors alike; they read the data back to the host (a device sync on CUDA). The reference
  twins run them always; the CUDA backend only when :func:`value_checks_enabled`.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from vllm_hisparse.ops.errors import (AliasedOutputError, DuplicateDestinationError,
                                      MetaTensorError, NegativeIdError, ResolveError,
                                      ResolveErrorCode, RowOverflowError)

MAX_HOT_SLOTS = 32768  # lru is int16: slot ids must fit
INT32_LIMIT = 1 << 31  # device and host rows are int32: every row must stay below this
CHECK_INPUTS_ENV = "HISPARSE_CHECK_INPUTS"


def value_checks_enabled() -> bool:
    """Whether the CUDA backend runs the data-dependent checks (``HISPARSE_CHECK_INPUTS=1``)."""
    return os.environ.get(CHECK_INPUTS_ENV) == "1"


def _fail(message: str) -> None:
    raise ValueError(message)


def _check_not_meta(name: str, t: torch.Tensor) -> None:
    if t.is_meta:  # an attribute: t.device.type would cost a device object per call
        raise MetaTensorError(name, f"{name} is a meta tensor (device 'meta'): it holds no data "
                              f"for the op to read or write")


def check_tensor(name: str, t: object, dtype: torch.dtype, ndim: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """A contiguous tensor of ``dtype`` with ``ndim`` dimensions (on ``device`` if given)."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_not_meta(name, t)
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
                       block_size, out_rows, miss_src, miss_dst, miss_count, stats,
                       slot_class=None) -> None:
    """Metadata checks of ``resolve`` (docs/design.md, "resolve")."""
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
    if slot_class is not None:
        check_tensor("slot_class", slot_class, torch.uint8, 2, dev)
        check_shape("slot_class", slot_class, (num_rows, num_slots), "same [R, D] as slot_pos")
    written = [("out_rows", out_rows), ("miss_src", miss_src), ("miss_dst", miss_dst),
               ("miss_count", miss_count), ("slot_pos", slot_pos), ("lru", lru)]
    if stats is not None:
        written.append(("stats", stats))
    read = [("topk", topk), ("token_rows", token_rows), ("residency", residency),
            ("host_blocks", host_blocks), ("hot_blocks", hot_blocks)]
    if slot_class is not None:
        read.append(("slot_class", slot_class))
    check_no_aliasing(written, read)


def check_row_view(name: str, t: object, device: torch.device | None = None) -> torch.Tensor:
    """A uint8 ``[rows, row_bytes]`` layer view: contiguous, or **row-strided** (the bytes of a
    row contiguous, ``stride(0)`` a multiple of 16 and ``>= row_bytes``), which is how one
    layer of a position-major host pool looks (docs/design.md, "Copies", docs/kernels.md)."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_not_meta(name, t)
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
    _check_layer_aliasing(src_layers, dst_layers, [("miss_src", miss_src),
                                                   ("miss_dst", miss_dst),
                                                   ("miss_count", miss_count)])


def check_block_copy_args(src_layers, dst_layers, src_blocks, dst_blocks, block_size) -> None:
    check_layer_lists(src_layers, dst_layers)
    bs = check_block_size(block_size)
    for name, layers in (("src_layers", src_layers), ("dst_layers", dst_layers)):
        if layers[0].shape[0] % bs != 0:
            _fail(f"{name} have {layers[0].shape[0]} rows, not a multiple of block_size = {bs}")
    dev = check_tensor("src_blocks", src_blocks, torch.int32, 1).device
    check_tensor("dst_blocks", dst_blocks, torch.int32, 1, dev)
    check_shape("dst_blocks", dst_blocks, tuple(src_blocks.shape), "one destination per source")
    _check_layer_aliasing(src_layers, dst_layers, [("src_blocks", src_blocks),
                                                   ("dst_blocks", dst_blocks)])


def check_row_copy_args(src_layers, dst_layers, src_rows, dst_rows) -> None:
    check_layer_lists(src_layers, dst_layers)
    dev = check_tensor("src_rows", src_rows, torch.int32, 1).device
    check_tensor("dst_rows", dst_rows, torch.int32, 1, dev)
    check_shape("dst_rows", dst_rows, tuple(src_rows.shape), "one destination per source")
    _check_layer_aliasing(src_layers, dst_layers, [("src_rows", src_rows),
                                                   ("dst_rows", dst_rows)])


# --------------------------------------------------------------------------------------
# aliasing (metadata: storage addresses and strides)
# --------------------------------------------------------------------------------------


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of a contiguous or row-strided tensor."""
    size = t.element_size()
    if t.dim() == 2 and t.shape[0] > 0:
        end = (t.shape[0] - 1) * t.stride(0) * size + t.shape[1] * size
    else:
        end = t.numel() * size
    start = t.data_ptr()
    return start, start + end


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (on one device) have a byte in common. Exact for contiguous
    tensors and for row-strided views with one row stride (the layers of one position-major
    pool interleave without sharing a byte)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _byte_span(a)
    b0, b1 = _byte_span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if (a.dim() == 2 and b.dim() == 2 and a.stride(1) == 1 and b.stride(1) == 1
            and a.stride(0) * a.element_size() == b.stride(0) * b.element_size()):
        stride = a.stride(0) * a.element_size()
        width_a, width_b = a.shape[1] * a.element_size(), b.shape[1] * b.element_size()
        if width_a < stride or width_b < stride:  # rows with gaps: do they fit each other's?
            phase = (b0 - a0) % stride
            return not (width_a <= phase and phase + width_b <= stride)
    return True


def _aliased(out_name: str, other_name: str) -> None:
    raise AliasedOutputError(out_name, f"{out_name} shares memory with {other_name}; an "
                             f"output must not overlap any other argument")


def check_no_aliasing(written: Sequence[tuple[str, torch.Tensor]],
                      read: Sequence[tuple[str, torch.Tensor]]) -> None:
    """No tensor of ``written`` overlaps another of ``written`` or one of ``read`` (all
    contiguous and on one device, as the callers have checked).

    This runs on every op call, so the common case (no two arguments overlap at all) is one
    sort of the byte spans and a linear sweep; only an overlap found there is examined pair by
    pair (two read-only arguments may share memory)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes, i)
                   for i, (_, t) in enumerate(list(written) + list(read)) if t.nbytes)
    reach = -1
    for start, end, _ in spans:
        if start < reach:
            break
        reach = max(reach, end)
    else:
        return
    named = [(name, t.data_ptr(), t.data_ptr() + t.nbytes) for name, t in list(written) + list(read)]
    for i in range(len(written)):
        name, a0, a1 = named[i]
        for other_name, b0, b1 in named[:i] + named[len(written):]:
            if a0 < b1 and b0 < a1:
                _aliased(name, other_name)


def _check_layer_aliasing(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                          ids: Sequence[tuple[str, torch.Tensor]]) -> None:
    """No destination layer overlaps a source layer or an index tensor. Only tensors on the
    destinations' device and in one storage with a destination are compared byte-wise, so the
    usual call (sources in host memory, destinations on the GPU) costs one storage lookup per
    destination layer and index tensor."""
    dst_dev = dst_layers[0].device
    others = [(name, t) for name, t in ids if t.device == dst_dev]
    if src_layers[0].device == dst_dev:
        others += [(f"src_layers[{j}]", t) for j, t in enumerate(src_layers)]
    if not others:
        return
    by_storage: dict[int, list[int]] = {}
    for i, d in enumerate(dst_layers):
        by_storage.setdefault(d.untyped_storage().data_ptr(), []).append(i)
    for other_name, other in others:
        for i in by_storage.get(other.untyped_storage().data_ptr(), ()):
            if _shares_memory(dst_layers[i], other):
                _aliased(f"dst_layers[{i}]", other_name)


# --------------------------------------------------------------------------------------
# data-dependent checks (reference always, CUDA under HISPARSE_CHECK_INPUTS=1)
# --------------------------------------------------------------------------------------


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def check_row_ids(name: str, ids: torch.Tensor, limit: int) -> None:
    """Every id in ``[0, limit)`` (``ids`` as selected by the caller: no sentinel left)."""
    if ids.numel() and (bool((ids < 0).any()) or bool((ids >= limit).any())):
        bad = ids[(ids < 0) | (ids >= limit)][0]
        _fail(f"{name} holds {int(bad)}, outside [0, {limit})")


def check_sentinel_ids(name: str, ids: torch.Tensor) -> None:
    """No value below ``-1`` (the only negative id is the ``-1`` sentinel)."""
    bad = ids < -1
    if ids.numel() and bool(bad.any()):
        index = _first_index(bad)
        value = int(ids[index])
        raise NegativeIdError(name, f"{name}{list(index)} holds {value}: the only negative id "
                              f"is the -1 sentinel", index, value)


def check_distinct(name: str, ids: torch.Tensor, index_of: torch.Tensor) -> None:
    """The int64 ``[N]`` destinations ``ids`` are distinct; ``index_of`` ``[N, d]`` gives each
    entry's index in the argument ``name`` (for the message)."""
    if ids.numel() < 2:
        return
    sorted_ids, order = torch.sort(ids, stable=True)
    same = sorted_ids[1:] == sorted_ids[:-1]
    if bool(same.any()):
        j = int(torch.nonzero(same)[0])
        first = tuple(int(x) for x in index_of[order[j]])
        second = tuple(int(x) for x in index_of[order[j + 1]])
        value = int(sorted_ids[j])
        raise DuplicateDestinationError(
            name, f"{name}{list(first)} and {name}{list(second)} both hold {value}: the "
            f"destinations of one call must be distinct", second, value)


def _check_table(name: str, table: torch.Tensor, rows: torch.Tensor, block_size: int) -> None:
    """Rows ``rows`` of an int32 block table: ids >= -1 whose rows fit int32."""
    sub = table.index_select(0, rows).to(torch.int64)
    if sub.numel() == 0:
        return
    limit = INT32_LIMIT // block_size  # block ids < limit keep block * bs + (bs - 1) < 2**31
    for bad, kind in ((sub < -1, "negative"), (sub >= limit, "overflow")):
        if bool(bad.any()):
            i, j = _first_index(bad)
            index = (int(rows[i]), j)
            value = int(sub[i, j])
            if kind == "negative":
                raise NegativeIdError(name, f"{name}{list(index)} holds {value}: the only "
                                      f"negative id is the -1 sentinel", index, value)
            raise RowOverflowError(name, f"{name}{list(index)} holds block {value}: its rows "
                                   f"{value} * {block_size} + offset overflow int32 (block ids "
                                   f"must be < {limit} at block_size {block_size})", index, value)


def check_resolve_tables(token_rows: torch.Tensor, residency: torch.Tensor,
                         host_blocks: torch.Tensor, hot_blocks: torch.Tensor,
                         block_size: int) -> None:
    """``residency``, ``host_blocks`` and ``hot_blocks`` rows of the batch's state rows (values
    of ``token_rows`` in ``[0, R)``): every id is ``-1`` or a block whose rows fit int32."""
    num_rows = residency.shape[0]
    rows = token_rows[(token_rows >= 0) & (token_rows < num_rows)].to(torch.int64)
    rows = torch.unique(rows)
    for name, table in (("residency", residency), ("host_blocks", host_blocks),
                        ("hot_blocks", hot_blocks)):
        _check_table(name, table, rows, block_size)


def check_lru_rows(rows: torch.Tensor, lru_rows: torch.Tensor) -> None:
    """``lru_rows`` (``[n, D]``, any integer dtype, of the state rows ``rows``) are permutations
    of ``[0, D)``. A value outside raises ``CORRUPT_LRU`` with the first such value in slot
    order, as the kernel reports it; a slot held twice raises ``DUPLICATE_LRU_SLOT`` with the
    smallest such slot."""
    if lru_rows.numel() == 0:
        return
    num_slots = lru_rows.shape[1]
    values = lru_rows.to(torch.int64)
    outside = (values < 0) | (values >= num_slots)
    if bool(outside.any()):
        i, j = _first_index(outside)
        raise ResolveError(ResolveErrorCode.CORRUPT_LRU, int(rows[i]), int(values[i, j]),
                           num_slots)
    offsets = torch.arange(values.shape[0], device=values.device)[:, None] * num_slots
    counts = torch.bincount((values + offsets).reshape(-1), minlength=values.numel())
    twice = counts.view(values.shape) > 1
    if bool(twice.any()):
        i, slot = _first_index(twice)
        raise ResolveError(ResolveErrorCode.DUPLICATE_LRU_SLOT, int(rows[i]), slot, num_slots)


def _hot_state_rows(topk: torch.Tensor, token_rows: torch.Tensor, residency: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """int64 state rows of the requests that select a position on a non-resident page (the
    requests whose resolve reads ``lru``)."""
    num_rows, num_pages = residency.shape
    num_positions = num_pages * block_size
    if topk.numel() == 0 or num_rows == 0 or num_pages == 0:
        return torch.empty(0, dtype=torch.int64, device=topk.device)
    rows = token_rows.to(torch.int64)
    sel = topk.to(torch.int64)
    valid = (sel >= 0) & (sel < num_positions) & ((rows >= 0) & (rows < num_rows))[:, None]
    row_of = rows.clamp(0, num_rows - 1)[:, None].expand_as(sel)
    page = sel.clamp(0, num_positions - 1) // block_size
    host_backed = valid & (residency.to(torch.int64)[row_of, page] < 0)
    return torch.unique(row_of[host_backed])


def check_resolve_values(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru,
                         block_size, *unused_outputs) -> None:
    """Data checks of ``resolve`` that its kernel does not make (the CUDA debug path; the
    reference makes the same checks while it plans): the block tables of the batch's rows, and
    ``lru`` a permutation for every request with a host-backed selection. Takes the op's
    arguments; the outputs are not read."""
    check_resolve_tables(token_rows, residency, host_blocks, hot_blocks, block_size)
    rows = _hot_state_rows(topk, token_rows, residency, block_size)
    check_lru_rows(rows, lru.index_select(0, rows))


def check_gather_values(src_layers, dst_layers, miss_src, miss_dst,
                        miss_count) -> tuple[torch.Tensor, torch.Tensor]:
    """Data checks of ``gather_rows``: counts in ``[0, K]``, every counted entry a row of its
    layer list (no negative), destinations distinct. Returns the counted (src, dst) rows as
    int64 ``[N]`` in row-major order."""
    k = miss_src.shape[1]
    check_row_ids("miss_count", miss_count, k + 1)
    take = (torch.arange(k, device=miss_count.device)[None, :]
            < miss_count.to(torch.int64)[:, None])
    index_of = torch.nonzero(take)
    src_rows = miss_src[take].to(torch.int64)
    dst_rows = miss_dst[take].to(torch.int64)
    for name, rows, layers in (("miss_src", src_rows, src_layers),
                               ("miss_dst", dst_rows, dst_layers)):
        negative = rows < 0
        if bool(negative.any()):
            j = int(torch.nonzero(negative)[0])
            index = tuple(int(x) for x in index_of[j])
            raise NegativeIdError(name, f"{name}{list(index)} holds {int(rows[j])} within "
                                  f"miss_count: counted entries are rows, never negative",
                                  index, int(rows[j]))
        check_row_ids(name, rows, layers[0].shape[0])
    check_distinct("miss_dst", dst_rows, index_of)
    return src_rows, dst_rows


def _check_pairs(src_name: str, src_ids: torch.Tensor, src_limit: int, dst_name: str,
                 dst_ids: torch.Tensor, dst_limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (src, dst) id pairs without ``-1`` on either side, as int64, after checking: no id
    below -1, ids in range, destinations distinct."""
    check_sentinel_ids(src_name, src_ids)
    check_sentinel_ids(dst_name, dst_ids)
    keep = (src_ids >= 0) & (dst_ids >= 0)
    src = src_ids[keep].to(torch.int64)
    dst = dst_ids[keep].to(torch.int64)
    check_row_ids(src_name, src, src_limit)
    check_row_ids(dst_name, dst, dst_limit)
    check_distinct(dst_name, dst, torch.nonzero(keep))
    return src, dst


def check_block_copy_values(src_layers, dst_layers, src_blocks, dst_blocks,
                            block_size) -> tuple[torch.Tensor, torch.Tensor]:
    """Data checks of ``copy_blocks``; returns the (src, dst) blocks of the non-padding
    entries as int64."""
    return _check_pairs("src_blocks", src_blocks, src_layers[0].shape[0] // block_size,
                        "dst_blocks", dst_blocks, dst_layers[0].shape[0] // block_size)


def check_row_copy_values(src_layers, dst_layers, src_rows,
                          dst_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Data checks of ``mirror_rows``; returns the (src, dst) rows of the non-padding entries
    as int64."""
    return _check_pairs("src_rows", src_rows, src_layers[0].shape[0],
                        "dst_rows", dst_rows, dst_layers[0].shape[0])


COPY_VALUE_CHECKS = {"gather_rows": check_gather_values, "copy_blocks": check_block_copy_values,
                     "mirror_rows": check_row_copy_values}


# --------------------------------------------------------------------------------------
# score ops (ops/reference_scores.py)
# --------------------------------------------------------------------------------------

SCORE_DTYPES = (torch.float32, torch.bfloat16)


def check_row_strided(name: str, t: object, dtypes: Sequence[torch.dtype],
                      device: torch.device | None = None) -> torch.Tensor:
    """A 2-D tensor of one of ``dtypes`` whose rows are contiguous (``stride(1) == 1``) and
    do not overlap (``stride(0) >= shape[1]``): contiguous, or a column slice such as vLLM's
    aligned logits ``[:, :W]``."""
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    _check_not_meta(name, t)
    if t.dtype not in dtypes:
        _fail(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != 2:
        _fail(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    rows, cols = t.shape
    if (cols > 1 and t.stride(1) != 1) or (rows > 1 and t.stride(0) < cols):
        _fail(f"{name} must have contiguous rows (stride(1) == 1, stride(0) >= {cols}); got "
              f"strides {t.stride()} for shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        _fail(f"{name} is on {t.device}, expected {device} (the device of the logits)")
    return t


def check_score_threshold_args(logits, topk, threshold, width) -> None:
    """Metadata checks of ``score_threshold``."""
    dev = check_row_strided("logits", logits, SCORE_DTYPES).device
    rows = logits.shape[0]
    check_row_strided("topk", topk, (torch.int32,), dev)
    if topk.shape[0] != rows:
        _fail(f"topk must have {rows} rows (one per logits row), got {topk.shape[0]}")
    for name, t in (("threshold", threshold), ("width", width)):
        check_tensor(name, t, torch.float32, 1, dev)
        check_shape(name, t, (rows,), "one value per logits row")
    check_no_aliasing([("threshold", threshold), ("width", width)],
                      [("logits", logits), ("topk", topk)])


def check_next_n(next_n: object, rows: int) -> int:
    if isinstance(next_n, bool) or not isinstance(next_n, int) or next_n <= 0:
        _fail(f"next_n must be a positive int, got {next_n!r}")
    if rows % next_n:
        _fail(f"{rows} logits rows are not a whole number of requests of next_n = {next_n}")
    return next_n


def check_slot_classes_args(logits, threshold, width, next_n, batch_state_rows, slot_pos,
                            slot_class) -> None:
    """Metadata checks of ``slot_classes``."""
    dev = check_row_strided("logits", logits, SCORE_DTYPES).device
    rows = logits.shape[0]
    num_requests = rows // check_next_n(next_n, rows)
    for name, t in (("threshold", threshold), ("width", width)):
        check_tensor(name, t, torch.float32, 1, dev)
        check_shape(name, t, (rows,), "one value per logits row")
    check_tensor("batch_state_rows", batch_state_rows, torch.int32, 1, dev)
    if batch_state_rows.shape[0] < num_requests:
        _fail(f"batch_state_rows has {batch_state_rows.shape[0]} entries for {num_requests} "
              f"decode requests ({rows} logits rows / next_n = {next_n})")
    check_tensor("slot_pos", slot_pos, torch.int32, 2, dev)
    check_tensor("slot_class", slot_class, torch.uint8, 2, dev)
    check_shape("slot_class", slot_class, tuple(slot_pos.shape), "same [R, D] as slot_pos")
    check_no_aliasing([("slot_class", slot_class)],
                      [("logits", logits), ("threshold", threshold), ("width", width),
                       ("batch_state_rows", batch_state_rows), ("slot_pos", slot_pos)])


def check_slot_classes_values(logits, threshold, width, next_n, batch_state_rows, slot_pos,
                              slot_class) -> None:
    """Data checks of ``slot_classes`` (reads ``batch_state_rows`` back): every state row of
    a decode request in ``[-1, R)``, no two requests on one. The kernel skips a state row
    outside ``[0, R)``; two requests on one row would race on it."""
    num_requests = logits.shape[0] // next_n
    num_rows = slot_pos.shape[0]
    state = batch_state_rows[:num_requests].to(torch.int64)
    check_sentinel_ids("batch_state_rows", state)
    tracked = state[state >= 0]
    check_row_ids("batch_state_rows", tracked, num_rows)
    if tracked.numel() > 1:
        ordered = torch.sort(tracked).values
        same = ordered[1:] == ordered[:-1]
        if bool(same.any()):
            row = int(ordered[1:][same][0])
            _fail(f"batch_state_rows holds state row {row} for two decode requests: each "
                  f"request's slot classes go to its own state row")
