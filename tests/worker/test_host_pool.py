"""HostPool: geometry, non-overlapping layer views, page modes, close()."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.worker.host_pool import HostPool


@pytest.mark.parametrize("huge_pages", ["never", "auto"])
def test_layer_views_have_the_geometry_and_do_not_overlap(huge_pages):
    pool = HostPool(3, 5, 4, 48, huge_pages=huge_pages, pin=False)
    try:
        assert pool.total_bytes == 3 * 5 * 4 * 48
        assert [tuple(l.shape) for l in pool.layers] == [(20, 48)] * 3
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


def test_thp_mapping_is_2mib_aligned():
    with HostPool(2, 3, 64, 656, huge_pages="auto", pin=False) as pool:
        if pool.page_mode == "thp":
            assert pool.layers[0].data_ptr() % (2 << 20) == 0


def test_blocks_for_bytes():
    assert HostPool.blocks_for_bytes(10 * 61 * 64 * 656, 61, 64, 656) == 10
    assert HostPool.blocks_for_bytes(10 * 61 * 64 * 656 - 1, 61, 64, 656) == 9


@pytest.mark.parametrize("kwargs,text", [
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(row_bytes=-1), "row_bytes must be a positive int"),
    (dict(huge_pages="sometimes"), "huge_pages must be"),
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
