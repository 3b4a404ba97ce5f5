"""HostPool: geometry, non-overlapping layer views, page modes, close()."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.worker.host_pool import HostPool


@pytest.mark.parametrize("layout", ["position", "layer"])
@pytest.mark.parametrize("huge_pages", ["never", "auto"])
def test_layer_views_have_the_geometry_and_do_not_overlap(huge_pages, layout):
    pool = HostPool(3, 5, 4, 48, huge_pages=huge_pages, pin=False, layout=layout)
    try:
        assert pool.layout == layout
        assert pool.total_bytes == 3 * 5 * 4 * 48
        assert [tuple(l.shape) for l in pool.layers] == [(20, 48)] * 3
        stride = 3 * 48 if layout == "position" else 48
        assert pool.row_stride == stride
        assert all(l.stride() == (stride, 1) for l in pool.layers)
        for i, layer in enumerate(pool.layers):
            layer.fill_(i + 1)
        for i, layer in enumerate(pool.layers):
            assert bool((layer == i + 1).all())
        assert pool.page_mode in ("hugetlb", "thp", "pageable")
        if huge_pages == "never":
            assert pool.page_mode == "pageable"
        assert pool.logical_gib == pool.physical_gib == pool.total_bytes / 2**30
    finally:
        pool.close()
    assert pool.closed and pool.layers == []
    pool.close()  # idempotent


def test_default_layout_is_position_major():
    with HostPool(2, 3, 4, 656, huge_pages="never", pin=False) as pool:
        assert pool.layout == "position"


@pytest.mark.parametrize("layout", ["position", "layer"])
def test_layout_places_rows_where_documented(layout):
    L, blocks, bs, rb = 3, 4, 4, 32
    with HostPool(L, blocks, bs, rb, huge_pages="never", pin=False, layout=layout) as pool:
        rows = blocks * bs
        for l, view in enumerate(pool.layers):
            view.copy_((torch.arange(rows * rb) % 251).view(rows, rb).to(torch.uint8) + l)
        flat = pool.buffer
        for l in range(L):
            for r in (0, 5, rows - 1):
                if layout == "position":
                    start = (r * L + l) * rb  # all layers of a position are adjacent
                else:
                    start = (l * rows + r) * rb
                assert torch.equal(flat[start:start + rb], pool.layers[l][r])


def test_ops_on_position_major_pool_match_layer_major():
    """The ops (reference twins on CPU) give the same bytes from either layout."""
    from vllm_hisparse import ops
    L, blocks, bs, rb = 3, 6, 4, 48
    pools = {lay: HostPool(L, blocks, bs, rb, huge_pages="never", pin=False, layout=lay)
             for lay in ("position", "layer")}
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (L, blocks * bs, rb), dtype=torch.uint8, generator=g)
    dev = {lay: [torch.zeros(40, rb, dtype=torch.uint8) for _ in range(L)] for lay in pools}
    for lay, pool in pools.items():
        for l in range(L):
            pool.layers[l].copy_(data[l])
        ms = torch.tensor([[0, 7, 23, 5]], dtype=torch.int32)
        md = torch.tensor([[3, 1, 39, 0]], dtype=torch.int32)
        ops.gather_rows(pool.layers, dev[lay], ms, md, torch.tensor([4], dtype=torch.int32))
        ops.copy_blocks(dev[lay], pool.layers, torch.tensor([0, -1], dtype=torch.int32),
                        torch.tensor([5, 2], dtype=torch.int32), bs)
    for l in range(L):
        assert torch.equal(dev["position"][l], dev["layer"][l])
        assert torch.equal(pools["position"].layers[l], pools["layer"].layers[l])
    for pool in pools.values():
        pool.close()


def test_thp_mapping_is_2mib_aligned():
    with HostPool(2, 3, 64, 656, huge_pages="auto", pin=False) as pool:
        if pool.page_mode == "thp":
            assert pool.layers[0].data_ptr() % (2 << 20) == 0


def test_hugetlb_pages_reads_meminfo(tmp_path):
    from vllm_hisparse.worker.host_pool import hugetlb_pages
    info = tmp_path / "meminfo"
    info.write_text("MemTotal: 100 kB\nHugePages_Total:      16\nHugePages_Free:        9\n"
                    "HugePages_Rsvd:        0\nHugepagesize:       2048 kB\n")
    assert hugetlb_pages(str(info)) == (16, 9, 2048)
    assert hugetlb_pages(str(tmp_path / "missing")) == (None, None, None)


def test_hugetlb_shortage_is_logged_with_the_pages_needed(monkeypatch, caplog):
    import vllm_hisparse.worker.host_pool as hp
    monkeypatch.setattr(hp, "hugetlb_pages", lambda: (4, 1, 2048))
    monkeypatch.setattr(hp.HostPool, "_try_mapping", lambda self, mode: None)
    with caplog.at_level("INFO", logger="vllm_hisparse.worker"):
        with HostPool(2, 64, 64, 656, huge_pages="auto", pin=False) as pool:
            assert pool.page_mode == "pageable"
    need = -(-2 * 64 * 64 * 656 // (2 << 20))
    assert f"1 of 4 reserved 2 MiB hugetlb pages are free, the pool needs {need}" in caplog.text


@pytest.mark.parametrize("fraction,mode", [(0.95, "thp"), (0.5, "pinned"), (None, "thp")])
def test_thp_page_mode_is_what_the_kernel_gave(monkeypatch, caplog, fraction, mode):
    """A pinned THP pool counts as thp only when smaps shows >= 90 % in 2 MiB pages."""
    import vllm_hisparse.worker.host_pool as hp
    monkeypatch.setattr(hp.process_memory, "huge_page_fraction", lambda address: fraction)
    with HostPool(1, 1, 16, 16, huge_pages="never", pin=False) as pool:
        pool._mapping_start = 0
        with caplog.at_level("INFO", logger="vllm_hisparse.worker"):
            assert pool._measured_thp(pool.buffer) == mode
        assert pool.huge_page_fraction == fraction
    assert ("backed only 50 % of the pool" in caplog.text) == (mode == "pinned")


def test_blocks_for_bytes():
    assert HostPool.blocks_for_bytes(10 * 61 * 64 * 656, 61, 64, 656) == 10
    assert HostPool.blocks_for_bytes(10 * 61 * 64 * 656 - 1, 61, 64, 656) == 9


@pytest.mark.parametrize("kwargs,text", [
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(row_bytes=-1), "row_bytes must be a positive int"),
    (dict(huge_pages="sometimes"), "huge_pages must be"),
    (dict(layout="page"), "layout must be 'position' or 'layer'"),
    (dict(num_layers=3, row_bytes=24), "needs num_layers \\* row_bytes to be a multiple of 16"),
])
def test_bad_arguments(kwargs, text):
    args = dict(num_layers=1, num_blocks=1, block_size=1, row_bytes=16)
    args.update(kwargs)
    with pytest.raises(ValueError, match=text):
        HostPool(**args)


@pytest.mark.gpu
def test_pool_is_pinned_on_gpu_machines():
    with HostPool(2, 8, 64, 656) as pool:
        assert pool.page_mode in ("hugetlb", "thp", "pinned")
        assert pool.layers[0].is_pinned()
        if pool.page_mode == "thp":  # measured after pinning, not assumed
            assert pool.huge_page_fraction is None or pool.huge_page_fraction >= 0.9


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["position", "layer"])
def test_cuda_copies_on_a_pinned_pool_match_the_reference(layout):
    """Kernels on the pool's (row-strided) views: byte-exact against the reference twins,
    the whole pool buffer compared (so untouched rows of every layer too)."""
    from vllm_hisparse.ops import cuda as cuda_ops, reference
    if not cuda_ops.available():
        pytest.skip("no kernels")
    L, blocks, bs, rb = 4, 12, 64, 656
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    with HostPool(L, blocks, bs, rb, layout=layout) as pool:
        pool.buffer.copy_(torch.randint(0, 256, (pool.total_bytes,), dtype=torch.uint8,
                                        generator=g))
        before = pool.buffer.clone()
        d_layers = [torch.randint(0, 256, (20 * bs, rb), dtype=torch.uint8, generator=g).to(dev)
                    for _ in range(L)]
        expect_dev = [d.cpu() for d in d_layers]
        ms = torch.randint(0, blocks * bs, (3, 100), dtype=torch.int32, generator=g)
        md = torch.randperm(20 * bs, generator=g)[:300].view(3, 100).to(torch.int32)
        mc = torch.tensor([100, 0, 57], dtype=torch.int32)
        reference.gather_rows([l.clone() for l in pool.layers], expect_dev, ms, md, mc)
        cuda_ops.gather_rows(pool.layers, d_layers, ms.to(dev), md.to(dev), mc.to(dev))
        torch.cuda.synchronize()
        assert all(torch.equal(a.cpu(), b) for a, b in zip(d_layers, expect_dev))
        assert torch.equal(pool.buffer, before)
        # spill two device pages into the pool, then compare every byte of the pool
        sb = torch.tensor([3, -1, 7], dtype=torch.int32)
        hb = torch.tensor([11, 2, 0], dtype=torch.int32)
        twin = HostPool(L, blocks, bs, rb, layout=layout, pin=False, huge_pages="never")
        twin.buffer.copy_(before)
        reference.copy_blocks(expect_dev, twin.layers, sb, hb, bs)
        cuda_ops.copy_blocks(d_layers, pool.layers, sb.to(dev), hb.to(dev), bs)
        torch.cuda.synchronize()
        assert torch.equal(pool.buffer, twin.buffer)
        twin.close()
