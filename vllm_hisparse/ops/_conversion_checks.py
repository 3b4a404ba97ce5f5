"""Argument checks of the ops that finish a top-k conversion (``token_state_rows``,
``merge_rows``, ``merge_table_rows``; ops/reference.py), in the style of
:mod:`vllm_hisparse.ops._checks`."""

from __future__ import annotations

import torch

from vllm_hisparse.ops._checks import _fail, check_no_aliasing, check_shape, check_tensor


def check_token_state_rows_args(batch_rows, step_table, out, limit) -> None:
    if not isinstance(batch_rows, torch.Tensor) or batch_rows.dtype not in (torch.int32,
                                                                            torch.int64):
        _fail(f"batch_rows must be an int32 or int64 torch.Tensor, got "
              f"{getattr(batch_rows, 'dtype', type(batch_rows).__name__)}")
    check_tensor("batch_rows", batch_rows, batch_rows.dtype, 1)
    device = batch_rows.device
    check_tensor("step_table", step_table, torch.int32, 1, device)
    if step_table.shape[0] < 1:
        _fail("step_table must hold at least the token count ([1 + num_batch_rows])")
    check_tensor("out", out, torch.int32, 1, device)
    check_shape("out", out, tuple(batch_rows.shape), "one state row per token")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        _fail(f"limit must be an int or None, got {limit!r}")
    check_no_aliasing([("out", out)], [("batch_rows", batch_rows), ("step_table", step_table)])


def check_merge_rows_args(ours, token_rows, theirs, from_stride_rows, to_stride_rows, out,
                          counts) -> None:
    written = _check_merge_common(ours, token_rows, from_stride_rows, to_stride_rows, out,
                                  counts)
    check_tensor("theirs", theirs, torch.int32, 2, ours.device)
    check_shape("theirs", theirs, tuple(ours.shape), "the shape of ours")
    check_no_aliasing(written, [("ours", ours), ("token_rows", token_rows), ("theirs", theirs)])


def check_merge_table_rows_args(ours, token_rows, topk, batch_rows, block_table, block_size,
                                from_stride_rows, to_stride_rows, out, counts) -> None:
    written = _check_merge_common(ours, token_rows, from_stride_rows, to_stride_rows, out,
                                  counts)
    device = ours.device
    check_tensor("topk", topk, torch.int32, 2, device)
    check_shape("topk", topk, tuple(ours.shape), "the shape of ours")
    check_tensor("batch_rows", batch_rows, torch.int32, 1, device)
    check_shape("batch_rows", batch_rows, (ours.shape[0],), "one batch row per token")
    check_tensor("block_table", block_table, torch.int32, 2, device)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        _fail(f"block_size must be a positive int, got {block_size!r}")
    check_no_aliasing(written, [("ours", ours), ("token_rows", token_rows), ("topk", topk),
                                ("batch_rows", batch_rows), ("block_table", block_table)])


def _check_merge_common(ours, token_rows, from_stride_rows, to_stride_rows, out, counts):
    """The arguments every merge shares; returns the written tensors (name, tensor)."""
    check_tensor("ours", ours, torch.int32, 2)
    device = ours.device
    num_tokens, k = ours.shape
    check_tensor("token_rows", token_rows, torch.int32, 1, device)
    check_shape("token_rows", token_rows, (num_tokens,), "one entry per token of ours")
    check_tensor("out", out, torch.int32, 2, device)
    check_shape("out", out, (num_tokens, k), "the shape of ours")
    for name, stride in (("from_stride_rows", from_stride_rows),
                         ("to_stride_rows", to_stride_rows)):
        if isinstance(stride, bool) or not isinstance(stride, int) or stride <= 0:
            _fail(f"{name} must be a positive int, got {stride!r}")
    written = [("out", out)]
    if counts is not None:
        check_tensor("counts", counts, torch.int32, 1, device)
        check_shape("counts", counts, (num_tokens,), "one count per token")
        written.append(("counts", counts))
    return written
