"""Device KV row addressing when several layers share one block (block-outermost packing).

vLLM's block-outermost layout (``BLHNC``) packs the pages of every layer of a KV cache
group into one device block: layer ``l`` of block ``b`` starts at
``offset + l * layer_stride + b * block_stride`` bytes. One layer's rows are therefore
contiguous inside a block (``row_bytes`` apart) but ``block_stride`` bytes apart between
blocks, so a dense ``[num_blocks * block_size, row_bytes]`` row view of one layer does not
exist.

What does exist is the **flat row view** the sparse-MLA kernels use themselves (vLLM's
``flat_kv_row_view``): rows of ``row_bytes`` starting at the layer's first byte, where
position ``o`` of block ``b`` is row ``b * block_stride_rows + o`` and the rows in between
belong to other layers (never indexed). Every device row in this package's worker-side tables
is a row of that flat view. The page tables and the ops keep their simple form
``row = block * block_size + offset`` because device block ids are **scaled** on the way in:
block ``b`` becomes row-block ``b * block_scale`` with ``block_scale = block_stride_rows /
block_size``. That needs ``block_stride_rows`` to be a whole number of pages, which
:class:`DeviceRowLayout` checks (and says so clearly when it is not).

No vLLM import: this runs wherever the worker package runs.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from vllm_hisparse.core.commands import StepCommand, TransferKind, TransferSpec


def flat_row_view(layer_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    """The uint8 flat row view of one layer's paged KV cache.

    Args:
        layer_cache: one layer's cache as vLLM allocates it: ``[num_blocks, block_size, C]``
            or ``[num_blocks, 1, block_size, C]`` (one KV head, MLA), any dtype, the last
            dimension contiguous and the rows of a block ``C`` elements apart.
        block_size: tokens per block.

    Returns:
        ``(rows, block_stride_rows)``: ``rows`` is uint8 ``[(num_blocks - 1) *
        block_stride_rows + block_size, row_bytes]`` aliasing the cache (writes land in it);
        position ``o`` of block ``b`` is ``rows[b * block_stride_rows + o]``.
    """
    cache = layer_cache
    if cache.dim() == 4:
        if cache.shape[1] != 1:
            raise ValueError(f"flat_row_view: expected one KV head (MLA), got shape "
                             f"{tuple(cache.shape)}")
        cache = cache[:, 0]
    if cache.dim() != 3 or cache.shape[1] != block_size:
        raise ValueError(f"flat_row_view: expected [num_blocks, {block_size}, C] (or with a "
                         f"singleton head dim), got shape {tuple(layer_cache.shape)}")
    if cache.stride(2) != 1 or cache.stride(1) != cache.shape[2]:
        raise ValueError(f"flat_row_view: rows of a block must be contiguous, got strides "
                         f"{cache.stride()} for shape {tuple(cache.shape)}")
    item = cache.element_size()
    row_bytes = cache.shape[2] * item
    block_stride_bytes = cache.stride(0) * item
    if block_stride_bytes % row_bytes:
        raise ValueError(f"flat_row_view: block stride {block_stride_bytes} B is not a whole "
                         f"number of {row_bytes} B rows; flat row indexing would misaddress")
    block_stride_rows = block_stride_bytes // row_bytes
    num_blocks = cache.shape[0]
    num_rows = (num_blocks - 1) * block_stride_rows + block_size
    # Re-view the storage as bytes: storage_offset of a uint8 view counts bytes.
    byte_offset = cache.storage_offset() * item
    storage = torch.empty(0, dtype=torch.uint8, device=cache.device)
    storage.set_(cache.untyped_storage())
    if byte_offset + num_rows * row_bytes > storage.numel():
        raise ValueError(f"flat_row_view: {num_rows} rows of {row_bytes} B from byte "
                         f"{byte_offset} overrun the {storage.numel()} B backing")
    rows = storage.as_strided((num_rows, row_bytes), (row_bytes, 1), byte_offset)
    return rows, block_stride_rows


@dataclasses.dataclass(frozen=True)
class DeviceRowLayout:
    """How device block ids map to flat rows of the sparse-MLA layers.

    Args:
        block_size: tokens per block (page).
        block_stride_rows: flat rows from one block of a layer to the next (``block_size``
            when a block holds only that layer's page).
    """

    block_size: int
    block_stride_rows: int

    def __post_init__(self):
        if self.block_size <= 0 or self.block_stride_rows < self.block_size:
            raise ValueError(f"DeviceRowLayout: need 0 < block_size <= block_stride_rows, got "
                             f"{self.block_size} and {self.block_stride_rows}")
        if self.block_stride_rows % self.block_size:
            raise ValueError(
                f"DeviceRowLayout: the sparse-MLA block stride ({self.block_stride_rows} rows) "
                f"is not a whole number of {self.block_size}-row pages, so device rows cannot "
                f"be addressed as block * block_size + offset; plan the KV cache with "
                f"bytes_per_block a multiple of every sparse-MLA layer's page size")

    @property
    def block_scale(self) -> int:
        """Row-blocks per device block: device block ``b`` is row-block ``b * block_scale``."""
        return self.block_stride_rows // self.block_size

    def scale_blocks(self, blocks: Sequence[int]) -> list[int]:
        """Device block ids → row-block ids (``-1`` stays ``-1``)."""
        k = self.block_scale
        return [b * k if b >= 0 else b for b in blocks]

    def scale_command(self, cmd: StepCommand) -> StepCommand:
        """A copy of ``cmd`` with every device block id scaled to a row-block id.

        Host block ids, rows, positions and transfer ids are unchanged. Returns ``cmd``
        itself when the scale is 1 (one layer per block: nothing to do).
        """
        if self.block_scale == 1:
            return cmd
        return dataclasses.replace(
            cmd,
            page_device_blocks=self.scale_blocks(cmd.page_device_blocks),
            hot_leases=[dataclasses.replace(l, block_ids=self.scale_blocks(l.block_ids))
                        for l in cmd.hot_leases],
            transfers=[self._scale_transfer(t) for t in cmd.transfers],
        )

    def _scale_transfer(self, spec: TransferSpec) -> TransferSpec:
        if TransferKind(spec.kind) is TransferKind.MIRROR:
            return spec  # positions only; the page tables turn them into rows
        return dataclasses.replace(spec, device_blocks=self.scale_blocks(spec.device_blocks))

    def vllm_block_ids(self, row_blocks, null_block: int):
        """Row-block ids (this layout's scaled page-table entries, ``-1`` = no device block)
        → the engine's own block ids, ``null_block`` where there is none. Accepts and
        returns numpy arrays (any shape); used to rewrite an engine's block-table rows."""
        import numpy as np

        blocks = np.asarray(row_blocks, dtype=np.int64)
        return np.where(blocks >= 0, blocks // self.block_scale, null_block).astype(np.int32)

    def to_kernel_rows(self, flat_rows: torch.Tensor, block_stride_rows: int | None) -> torch.Tensor:
        """Flat rows (this layout) → the row index space a kernel asked for.

        ``block_stride_rows=None`` means dense page rows ``block * block_size + offset``
        (a kernel that indexes a ``[num_blocks, block_size, C]`` page tensor through its
        stride); an int means flat rows with that block stride. ``-1`` stays ``-1``.
        """
        target = self.block_size if block_stride_rows is None else block_stride_rows
        if target == self.block_stride_rows:
            return flat_rows
        valid = flat_rows >= 0
        block = torch.div(flat_rows, self.block_stride_rows, rounding_mode="floor")
        converted = block * target + flat_rows - block * self.block_stride_rows
        return torch.where(valid, converted, flat_rows)
