"""Whole indexer pages on the host: what a host-prefix hit needs besides sparse-MLA rows.

The DSA indexer scores every position of a request's context each step, so its KV stays
resident and residency never moves it. A page served from the host tier to a new request
(a host-prefix hit, or a preempted request coming back) must bring its indexer page too.
So each full page is saved once, device → host, in the step that completes it (before that
step's sparse-MLA mirror on the same stream, so the mirror's completion implies the save's),
and loaded host → device with the page's restore.

Pages are copied whole, whatever their internal layout (the fp8 values and scales of
vLLM's indexer cache): one "row" of a page view is one block's bytes. Host block ``h`` of
indexer layer ``l`` is row ``h`` of the store's layer ``l`` (a :class:`HostPool` with
``block_size = 1``), so host blocks line up with the sparse-MLA host pool's.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from vllm_hisparse import ops
from vllm_hisparse.worker.host_pool import HostPool, SharedSegment

logger = logging.getLogger("vllm_hisparse.worker")


def page_view(layer_cache: torch.Tensor) -> torch.Tensor:
    """uint8 ``[num_blocks, page_bytes]`` view of one layer's paged cache (row ``b`` = the
    bytes of block ``b``), aliasing it.

    ``layer_cache``: block-outermost, any dtype and inner shape, the bytes of one block
    contiguous (``layer_cache[0]`` contiguous); blocks may be further apart than a page
    (packed KV cache tensors), which gives a row-strided view."""
    if layer_cache.dim() < 2:
        raise ValueError(f"page_view: expected [num_blocks, ...], got shape {tuple(layer_cache.shape)}")
    if not layer_cache[0].is_contiguous():
        raise ValueError(f"page_view: the bytes of one block must be contiguous, got strides "
                         f"{layer_cache.stride()} for shape {tuple(layer_cache.shape)}")
    item = layer_cache.element_size()
    num_blocks = layer_cache.shape[0]
    page_bytes = layer_cache[0].numel() * item
    stride_bytes = layer_cache.stride(0) * item
    if num_blocks > 1 and stride_bytes < page_bytes:
        raise ValueError(f"page_view: blocks {stride_bytes} B apart overlap {page_bytes} B pages")
    storage = torch.empty(0, dtype=torch.uint8, device=layer_cache.device)
    storage.set_(layer_cache.untyped_storage())
    return storage.as_strided((num_blocks, page_bytes), (stride_bytes, 1),
                              layer_cache.storage_offset() * item)


class IndexerPageStore:
    """Host copies of indexer pages, ``num_blocks`` host blocks per indexer layer.

    Args:
        groups: per indexer KV cache group, the page views (:func:`page_view`) of its
            layers; a page's block id differs between groups, never within one.
        num_blocks: host blocks (the sparse-MLA host pool's count: same block ids).
        ops_backend: ``auto`` | ``cuda`` | ``reference`` (see :func:`vllm_hisparse.ops.select`).
        huge_pages: passed to :class:`HostPool`.
        shared: a :class:`~vllm_hisparse.worker.host_pool.SharedSegment` when the
            tensor-parallel ranks of a node map one store (see ``docs/worker.md``).
        writes_host: False on ranks that only read a shared store: :meth:`save` then copies
            nothing (the writer rank saves the same bytes; the scheduler's acks, which need
            every rank, order the readers after it).

    Copies run on the caller's current stream and never synchronise.
    """

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]], num_blocks: int, *,
                 ops_backend: str = "auto", huge_pages: str = "auto",
                 shared: SharedSegment | None = None, writes_host: bool = True):
        views = [v for g in groups for v in g]
        if not views:
            raise ValueError("IndexerPageStore: no indexer layer")
        page_bytes = {v.shape[1] for v in views}
        devices = {v.device for v in views}
        if len(page_bytes) != 1 or len(devices) != 1:
            raise ValueError(f"IndexerPageStore: indexer pages must share one size and device, "
                             f"got {sorted(page_bytes)} B on {sorted(map(str, devices))}")
        self.page_bytes = page_bytes.pop()
        self.device = devices.pop()
        self.groups = [list(g) for g in groups]
        self.host_pool = HostPool(len(views), num_blocks, 1, self.page_bytes,
                                  huge_pages=huge_pages, pin=self.device.type == "cuda",
                                  shared=shared)
        self.writes_host = writes_host
        host_layers = self.host_pool.layers
        self.host_groups: list[list[torch.Tensor]] = []
        first = 0
        for g in self.groups:
            self.host_groups.append(host_layers[first:first + len(g)])
            first += len(g)
        self._ops = ops.select(ops_backend)
        self.bytes_to_host = 0
        self.bytes_to_device = 0

    @property
    def num_layers(self) -> int:
        return sum(len(g) for g in self.groups)

    def save(self, device_blocks: Sequence[Sequence[int]], host_blocks: Sequence[int]) -> None:
        """Device → host: page ``i`` of group ``g`` from block ``device_blocks[g][i]`` into
        host block ``host_blocks[i]`` (nothing on a rank that does not write the store)."""
        if self.writes_host:
            self._copy(device_blocks, host_blocks, to_host=True)

    def load(self, device_blocks: Sequence[Sequence[int]], host_blocks: Sequence[int]) -> None:
        """Host → device: the inverse of :meth:`save`."""
        self._copy(device_blocks, host_blocks, to_host=False)

    def _copy(self, device_blocks, host_blocks, *, to_host: bool) -> None:
        if len(device_blocks) != len(self.groups):
            raise ValueError(f"IndexerPageStore: {len(device_blocks)} block lists for "
                             f"{len(self.groups)} indexer groups")
        n = len(host_blocks)
        if n == 0:
            return
        host = self._ids(host_blocks)
        for views, host_views, blocks in zip(self.groups, self.host_groups, device_blocks):
            if len(blocks) != n:
                raise ValueError(f"IndexerPageStore: {len(blocks)} device blocks for {n} host blocks")
            dev = self._ids(blocks)
            if to_host:
                self._ops.copy_blocks(views, host_views, dev, host, 1)
            else:
                self._ops.copy_blocks(host_views, views, host, dev, 1)
        moved = n * self.num_layers * self.page_bytes
        if to_host:
            self.bytes_to_host += moved
        else:
            self.bytes_to_device += moved

    def _ids(self, values: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor([int(v) for v in values], dtype=torch.int32)
        if self.device.type == "cuda":
            # Allocated on the current stream, which the copy also runs on: freeing it
            # after the launch is safe in stream order.
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        return ids

    def close(self) -> None:
        self.host_pool.close()
