"""Registered host ranges: what the copy ops accept besides ``Tensor.is_pinned()``."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.ops import host_ranges


def test_extent_of_strided_views():
    buf = torch.zeros(10, 3 * 16, dtype=torch.uint8)
    view = buf[:, 16:32]  # rows of 16 B, 48 B apart
    assert host_ranges.extent_bytes(view) == 9 * 48 + 16
    assert host_ranges.extent_bytes(buf[:0]) == 0


def test_covers_only_tensors_inside_one_recorded_range():
    buf = torch.zeros(4096, dtype=torch.uint8)
    base = buf.data_ptr()
    assert not host_ranges.covers(buf)
    host_ranges.add(base, 1024)
    try:
        assert host_ranges.covers(buf[:1024]) and host_ranges.covers(buf[100:200])
        assert not host_ranges.covers(buf[1000:1100])  # runs past the range
        assert not host_ranges.covers(buf)
    finally:
        host_ranges.remove(base)
    assert not host_ranges.covers(buf[:10])
    with pytest.raises(ValueError):
        host_ranges.add(base, 0)
