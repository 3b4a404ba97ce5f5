"""The simulator's ground truth: a row's KV is a function of the request's tokens up to its
position, whichever request computed it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_hisparse.vllm.simulation.ground_truth import GroundTruth, prefix_owners  # noqa: E402
from vllm_hisparse.worker.synthetic import kv_rows  # noqa: E402


def test_prefix_owners_follow_the_longest_common_prefix():
    sequences = {1: [5, 6, 7, 8], 2: [5, 6, 9], 3: [4, 6, 7], 4: [5, 6, 7, 8, 1]}
    assert prefix_owners(sequences) == {
        1: [(0, 1)],                   # the smallest serial owns what it shares
        2: [(0, 1), (2, 2)],           # its own from the first differing token on
        3: [(0, 3)],                   # equal tokens at a later position do not count
        4: [(0, 1), (4, 4)],           # a longer copy: its own past the shorter one's end
    }


def test_rows_are_the_owners_rows_and_the_store_holds_them():
    sequences = {1: [5, 6, 7, 8], 2: [5, 6, 9, 9]}
    truth = GroundTruth(sequences, num_layers=2, max_model_len=8, block_size=4, row_bytes=16,
                        device=torch.device("cpu"))
    pos = torch.arange(4)
    want = torch.cat([kv_rows(1, pos[:2], 1, 16), kv_rows(2, pos[2:], 1, 16)])
    assert torch.equal(truth.rows(2, pos, 1, 16), want)
    assert torch.equal(truth.rows(2, pos.flip(0), 1, 16), want.flip(0))
    assert [truth.owner(2, p) for p in range(4)] == [1, 1, 2, 2]
    slot = truth.slot(2)
    assert torch.equal(truth.store[slot, 1, :4], want)
    assert torch.equal(truth.indexer_rows(1, pos, 0, 16), kv_rows(1, pos, 1000, 16))
    truth.release(2)
    assert truth.slot(1) == slot  # the freed slot is reused
