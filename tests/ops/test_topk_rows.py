"""token_state_rows, merge_rows and merge_table_rows: the reference twins against a plain
per-entry definition, the CUDA kernels against the twins (exact), on random and adversarial
inputs."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse import ops
from vllm_hisparse.ops import reference

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def plain_token_state_rows(batch_rows, table, limit):
    real, rows = int(table[0]), table[1:].tolist()
    out = []
    for t, b in enumerate(batch_rows.tolist()):
        ok = 0 <= b < len(rows) and t < real and (limit is None or t < limit)
        out.append(rows[b] if ok else -1)
    return out


def plain_merge(ours, token_rows, theirs, frm, to, compact):
    out, counts = [], []
    for t in range(ours.shape[0]):
        if token_rows[t] >= 0:
            row = [(r // frm) * to + r % frm if r >= 0 else r for r in ours[t].tolist()]
        else:
            row = theirs[t].tolist()
        if compact:
            valid = [v for v in row if v >= 0]
            counts.append(len(valid))
            row = valid + [-1] * (len(row) - len(valid))
        out.append(row)
    return out, counts


def merge_case(T, K, seed, tracked_share=0.5, valid_share=0.7):
    g = torch.Generator().manual_seed(seed)
    ours = torch.randint(0, 1 << 20, (T, K), generator=g, dtype=torch.int32)
    theirs = torch.randint(0, 1 << 20, (T, K), generator=g, dtype=torch.int32)
    ours[torch.rand(T, K, generator=g) > valid_share] = -1
    theirs[torch.rand(T, K, generator=g) > valid_share] = -1
    token_rows = torch.where(torch.rand(T, generator=g) < tracked_share,
                             torch.randint(0, 64, (T,), generator=g, dtype=torch.int32),
                             torch.full((T,), -1, dtype=torch.int32))
    return ours, token_rows, theirs


MERGE_SHAPES = [(1, 1), (3, 7), (17, 2048), (5, 2049), (2, 4096 + 300), (0, 16), (4, 0)]


def plain_table_rows(topk, batch_rows, table, block_size, stride):
    """vLLM's decode conversion, entry by entry (int32 wrap-around of its Triton arithmetic)."""
    out = []
    for t, b in enumerate(batch_rows.tolist()):
        row = []
        for p in topk[t].tolist():
            page = p // block_size if p >= 0 else -1
            if p < 0 or not 0 <= b < table.shape[0] or page >= table.shape[1]:
                row.append(-1)
                continue
            v = (int(table[b, page]) * stride + p % block_size) & 0xFFFFFFFF
            row.append(v - (1 << 32) if v >= 1 << 31 else v)
        out.append(row)
    return torch.tensor(out, dtype=torch.int32).reshape(topk.shape)


def table_case(T, K, seed, tracked_share=0.5, valid_share=0.7, bs=64, pages=40, rows=9):
    """merge_case's ours / token_rows, plus positions (some negative, some past the table),
    batch rows (some outside the table) and a block table with the null block and one entry
    large enough to wrap int32 once multiplied by the stride."""
    ours, token_rows, _ = merge_case(T, K, seed, tracked_share, valid_share)
    g = torch.Generator().manual_seed(seed + 1)
    topk = torch.randint(-3, bs * (pages + 4), (T, K), generator=g, dtype=torch.int32)
    topk[torch.rand(T, K, generator=g) > valid_share] = -1
    batch_rows = torch.randint(-1, rows + 1, (T,), generator=g, dtype=torch.int32)
    table = torch.randint(0, 1 << 16, (rows, pages), generator=g, dtype=torch.int32)
    table[0, 0] = (1 << 31) - 1  # wraps
    return ours, token_rows, topk, batch_rows, table


@pytest.mark.parametrize("T,K", MERGE_SHAPES)
@pytest.mark.parametrize("frm,to", [(64, 64), (128, 64), (64, 320)])
@pytest.mark.parametrize("compact", [False, True])
def test_reference_merge_table_rows_is_merge_of_vllms_rows(T, K, frm, to, compact):
    ours, token_rows, topk, batch_rows, table = table_case(T, K, seed=T * 7 + K)
    theirs = plain_table_rows(topk, batch_rows, table, 64, to)
    out = torch.empty_like(ours)
    counts = torch.empty(T, dtype=torch.int32) if compact else None
    reference.merge_table_rows(ours, token_rows, topk, batch_rows, table, 64, frm, to, out,
                               counts)
    want, want_counts = plain_merge(ours, token_rows.tolist(), theirs, frm, to, compact)
    assert out.tolist() == want
    if compact:
        assert counts.tolist() == want_counts


@pytest.mark.parametrize("backend", ["reference",
                                     pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
def test_merge_table_rows_with_an_empty_table_is_all_padding_for_untracked_tokens(backend):
    device = "cuda" if backend == "cuda" else "cpu"
    ours, token_rows, topk, batch_rows, _ = (x.to(device) for x in table_case(6, 16, seed=5))
    for shape in ((0, 4), (3, 0)):
        table = torch.zeros(shape, dtype=torch.int32, device=device)
        out = torch.empty_like(ours)
        ops.select(backend).merge_table_rows(ours, token_rows, topk, batch_rows, table, 64, 64,
                                             64, out)
        untracked = token_rows < 0
        assert (out[untracked] == -1).all() and torch.equal(out[~untracked], ours[~untracked])


def test_merge_table_rows_refuses_bad_arguments():
    ours, token_rows, topk, batch_rows, table = table_case(4, 8, seed=2)
    out = torch.empty_like(ours)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        ops.merge_table_rows(ours, token_rows, topk, batch_rows, table, 0, 64, 64, out)
    with pytest.raises(ValueError, match="topk must have shape"):
        ops.merge_table_rows(ours, token_rows, topk[:, :4].contiguous(), batch_rows, table, 64, 64,
                             64, out)
    with pytest.raises(ValueError, match="batch_rows must have dtype torch.int32"):
        ops.merge_table_rows(ours, token_rows, topk, batch_rows.long(), table, 64, 64, 64, out)
    with pytest.raises(ValueError, match="block_table must be contiguous"):
        ops.merge_table_rows(ours, token_rows, topk, batch_rows, table.t(), 64, 64, 64, out)
    with pytest.raises(ValueError, match="out shares memory"):
        ops.merge_table_rows(ours, token_rows, topk, batch_rows, table, 64, 64, 64, topk)


@pytest.mark.parametrize("T,K", MERGE_SHAPES)
@pytest.mark.parametrize("frm,to", [(64, 64), (128, 64), (64, 320)])
@pytest.mark.parametrize("compact", [False, True])
def test_reference_merge_matches_the_plain_definition(T, K, frm, to, compact):
    ours, token_rows, theirs = merge_case(T, K, seed=T * 31 + K)
    out = torch.empty_like(ours)
    counts = torch.empty(T, dtype=torch.int32) if compact else None
    reference.merge_rows(ours, token_rows, theirs, frm, to, out, counts)
    want, want_counts = plain_merge(ours, token_rows.tolist(), theirs, frm, to, compact)
    assert out.tolist() == want
    if compact:
        assert counts.tolist() == want_counts


def test_merge_refuses_an_output_that_overlaps_an_input():
    ours, token_rows, theirs = merge_case(4, 8, seed=1)
    with pytest.raises(ValueError, match="out shares memory"):
        ops.merge_rows(ours, token_rows, theirs, 64, 64, theirs)
    with pytest.raises(ValueError, match="to_stride_rows"):
        ops.merge_rows(ours, token_rows, theirs, 64, 0, torch.empty_like(ours))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("limit", [None, 0, 5, 100])
def test_reference_token_state_rows(dtype, limit):
    g = torch.Generator().manual_seed(7)
    batch_rows = torch.randint(-2, 12, (40,), generator=g).to(dtype)  # some outside [0, B)
    table = torch.cat([torch.tensor([30], dtype=torch.int32),
                       torch.randint(-1, 500, (10,), generator=g, dtype=torch.int32)])
    out = torch.empty(40, dtype=torch.int32)
    reference.token_state_rows(batch_rows, table, out, limit)
    assert out.tolist() == plain_token_state_rows(batch_rows, table, limit)


def test_token_state_rows_of_an_inert_table_are_all_padding():
    table = torch.full((9,), -1, dtype=torch.int32)  # StepView outside a step
    out = torch.empty(5, dtype=torch.int32)
    reference.token_state_rows(torch.arange(5, dtype=torch.int32), table, out)
    assert out.tolist() == [-1] * 5


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T,K", MERGE_SHAPES + [(256, 2048), (8192, 2048)])
@pytest.mark.parametrize("frm,to", [(64, 64), (128, 64)])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("shares", [(0.5, 0.7), (0.0, 1.0), (1.0, 0.0), (1.0, 1.0)])
def test_cuda_merge_equals_the_reference(T, K, frm, to, compact, shares):
    ours, token_rows, theirs = merge_case(T, K, seed=T + K, tracked_share=shares[0],
                                          valid_share=shares[1])
    want = torch.empty_like(ours)
    want_counts = torch.empty(T, dtype=torch.int32) if compact else None
    reference.merge_rows(ours, token_rows, theirs, frm, to, want, want_counts)
    d = [x.cuda() for x in (ours, token_rows, theirs)]
    out = torch.full_like(d[0], 12345)
    counts = torch.full((T,), 12345, dtype=torch.int32, device="cuda") if compact else None
    ops.select("cuda").merge_rows(*d, frm, to, out, counts)
    assert torch.equal(out.cpu(), want)
    if compact:
        assert torch.equal(counts.cpu(), want_counts)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("limit", [None, 0, 3000])
def test_cuda_token_state_rows_equal_the_reference(dtype, limit):
    g = torch.Generator().manual_seed(3)
    batch_rows = torch.randint(-3, 300, (5000,), generator=g).to(dtype)
    table = torch.cat([torch.tensor([4000], dtype=torch.int32),
                       torch.randint(-1, 900, (256,), generator=g, dtype=torch.int32)])
    want = torch.empty(5000, dtype=torch.int32)
    reference.token_state_rows(batch_rows, table, want, limit)
    out = torch.full((5000,), 77, dtype=torch.int32, device="cuda")
    ops.select("cuda").token_state_rows(batch_rows.cuda(), table.cuda(), out, limit)
    assert torch.equal(out.cpu(), want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("T,K", MERGE_SHAPES + [(256, 2048), (8192, 2048)])
@pytest.mark.parametrize("frm,to", [(64, 64), (128, 64)])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("shares", [(0.5, 0.7), (0.0, 1.0), (1.0, 0.0), (0.0, 0.0)])
def test_cuda_merge_table_rows_equals_the_reference(T, K, frm, to, compact, shares):
    args = table_case(T, K, seed=T + 3 * K, tracked_share=shares[0], valid_share=shares[1])
    want = torch.empty_like(args[0])
    want_counts = torch.empty(T, dtype=torch.int32) if compact else None
    reference.merge_table_rows(*args[:4], args[4], 64, frm, to, want, want_counts)
    d = [x.cuda() for x in args]
    out = torch.full_like(d[0], 12345)
    counts = torch.full((T,), 12345, dtype=torch.int32, device="cuda") if compact else None
    ops.select("cuda").merge_table_rows(*d, 64, frm, to, out, counts)
    assert torch.equal(out.cpu(), want)
    if compact:
        assert torch.equal(counts.cpu(), want_counts)


@pytest.mark.parametrize("backend", ["reference",
                                     pytest.param("cuda", marks=[gpu, pytest.mark.gpu])])
@pytest.mark.parametrize("bs", [1, 16, 48, 100])
@pytest.mark.parametrize("T,K", [(17, 2048), (5, 2049)])
def test_merge_table_rows_with_any_block_size(backend, bs, T, K):
    """The kernel divides a position by a power-of-two block size with a shift and by any
    other with a division: both equal the entry-by-entry definition."""
    device = "cuda" if backend == "cuda" else "cpu"
    ours, token_rows, topk, batch_rows, table = table_case(T, K, seed=bs + T, bs=bs)
    theirs = plain_table_rows(topk, batch_rows, table, bs, 64)
    want, want_counts = plain_merge(ours, token_rows.tolist(), theirs, 64, 64, True)
    d = [x.to(device) for x in (ours, token_rows, topk, batch_rows, table)]
    out = torch.full_like(d[0], 12345)
    counts = torch.full((T,), 12345, dtype=torch.int32, device=device)
    ops.select(backend).merge_table_rows(*d, bs, 64, 64, out, counts)
    assert out.cpu().tolist() == want and counts.cpu().tolist() == want_counts
