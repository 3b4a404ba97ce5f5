"""Indexer page store: whole-page saves and loads between packed device caches and the host."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.worker.indexer_pages import IndexerPageStore, page_view

BS = 64
ROW_BYTES = 132  # fp8 indexer K (128 B) + fp32 scale


def _packed_layer(num_blocks: int, device: str, stride_bytes: int) -> torch.Tensor:
    """A ``[num_blocks, BS, ROW_BYTES]`` uint8 layer whose blocks sit ``stride_bytes`` apart
    inside a larger buffer, as vLLM packs KV cache groups into shared tensors."""
    backing = torch.zeros(num_blocks * stride_bytes, dtype=torch.uint8, device=device)
    return backing.as_strided((num_blocks, BS, ROW_BYTES), (stride_bytes, ROW_BYTES, 1))


def test_page_view_aliases_each_block():
    layer = _packed_layer(5, "cpu", stride_bytes=83_968)
    pages = page_view(layer)
    assert pages.shape == (5, BS * ROW_BYTES) and pages.stride() == (83_968, 1)
    pages[3, :ROW_BYTES] = 7
    assert bool((layer[3, 0] == 7).all()) and int(layer.sum()) == 7 * ROW_BYTES


def test_page_view_rejects_non_contiguous_blocks():
    layer = torch.zeros(4, BS, ROW_BYTES * 2, dtype=torch.uint8)[:, :, :ROW_BYTES]
    with pytest.raises(ValueError, match="contiguous"):
        page_view(layer)


def _round_trip(device: str, backend: str) -> None:
    groups = [[page_view(_packed_layer(12, device, 83_968)) for _ in range(3)],
              [page_view(_packed_layer(12, device, 83_968)) for _ in range(2)]]
    store = IndexerPageStore(groups, num_blocks=6, ops_backend=backend, huge_pages="never")
    gen = torch.Generator().manual_seed(1)
    truth = {}
    for g, views in enumerate(groups):
        for l, view in enumerate(views):
            for block in (2, 5, 7):
                data = torch.randint(0, 256, (view.shape[1],), dtype=torch.uint8, generator=gen)
                view[block] = data.to(device)
                truth[g, l, block] = data
    # Group 0 has the pages in blocks (2, 5), group 1 in (7, 2); host blocks (4, 1).
    store.save([[2, 5], [7, 2]], [4, 1])
    for views in groups:
        for view in views:
            view.zero_()
    store.load([[9, 3], [0, 11]], [4, 1])
    if device == "cuda":
        torch.cuda.synchronize()
    for g, (views, dst) in enumerate(zip(groups, ([9, 3], [0, 11]))):
        src = ([2, 5], [7, 2])[g]
        for l, view in enumerate(views):
            for s_block, d_block in zip(src, dst):
                assert torch.equal(view[d_block].cpu(), truth[g, l, s_block])
            untouched = [b for b in range(12) if b not in dst]
            assert int(view[untouched].sum()) == 0
    assert store.bytes_to_host == store.bytes_to_device == 2 * 5 * BS * ROW_BYTES
    with pytest.raises(ValueError, match="indexer groups"):
        store.save([[1]], [1])
    with pytest.raises(ValueError, match="device blocks for"):
        store.save([[1, 2], [1]], [1, 2])
    store.close()


def test_round_trip_reference_on_cpu():
    _round_trip("cpu", "reference")


@pytest.mark.gpu
def test_round_trip_cuda_kernels_pinned_host():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _round_trip("cuda", "auto")


def test_a_rank_that_does_not_write_the_shared_store_saves_nothing():
    groups = [[page_view(_packed_layer(4, "cpu", 83_968))]]
    groups[0][0][1] = 9
    store = IndexerPageStore(groups, num_blocks=3, ops_backend="reference", huge_pages="never",
                             writes_host=False)
    before = store.host_groups[0][0].clone()
    store.save([[1]], [2])
    assert torch.equal(store.host_groups[0][0], before) and store.bytes_to_host == 0
    store.close()
