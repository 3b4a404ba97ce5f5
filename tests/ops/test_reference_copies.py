"""Reference copy ops: gather_rows (miss plans), copy_blocks (spill/restore), mirror_rows."""

from __future__ import annotations

import random
import re

import pytest
import torch

from resolve_cases import call_copy, copy_defect_cases, random_case
from vllm_hisparse import ops
from vllm_hisparse.ops import errors, reference

ROW_BYTES = (656, 1152, 16)


def layers(num_layers: int, rows: int, row_bytes: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)
            for _ in range(num_layers)]


def snapshot(ts):
    return [t.clone() for t in ts]


@pytest.mark.parametrize("row_bytes", ROW_BYTES)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_gather_rows_copies_planned_rows_only(row_bytes, num_layers):
    src = layers(num_layers, 64, row_bytes, 1)
    dst = layers(num_layers, 40, row_bytes, 2)
    src_before, dst_before = snapshot(src), snapshot(dst)
    miss_src = torch.tensor([[5, 9, 63, 0], [7, 7, 7, 7], [1, 2, 3, 4]], dtype=torch.int32)
    miss_dst = torch.tensor([[0, 39, 4, 8], [12, -5, 99, 99], [20, 21, 22, 23]], dtype=torch.int32)
    miss_count = torch.tensor([4, 1, 0], dtype=torch.int32)
    ops.gather_rows(src, dst, miss_src, miss_dst, miss_count)
    expected = snapshot(dst_before)
    for l in range(num_layers):
        for s, d in [(5, 0), (9, 39), (63, 4), (0, 8), (7, 12)]:
            expected[l][d] = src_before[l][s]
        assert torch.equal(dst[l], expected[l])  # targeted rows copied, all others unchanged
        assert torch.equal(src[l], src_before[l])  # source untouched


def test_gather_rows_executes_a_resolve_plan():
    """resolve's miss plan, executed, puts every host-backed selection's bytes where
    out_rows says attention will read them."""
    rng = random.Random(7)
    for _ in range(30):
        case = random_case(rng, block_size=4)
        if case.topk.shape[0] == 0:
            continue
        num_rows, num_pages = case.residency.shape
        bs = case.block_size
        host_rows = int(case.host_blocks.max()) * bs + bs
        device_rows = int(max(case.residency.max(), case.hot_blocks.max())) * bs + bs
        row_bytes = 32
        # Ground truth: the KV of (state row, position) is a deterministic byte pattern.
        truth = torch.zeros((num_rows, num_pages * bs, row_bytes), dtype=torch.uint8)
        for r in range(num_rows):
            for p in range(num_pages * bs):
                truth[r, p] = (torch.arange(row_bytes) * 7 + r * 31 + p * 13) % 256
        host = torch.zeros((host_rows, row_bytes), dtype=torch.uint8)
        device = torch.zeros((device_rows, row_bytes), dtype=torch.uint8)
        for r in range(num_rows):
            for p in range(num_pages * bs):
                host[int(case.host_blocks[r, p // bs]) * bs + p % bs] = truth[r, p]
                blk = int(case.residency[r, p // bs])
                if blk >= 0:
                    device[blk * bs + p % bs] = truth[r, p]
            for s, pos in enumerate(case.slot_pos[r].tolist()):
                if pos >= 0:  # slots hold the bytes of the position they claim
                    device[int(case.hot_blocks[r, s // bs]) * bs + s % bs] = truth[r, pos]
        try:
            ops.resolve(*case.args())
        except ops.ResolveError:
            continue
        ops.gather_rows([host], [device], case.miss_src, case.miss_dst, case.miss_count)
        for t in range(case.topk.shape[0]):
            r = int(case.token_rows[t])
            for j in range(case.topk.shape[1]):
                p = int(case.topk[t, j])
                if r < 0 or p < 0:
                    assert case.out_rows[t, j] == -1
                    continue
                assert torch.equal(device[int(case.out_rows[t, j])], truth[r, p])


@pytest.mark.parametrize("row_bytes", ROW_BYTES)
def test_copy_blocks_moves_whole_pages_and_skips_padding(row_bytes):
    bs = 4
    src = layers(2, 10 * bs, row_bytes, 3)
    dst = layers(2, 6 * bs, row_bytes, 4)
    src_before, dst_before = snapshot(src), snapshot(dst)
    src_blocks = torch.tensor([2, 9, -1, 0, 5], dtype=torch.int32)
    dst_blocks = torch.tensor([5, 0, 3, -1, 1], dtype=torch.int32)
    ops.copy_blocks(src, dst, src_blocks, dst_blocks, bs)
    for l in range(2):
        expected = dst_before[l].clone()
        for s, d in [(2, 5), (9, 0), (5, 1)]:
            expected[d * bs:(d + 1) * bs] = src_before[l][s * bs:(s + 1) * bs]
        assert torch.equal(dst[l], expected)
        assert torch.equal(src[l], src_before[l])


def test_mirror_rows_copies_rows_and_skips_padding():
    src = layers(3, 30, 656, 5)
    dst = layers(3, 50, 656, 6)
    dst_before = snapshot(dst)
    src_rows = torch.tensor([0, 29, -1, 7], dtype=torch.int32)
    dst_rows = torch.tensor([49, 0, 3, -1], dtype=torch.int32)
    ops.mirror_rows(src, dst, src_rows, dst_rows)
    for l in range(3):
        expected = dst_before[l].clone()
        expected[49] = src[l][0]
        expected[0] = src[l][29]
        assert torch.equal(dst[l], expected)


def test_empty_plans_copy_nothing():
    src, dst = layers(1, 8, 16, 7), layers(1, 8, 16, 8)
    before = snapshot(dst)
    empty = torch.zeros((0,), dtype=torch.int32)
    ops.gather_rows(src, dst, torch.zeros((0, 4), dtype=torch.int32),
                    torch.zeros((0, 4), dtype=torch.int32), empty)
    ops.copy_blocks(src, dst, empty, empty, 4)
    ops.mirror_rows(src, dst, empty, empty)
    assert torch.equal(dst[0], before[0])


@pytest.mark.parametrize("call,text", [
    (lambda s, d: ops.gather_rows(s, d[:1], *_plan()), "src_layers has 2 layers but dst_layers has 1"),
    (lambda s, d: ops.gather_rows([], [], *_plan()), "src_layers is empty"),
    (lambda s, d: ops.gather_rows(s[0], d[0], *_plan()), "must be a list or tuple"),
    (lambda s, d: ops.gather_rows([s[0].view(torch.int8)] + s[1:], d, *_plan()),
     r"src_layers\[0\] must have dtype torch.uint8"),
    (lambda s, d: ops.gather_rows([x[:, ::2] for x in s], d, *_plan()),
     r"src_layers\[0\] must be contiguous or row-strided"),
    (lambda s, d: ops.gather_rows(s, [torch.zeros(40, 56, dtype=torch.uint8)[:, :32]] * 2,
                                  *_plan()),
     r"dst_layers\[0\] must be contiguous or row-strided .*multiple of 16"),
    (lambda s, d: ops.gather_rows([x[:, :16].contiguous() for x in s], d, *_plan()),
     "rows of 16 B but dst_layers"),
    (lambda s, d: ops.gather_rows(s, d, *_plan(count=5)), "miss_count holds 5, outside"),
    (lambda s, d: ops.gather_rows(s, d, *_plan(src_row=64)), "miss_src holds 64, outside"),
    (lambda s, d: ops.copy_blocks(s, d, torch.tensor([1], dtype=torch.int32),
                                  torch.tensor([1, 2], dtype=torch.int32), 4),
     "dst_blocks must have shape"),
    (lambda s, d: ops.copy_blocks(s, d, torch.tensor([16], dtype=torch.int32),
                                  torch.tensor([1], dtype=torch.int32), 4),
     "src_blocks holds 16, outside"),
    (lambda s, d: ops.copy_blocks(s, d, torch.tensor([1], dtype=torch.int32),
                                  torch.tensor([1], dtype=torch.int32), 5),
     "not a multiple of block_size"),
    (lambda s, d: ops.mirror_rows(s, d, torch.tensor([1], dtype=torch.int64),
                                  torch.tensor([1], dtype=torch.int32)),
     "src_rows must have dtype torch.int32"),
])
def test_bad_copy_arguments_are_named(call, text):
    src = layers(2, 64, 32, 9)
    dst = layers(2, 40, 32, 10)
    with pytest.raises(ValueError, match=text):
        call(src, dst)


def _plan(count: int = 1, src_row: int = 3):
    return (torch.tensor([[src_row, 0]], dtype=torch.int32),
            torch.tensor([[1, 0]], dtype=torch.int32),
            torch.tensor([count], dtype=torch.int32))


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


@pytest.mark.parametrize("name,op,ids,error,text", list(copy_defect_cases()),
                         ids=[c[0] for c in copy_defect_cases()])
def test_copy_defects_raise_named_errors_and_copy_nothing(name, op, ids, error, text):
    src, dst = layers(2, 64, 32, 31), layers(2, 40, 32, 32)
    before = snapshot(dst)
    with pytest.raises(error, match=re.escape(text)) as info:
        call_copy(ops, op, src, dst, ids)
    assert isinstance(info.value, ValueError)
    assert info.value.argument == text.split("[")[0]
    assert all(torch.equal(a, b) for a, b in zip(dst, before))


def test_copies_accept_what_the_contract_allows():
    """Repeated sources, destinations repeated only past miss_count or beside a -1, and -1
    padding are all valid."""
    src, dst = layers(2, 64, 32, 33), layers(2, 40, 32, 34)
    ops.gather_rows(src, dst, i32([[5, 5, 9]]), i32([[1, 2, 1]]), i32([2]))
    assert all(torch.equal(d[1], s[5]) and torch.equal(d[2], s[5]) for s, d in zip(src, dst))
    ops.copy_blocks(src, dst, i32([1, -1, 1, 2]), i32([3, 3, 4, -1]), 4)
    assert all(torch.equal(d[12:16], s[4:8]) and torch.equal(d[16:20], s[4:8])
               for s, d in zip(src, dst))
    ops.mirror_rows(src, dst, i32([-1, 7, 8]), i32([0, 0, -1]))
    assert all(torch.equal(d[0], s[7]) for s, d in zip(src, dst))


@pytest.mark.parametrize("seed", range(20))
def test_random_resolve_plans_pass_the_gather_checks(seed):
    """Every plan resolve writes has distinct destinations within its counts."""
    case = random_case(random.Random(70_000 + seed), resident_fraction=0.3)
    reference.resolve(*case.args())
    bs = case.block_size
    host_rows = int(case.host_blocks.max()) * bs + bs
    device_rows = int(max(case.residency.max(), case.hot_blocks.max())) * bs + bs
    src, dst = layers(1, host_rows, 16, seed), layers(1, device_rows, 16, seed + 1)
    ops.gather_rows(src, dst, case.miss_src, case.miss_dst, case.miss_count)


@pytest.mark.parametrize("call,text", [
    (lambda s, d, v: ops.gather_rows(s, s, i32([[1]]), i32([[2]]), i32([1])),
     "dst_layers[0] shares memory with src_layers[0]"),
    (lambda s, d, v: ops.mirror_rows([d[1], d[0]], d, i32([1]), i32([2])),
     "dst_layers[1] shares memory with src_layers[0]"),
    (lambda s, d, v: ops.copy_blocks(s, d, d[1].view(torch.int32)[0, :2], i32([0, 1]), 4),
     "dst_layers[1] shares memory with src_blocks"),
    (lambda s, d, v: ops.mirror_rows([v[0]], [v[0]], i32([1]), i32([2])),
     "dst_layers[0] shares memory with src_layers[0]"),
    (lambda s, d, v: ops.mirror_rows([v[0]], [v[1]], i32([1]), i32([2])), None),
    (lambda s, d, v: ops.copy_blocks([v[1], v[2]], [v[0], v[1]], i32([1]), i32([2]), 4),
     "dst_layers[1] shares memory with src_layers[0]"),
])
def test_destinations_aliasing_other_arguments_are_rejected(call, text):
    """Exact for row-strided views: two layers of one position-major pool interleave without
    sharing a byte, so copying between them is allowed."""
    src, dst = layers(2, 64, 32, 35), layers(2, 40, 32, 36)
    _, views = strided_layers(3, 40, 48, 37)
    if text is None:
        call(src, dst, views)
        return
    with pytest.raises(errors.AliasedOutputError, match=re.escape(text)):
        call(src, dst, views)


@pytest.mark.parametrize("call,text", [
    (lambda s, d: ops.gather_rows([s[0].to("meta"), s[1]], d, i32([[1]]), i32([[2]]), i32([1])),
     "src_layers[0] is a meta tensor"),
    (lambda s, d: ops.copy_blocks(s, [x.to("meta") for x in d], i32([1]), i32([2]), 4),
     "dst_layers[0] is a meta tensor"),
    (lambda s, d: ops.mirror_rows(s, d, i32([1]).to("meta"), i32([2])),
     "src_rows is a meta tensor"),
    (lambda s, d: ops.gather_rows(s, d, i32([[1]]), i32([[2]]), i32([1]).to("meta")),
     "miss_count is a meta tensor"),
])
def test_meta_tensors_are_rejected(call, text):
    src, dst = layers(2, 64, 32, 38), layers(2, 40, 32, 39)
    with pytest.raises(errors.MetaTensorError, match=re.escape(text)):
        call(src, dst)


def test_reference_twins_share_signatures_with_public_ops():
    import inspect
    for name in ("resolve", "gather_rows", "copy_blocks", "mirror_rows"):
        assert inspect.signature(getattr(ops, name)) == inspect.signature(getattr(reference, name))


# --------------------------------------------------------------------------------------
# row-strided layer views (a position-major host pool: layer l = rows of stride L * row_bytes)
# --------------------------------------------------------------------------------------


def strided_layers(num_layers: int, rows: int, row_bytes: int, seed: int):
    """(buffer [rows, L, row_bytes], L row-strided layer views into it)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (rows, num_layers, row_bytes), dtype=torch.uint8, generator=g)
    views = [buf[:, l, :] for l in range(num_layers)]
    assert all(not v.is_contiguous() and v.stride() == (num_layers * row_bytes, 1)
               for v in views) or num_layers == 1
    return buf, views


def assert_buffer_is(buf: torch.Tensor, dense_layers: list[torch.Tensor]) -> None:
    """Every byte of the position-major buffer (so untouched rows too) equals the dense twin."""
    assert torch.equal(buf, torch.stack(dense_layers, dim=1))


@pytest.mark.parametrize("row_bytes", (656, 48, 32))
@pytest.mark.parametrize("side", ["src", "dst", "both"])
def test_gather_rows_on_row_strided_layers(row_bytes, side):
    L = 3
    sbuf, s_strided = strided_layers(L, 64, row_bytes, 21)
    dbuf, d_strided = strided_layers(L, 40, row_bytes, 22)
    s_dense = [v.contiguous() for v in s_strided]
    d_dense = [v.contiguous() for v in d_strided]
    src = s_strided if side in ("src", "both") else [v.clone() for v in s_dense]
    dst = d_strided if side in ("dst", "both") else [v.clone() for v in d_dense]
    miss_src = torch.tensor([[5, 9, 63, 0], [7, 7, 7, 7]], dtype=torch.int32)
    miss_dst = torch.tensor([[0, 39, 4, 8], [12, -5, 99, 99]], dtype=torch.int32)
    miss_count = torch.tensor([4, 1], dtype=torch.int32)
    sbuf_before = sbuf.clone()
    ops.gather_rows(src, dst, miss_src, miss_dst, miss_count)
    ops.gather_rows(s_dense, d_dense, miss_src, miss_dst, miss_count)
    for l in range(L):
        assert torch.equal(dst[l], d_dense[l])
    assert torch.equal(sbuf, sbuf_before)
    if side in ("dst", "both"):
        assert_buffer_is(dbuf, d_dense)


@pytest.mark.parametrize("direction", ["spill", "restore"])
def test_copy_blocks_and_mirrors_on_row_strided_host_layers(direction):
    L, bs, row_bytes = 2, 4, 48
    hbuf, host = strided_layers(L, 10 * bs, row_bytes, 23)
    dev = layers(L, 6 * bs, row_bytes, 24)
    host_dense = [v.contiguous() for v in host]
    dev_twin = snapshot(dev)
    sb = torch.tensor([3, -1, 5, 0], dtype=torch.int32)
    db = torch.tensor([1, 4, -1, 2], dtype=torch.int32)
    if direction == "spill":
        ops.copy_blocks(dev, host, db, sb, bs)
        ops.copy_blocks(dev_twin, host_dense, db, sb, bs)
        assert_buffer_is(hbuf, host_dense)
    else:
        ops.copy_blocks(host, dev, sb, db, bs)
        ops.copy_blocks(host_dense, dev_twin, sb, db, bs)
        assert all(torch.equal(a, b) for a, b in zip(dev, dev_twin))
    sr = torch.tensor([1, 2, -1, 7], dtype=torch.int32)
    dr = torch.tensor([5, -1, 6, 39], dtype=torch.int32)
    ops.mirror_rows(dev, host, sr, dr)
    ops.mirror_rows(dev_twin, host_dense, sr, dr)
    assert_buffer_is(hbuf, host_dense)
