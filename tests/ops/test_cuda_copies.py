"""gather_rows / copy_blocks / mirror_rows on the CUDA kernels against the pure-torch twins,
byte for byte, with untouched destination rows checked (GPU only): dense and row-strided
layers, capped grids, split launches, bad strides."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.ops import reference

from cuda_harness import DEV, assert_same, cuda_ops, layers, random_plan, run_both, simple_case

pytestmark = pytest.mark.gpu


# --------------------------------------------------------------------------------------
# copies
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("row_bytes", [656, 1152, 64, 16, 592])
@pytest.mark.parametrize("rows_per_warp", [0, 1, 2, 4, 8, 16])
def test_gather_rows_matches_reference(row_bytes, rows_per_warp):
    L, T, K = 3, 7, 40
    src_rows, dst_rows = 2000, 600
    src_host = layers(L, src_rows, row_bytes, "cpu", pinned=True, seed=1)
    dst_dev = layers(L, dst_rows, row_bytes, DEV, seed=2)
    expected = [d.cpu().clone() for d in dst_dev]
    ms, md, mc = random_plan(T, K, src_rows, dst_rows, seed=row_bytes + rows_per_warp)
    reference.gather_rows(src_host, expected, ms, md, mc)
    cuda_ops.gather_rows_tuned(src_host, dst_dev, ms.to(DEV), md.to(DEV), mc.to(DEV),
                               rows_per_warp=rows_per_warp, ctas_per_sm=0)
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst_dev[l].cpu(), expected[l]), f"layer {l}"


@pytest.mark.parametrize("max_ctas", [1, 3, 1000])
def test_gather_rows_with_a_capped_grid_copies_every_row(max_ctas):
    # The side-stream prefetch caps the grid (a few CTAs stride over every item): a grid of
    # 1 CTA must still copy each of the 3 x ~700 rows, and a cap above the grid is a no-op.
    L, T, K = 3, 31, 48
    src_host = layers(L, 3000, 656, "cpu", pinned=True, seed=11)
    dst_dev = layers(L, 2000, 656, DEV, seed=12)
    expected = [d.cpu().clone() for d in dst_dev]
    ms, md, mc = random_plan(T, K, 3000, 2000, seed=13)
    reference.gather_rows(src_host, expected, ms, md, mc)
    cuda_ops.gather_rows_tuned(src_host, dst_dev, ms.to(DEV), md.to(DEV), mc.to(DEV),
                               rows_per_warp=None, ctas_per_sm=None, max_ctas=max_ctas)
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst_dev[l].cpu(), expected[l]), f"layer {l}"


def test_gather_rows_rejects_a_negative_grid_cap():
    t = torch.zeros((1, 1), dtype=torch.int32, device=DEV)
    lay = layers(1, 4, 656, DEV, seed=1)
    with pytest.raises(ValueError, match="max_ctas"):
        cuda_ops.gather_rows_tuned(lay, lay, t, t, t[0], rows_per_warp=None, ctas_per_sm=None,
                                   max_ctas=-1)


def test_gather_rows_default_tuning_and_device_source():
    L, T, K = 2, 33, 100
    src = layers(L, 5000, 656, DEV, seed=3)
    dst = layers(L, 4000, 656, DEV, seed=4)
    expected = [d.cpu().clone() for d in dst]
    ms, md, mc = random_plan(T, K, 5000, 4000, seed=5)
    reference.gather_rows([s.cpu() for s in src], expected, ms, md, mc)
    cuda_ops.gather_rows(src, dst, ms.to(DEV), md.to(DEV), mc.to(DEV))
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst[l].cpu(), expected[l])


def test_gather_rows_zero_counts_touch_nothing():
    src = layers(1, 100, 656, "cpu", pinned=True, seed=6)
    dst = layers(1, 100, 656, DEV, seed=7)
    before = dst[0].cpu().clone()
    ms = torch.zeros((4, 8), dtype=torch.int32, device=DEV)
    cuda_ops.gather_rows(src, dst, ms, ms.clone(), torch.zeros(4, dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(dst[0].cpu(), before)


def test_many_layers_split_launches():
    L = 70  # more than one launch's pointer table (64)
    src = layers(L, 64, 32, "cpu", pinned=True, seed=8)
    dst = layers(L, 64, 32, DEV, seed=9)
    expected = [d.cpu().clone() for d in dst]
    sr = torch.tensor([3, -1, 7, 9, 63], dtype=torch.int32)
    dr = torch.tensor([0, 5, -1, 9, 1], dtype=torch.int32)
    reference.mirror_rows(src, expected, sr, dr)
    cuda_ops.mirror_rows(src, dst, sr.to(DEV), dr.to(DEV))
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst[l].cpu(), expected[l]), l


@pytest.mark.parametrize("row_bytes", [656, 1152, 48])
@pytest.mark.parametrize("direction", ["spill", "restore"])
def test_copy_blocks_matches_reference(row_bytes, direction):
    L, bs = 2, 64
    dev_blocks, host_blocks = 20, 30
    dev = layers(L, dev_blocks * bs, row_bytes, DEV, seed=10)
    host = layers(L, host_blocks * bs, row_bytes, "cpu", pinned=True, seed=11)
    src, dst = (dev, host) if direction == "spill" else (host, dev)
    n_src = dev_blocks if direction == "spill" else host_blocks
    n_dst = host_blocks if direction == "spill" else dev_blocks
    sb = torch.randperm(n_src)[:8].to(torch.int32)
    db = torch.randperm(n_dst)[:8].to(torch.int32)
    sb[2] = -1
    db[5] = -1
    expected = [d.cpu().clone() for d in dst]
    reference.copy_blocks([s.cpu() for s in src], expected, sb, db, bs)
    cuda_ops.copy_blocks(src, dst, sb.to(DEV), db.to(DEV), bs)
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst[l].cpu(), expected[l])


@pytest.mark.parametrize("row_bytes", [656, 1152, 80])
def test_mirror_rows_matches_reference(row_bytes):
    L = 4
    dev = layers(L, 1000, row_bytes, DEV, seed=12)
    host = layers(L, 3000, row_bytes, "cpu", pinned=True, seed=13)
    sr = torch.randperm(1000)[:300].to(torch.int32)
    dr = torch.randperm(3000)[:300].to(torch.int32)
    sr[::7] = -1
    dr[::11] = -1
    expected = [h.clone() for h in host]
    reference.mirror_rows([d.cpu() for d in dev], expected, sr, dr)
    cuda_ops.mirror_rows(dev, host, sr.to(DEV), dr.to(DEV))
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(host[l], expected[l])


# row-strided layer views (position-major host pool: layer l = rows of stride L * row_bytes)


def strided(L, rows, row_bytes, device, pinned=False, seed=0, pad=0):
    """(buffer [rows, L * row_bytes + pad], L row-strided views). ``pad`` bytes per position
    after the last layer make the stride larger than L * row_bytes (still a multiple of 16)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (rows, L * row_bytes + pad), dtype=torch.uint8, generator=g)
    if device == "cpu" and pinned:
        buf = buf.pin_memory()
    elif device != "cpu":
        buf = buf.to(device)
    views = [buf[:, l * row_bytes:(l + 1) * row_bytes] for l in range(L)]
    return buf, views


def cpu_twin(buf, L, row_bytes):
    t = buf.cpu().clone()
    return t, [t[:, l * row_bytes:(l + 1) * row_bytes] for l in range(L)]


@pytest.mark.parametrize("row_bytes", [656, 1152, 48, 592])
@pytest.mark.parametrize("rows_per_warp", [0, 1, 4, 16])
@pytest.mark.parametrize("pair_major", [True, False])
def test_gather_rows_row_strided_host_and_device(row_bytes, rows_per_warp, pair_major):
    L, T, K = 3, 6, 50
    src_rows, dst_rows = 1500, 500
    sbuf, src = strided(L, src_rows, row_bytes, "cpu", pinned=True, seed=41)
    dbuf, dst = strided(L, dst_rows, row_bytes, DEV, seed=42, pad=16)
    sbuf_before = sbuf.clone()
    twin, twin_layers = cpu_twin(dbuf, L, row_bytes)
    ms, md, mc = random_plan(T, K, src_rows, dst_rows, seed=row_bytes + rows_per_warp)
    reference.gather_rows(src, twin_layers, ms, md, mc)
    cuda_ops.gather_rows_tuned(src, dst, ms.to(DEV), md.to(DEV), mc.to(DEV),
                               rows_per_warp=rows_per_warp, ctas_per_sm=0,
                               pair_major=pair_major)
    torch.cuda.synchronize()
    assert torch.equal(dbuf.cpu(), twin)  # every byte: copied rows, untouched rows, padding
    assert torch.equal(sbuf, sbuf_before)


@pytest.mark.parametrize("row_bytes", [656, 1152, 48])
def test_copy_blocks_and_mirrors_row_strided_host(row_bytes):
    L, bs = 3, 64
    hbuf, host = strided(L, 30 * bs, row_bytes, "cpu", pinned=True, seed=43)
    dev = layers(L, 20 * bs, row_bytes, DEV, seed=44)
    sb = torch.randperm(20)[:8].to(torch.int32)
    hb = torch.randperm(30)[:8].to(torch.int32)
    sb[2] = -1
    hb[5] = -1
    twin, twin_layers = cpu_twin(hbuf, L, row_bytes)
    reference.copy_blocks([d.cpu() for d in dev], twin_layers, sb, hb, bs)
    cuda_ops.copy_blocks(dev, host, sb.to(DEV), hb.to(DEV), bs)  # spill
    torch.cuda.synchronize()
    assert torch.equal(hbuf, twin)
    expect = [d.cpu() for d in dev]
    reference.copy_blocks(host, expect, hb, sb, bs)
    dev2 = [d.clone() for d in dev]
    cuda_ops.copy_blocks(host, dev2, hb.to(DEV), sb.to(DEV), bs)  # restore
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dev2, expect))
    sr = torch.randperm(20 * bs)[:200].to(torch.int32)
    dr = torch.randperm(30 * bs)[:200].to(torch.int32)
    sr[::7] = -1
    dr[::11] = -1
    reference.mirror_rows([d.cpu() for d in dev], twin_layers, sr, dr)
    cuda_ops.mirror_rows(dev, host, sr.to(DEV), dr.to(DEV))
    torch.cuda.synchronize()
    assert torch.equal(hbuf, twin)


def test_layer_list_with_mixed_strides_is_split_into_runs():
    L, rb = 4, 656
    sbuf, strided_src = strided(2, 800, rb, "cpu", pinned=True, seed=45)
    dense_src = layers(2, 800, rb, "cpu", pinned=True, seed=46)
    src = [dense_src[0], strided_src[0], strided_src[1], dense_src[1]]
    dst = layers(L, 300, rb, DEV, seed=47)
    expect = [d.cpu() for d in dst]
    ms, md, mc = random_plan(3, 64, 800, 300, seed=48)
    reference.gather_rows(src, expect, ms, md, mc)
    from vllm_hisparse import ops
    ops.gather_rows(src, dst, ms.to(DEV), md.to(DEV), mc.to(DEV))
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dst, expect))


def test_bad_row_stride_rejected():
    buf = torch.zeros((10, 3 * 656 + 8), dtype=torch.uint8).pin_memory()  # stride % 16 != 0
    src = [buf[:, :656]]
    dst = layers(1, 10, 656, DEV)
    z = torch.zeros((1, 2), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda_ops.gather_rows(src, dst, z, z, torch.zeros(1, dtype=torch.int32, device=DEV))


def test_row_size_not_multiple_of_16_rejected():
    src = layers(1, 10, 24, "cpu", pinned=True)
    dst = layers(1, 10, 24, DEV)
    z = torch.zeros((1, 2), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda_ops.gather_rows(src, dst, z, z, torch.zeros(1, dtype=torch.int32, device=DEV))


def test_public_ops_dispatch_to_cuda():
    from vllm_hisparse import ops
    case = simple_case()
    ref, _ = run_both(case)
    gpu = case.clone(DEV)
    ops.resolve(*gpu.args())
    torch.cuda.synchronize()
    assert_same(ref, gpu.state())
