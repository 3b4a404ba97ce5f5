"""Eviction classes from the indexer's decode scores (``worker.score_classes``): the torch op
against its numpy twin (``core.trace.score_classes``), the request/row layout, the scratch
row, and CPU == CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hisparse.core.trace import NUM_SCORE_CLASSES, score_classes
from vllm_hisparse.worker.score_classes import slot_classes_into, threshold_and_width

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


def _topk(logits: torch.Tensor, k: int, lengths: list[int]) -> torch.Tensor:
    """The top-k columns of each row within its length, -1 padded (as vLLM's top-k)."""
    cols = torch.arange(logits.shape[1])
    masked = logits.masked_fill(cols[None, :] >= torch.tensor(lengths)[:, None], float("-inf"))
    idx = masked.topk(k, dim=1).indices.to(torch.int32)
    return torch.where(torch.arange(k)[None, :] < torch.tensor(lengths)[:, None], idx, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_classes_match_the_numpy_twin(device, seed):
    g = torch.Generator().manual_seed(seed)
    requests, width_cols, k, slots = 5, 700, 64, 96
    lengths = [700, 650, 300, 129, 64]
    logits = torch.randn((requests, width_cols), generator=g)
    topk = _topk(logits, k, lengths)
    # hot slots: positions below each row's length, some empty, distinct per row
    slot_pos = torch.full((requests + 2, slots), -1, dtype=torch.int32)
    state_rows = torch.tensor([3, 0, 6, 1, 4], dtype=torch.int32)
    for b in range(requests):
        perm = torch.randperm(lengths[b], generator=g)[:slots - 7]
        slot_pos[state_rows[b], :perm.numel()] = perm.to(torch.int32)
    out = torch.full((requests + 3, slots), 9, dtype=torch.uint8)
    dev = torch.device(device)
    thr, w = threshold_and_width(logits.to(dev), topk.to(dev))
    out_dev = out.to(dev)
    slot_classes_into(out_dev, logits.to(dev), thr, w, 1, state_rows.to(dev), slot_pos.to(dev))
    out_dev = out_dev.cpu()
    for b in range(requests):
        row = int(state_rows[b])
        chosen = topk[b][topk[b] >= 0].numpy()
        positions, classes = score_classes(logits[b, :lengths[b]].numpy(), chosen)
        want = np.zeros(lengths[b], dtype=np.uint8)
        want[positions] = classes
        want[chosen] = NUM_SCORE_CLASSES - 1  # a selected position is as close as it gets
        pos = slot_pos[row].numpy()
        expected = np.where(pos >= 0, want[np.maximum(pos, 0)], 0)
        assert np.array_equal(out_dev[row].numpy(), expected), (b, row)
    # rows of no decode request are left alone
    for row in (2, 5):
        assert torch.all(out_dev[row] == 9)
    assert (out_dev[[0, 1, 3, 4, 6]] <= NUM_SCORE_CLASSES - 1).all()
    # every class occurs (the test would not notice a constant answer otherwise)
    assert set(out_dev[[0, 1, 3, 4, 6]].unique().tolist()) == set(range(NUM_SCORE_CLASSES))


@pytest.mark.parametrize("device", DEVICES)
def test_next_n_rows_and_untracked_requests(device):
    """Rows i * next_n .. belong to request i; a request's class is the highest over its
    rows; a batch row without a state row writes only the scratch row."""
    dev = torch.device(device)
    next_n, width_cols = 3, 40
    logits = torch.zeros((2 * next_n, width_cols))
    logits[:, :8] = 10.0  # selected (k = 8) in every row
    logits[0, 20] = 9.5   # request 0, row 0: just below its threshold (class 3)
    logits[2, 21] = 9.5   # request 0, row 2: likewise for 21
    logits[3, 20] = 9.5   # request 1 (untracked)
    topk = logits.topk(8, dim=1).indices.to(torch.int32)
    slot_pos = torch.full((2, 4), -1, dtype=torch.int32)
    slot_pos[1, :3] = torch.tensor([20, 21, 30], dtype=torch.int32)
    slot_pos[0, :1] = 20
    out = torch.full((3, 4), 7, dtype=torch.uint8, device=dev)
    thr, w = threshold_and_width(logits.to(dev), topk.to(dev))
    slot_classes_into(out, logits.to(dev), thr, w, next_n,
                      torch.tensor([1, -1], dtype=torch.int32, device=dev), slot_pos.to(dev))
    out = out.cpu()
    # threshold 10, mean 10: width is the floor, so only scores at the threshold class high
    assert out[1].tolist() == [0, 0, 0, 0]
    assert out[0].tolist() == [7, 7, 7, 7]  # state row 0 is not in the batch
    logits[:, 8] = 11.0  # spread the selected scores: mean - threshold = 1/8
    topk = logits.topk(9, dim=1).indices.to(torch.int32)
    thr, w = threshold_and_width(logits.to(dev), topk.to(dev))
    out = torch.zeros((3, 4), dtype=torch.uint8, device=dev)
    slot_classes_into(out, logits.to(dev), thr, w, next_n,
                      torch.tensor([1, -1], dtype=torch.int32, device=dev), slot_pos.to(dev))
    # w = 1/9 ((10 * 8 + 11) / 9 - 10): 9.5 lies more than 3 w below 10, so class 0
    assert out.cpu()[1].tolist() == [0, 0, 0, 0]
    logits[0, 20] = 9.95
    logits[2, 21] = 9.8
    thr, w = threshold_and_width(logits.to(dev), topk.to(dev))
    slot_classes_into(out, logits.to(dev), thr, w, next_n,
                      torch.tensor([1, -1], dtype=torch.int32, device=dev), slot_pos.to(dev))
    # 9.95: within one width (class 3), 9.8: within two (class 2), 30: far below, empty: 0
    assert out.cpu()[1].tolist() == [3, 2, 0, 0]


def test_rows_without_selections_and_bad_shapes():
    logits = torch.randn((2, 16))
    topk = torch.full((2, 4), -1, dtype=torch.int32)
    topk[1] = torch.tensor([0, 1, 2, 3])
    thr, w = threshold_and_width(logits, topk)
    assert thr[0] == float("inf") and torch.isfinite(thr[1]) and (w > 0).all()
    slot_pos = torch.arange(8, dtype=torch.int32).view(2, 4)
    out = torch.full((3, 4), 5, dtype=torch.uint8)
    slot_classes_into(out, logits, thr, w, 1, torch.tensor([0, -1], dtype=torch.int32), slot_pos)
    assert out[0].tolist() == [0, 0, 0, 0]  # no selection: plain LRU for that request
    with pytest.raises(ValueError, match=r"out must be uint8 \[3, 4\]"):
        slot_classes_into(torch.zeros((2, 4), dtype=torch.uint8), logits, thr, w, 1,
                          torch.tensor([0, -1], dtype=torch.int32), slot_pos)
    with pytest.raises(ValueError, match="not a whole number of requests of next_n = 3"):
        slot_classes_into(out, logits, thr, w, 3, torch.tensor([0], dtype=torch.int32), slot_pos)
