"""AsyncCounterReader: device counters read one poll late, never synchronously."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.worker.counter_reader import AsyncCounterReader


def test_poll_reports_the_previous_snapshot():
    a = torch.zeros(3, dtype=torch.int64)
    b = torch.zeros(3, dtype=torch.int64)
    reader = AsyncCounterReader([a, b])
    assert reader.poll().tolist() == [0] * 6  # nothing landed yet; a snapshot is queued
    a += 1
    b[2] = 7
    # The snapshot queued by the first poll holds the old values; this poll reports it
    # and queues a new one.
    assert reader.poll().tolist() == [0] * 6
    assert reader.poll().tolist() == [1, 1, 1, 0, 0, 7]
    a += 1
    assert reader.read_now().tolist() == [2, 2, 2, 0, 0, 7]  # synchronous read (shutdown)
    assert reader.poll().tolist() == [2, 2, 2, 0, 0, 7]
    assert reader.num_snapshots == 4


def test_rejects_bad_sources():
    with pytest.raises(ValueError, match="at least one"):
        AsyncCounterReader([])
    with pytest.raises(ValueError, match="int64"):
        AsyncCounterReader([torch.zeros(3, dtype=torch.int32)])


@pytest.mark.gpu
def test_cuda_poll_never_blocks():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    stats = torch.zeros(3, dtype=torch.int64, device="cuda")
    reader = AsyncCounterReader([stats])
    reader.poll()
    stats += 5
    torch.cuda.synchronize()
    reader.poll()
    torch.cuda.synchronize()
    assert reader.poll().tolist() == [5, 5, 5]
