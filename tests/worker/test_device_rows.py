"""Flat row views of block-outermost packed KV and device block scaling (no vLLM)."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.core.commands import HotLease, StepCommand, TransferKind, TransferSpec
from vllm_hisparse.worker.device_rows import DeviceRowLayout, flat_row_view


def packed(num_blocks=5, layers=3, bs=4, row_bytes=8, offset=16):
    """[B, 1, bs, C] views like vLLM's BLHNC allocation: layer l of block b at
    offset + l * page + b * layers * page."""
    page = bs * row_bytes
    raw = torch.zeros(offset + num_blocks * layers * page, dtype=torch.int8)
    return raw, [torch.as_strided(raw, (num_blocks, 1, bs, row_bytes),
                                  (layers * page, page, row_bytes, 1), offset + l * page)
                 for l in range(layers)]


def test_flat_row_view_aliases_the_packed_layer():
    raw, views = packed()
    rows, stride = flat_row_view(views[1], 4)
    assert stride == 12 and rows.dtype == torch.uint8 and rows.shape == (4 * 12 + 4, 8)
    rows[2 * stride + 3] = 9
    assert (views[1][2, 0, 3].view(torch.uint8) == 9).all()
    assert int((raw != 0).sum()) == 8


def test_flat_row_view_of_bf16_views_counts_bytes():
    raw, views = packed(row_bytes=8)
    rows, stride = flat_row_view(views[2].view(torch.bfloat16), 4)
    assert rows.shape[1] == 8 and stride == 12


def test_flat_row_view_rejects_bad_shapes():
    with pytest.raises(ValueError, match="expected"):
        flat_row_view(torch.zeros(2, 3, 8, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="contiguous"):
        flat_row_view(torch.zeros(2, 8, 4, dtype=torch.uint8).transpose(1, 2), 4)


def test_layout_requires_whole_page_strides():
    with pytest.raises(ValueError, match="whole number"):
        DeviceRowLayout(4, 10)


def test_scale_command_scales_device_blocks_only():
    layout = DeviceRowLayout(4, 12)
    cmd = StepCommand(step_id=1, page_rows=[0, 0], page_indices=[0, 1], page_device_blocks=[2, -1],
                      page_host_blocks=[5, 6], hot_leases=[HotLease(0, [1, 3])],
                      transfers=[TransferSpec(1, int(TransferKind.SPILL), True, device_blocks=[2],
                                              host_blocks=[5]),
                                 TransferSpec(2, int(TransferKind.MIRROR), True, mirror_rows=[0],
                                              mirror_starts=[0], mirror_ends=[3])])
    out = layout.scale_command(cmd)
    assert out.page_device_blocks == [6, -1] and out.page_host_blocks == [5, 6]
    assert out.hot_leases[0].block_ids == [3, 9]
    assert out.transfers[0].device_blocks == [6] and out.transfers[0].host_blocks == [5]
    assert out.transfers[1] is cmd.transfers[1]
    assert cmd.page_device_blocks == [2, -1]  # the original is untouched
    assert DeviceRowLayout(4, 4).scale_command(cmd) is cmd


def test_to_kernel_rows():
    layout = DeviceRowLayout(4, 12)
    flat = torch.tensor([[0, 13, 27, -1]], dtype=torch.int32)  # blocks 0,1,2
    assert layout.to_kernel_rows(flat, 12) is flat
    assert layout.to_kernel_rows(flat, None).tolist() == [[0, 5, 11, -1]]


def test_vllm_block_ids_unscale_and_fill_null():
    import numpy as np

    layout = DeviceRowLayout(4, 12)  # three row-blocks per device block
    got = layout.vllm_block_ids(np.array([[0, 3, -1], [27, -1, 6]]), 0)
    assert got.dtype == np.int32 and got.tolist() == [[0, 1, 0], [9, 0, 2]]
