"""Score-aware eviction through vLLM's real decode top-k (``SparseIndexerTopk``, its "torch"
backend) on CPU: the ``indexer_scores`` patch records the logits, the leader's conversion turns
them into slot classes, and resolve keeps the slots whose positions scored near the cut."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.test_worker_side import (  # noqa: F401 - model_dir is a fixture
    Rig,
    assert_nothing_leaked,
    model_dir,
    run_decode_loop,
)
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.worker_side.read_path import IndexGroupResidency, convert_with_residency
from vllm_hisparse.vllm.worker_side.score_tap import ScoreTap
from vllm_hisparse.vllm.worker_side.step_view import StepView
from vllm_hisparse.worker.device_rows import DeviceRowLayout
from vllm_hisparse.worker.hot_state import HotState
from vllm_hisparse.worker.synthetic import kv_rows

BS, PAGES, K, ROW = 4, 8, 4, 16
WIDTH = BS * PAGES


@pytest.fixture
def tap():
    tap = ScoreTap()
    tap.enable()
    patches.INDEXER_SCORES.remove()
    assert patches.INDEXER_SCORES.install(tap.record_decode_topk)
    yield tap
    patches.INDEXER_SCORES.remove()


def _binding(scores):
    """One request (state row 0), every page host-only, a hot region of 2 blocks (8 slots)."""
    state = HotState(1, PAGES, 2 * BS, BS, ops_backend="reference")
    state.set_pages([0] * PAGES, list(range(PAGES)), [-1] * PAGES)
    state.set_host_blocks([0] * PAGES, list(range(PAGES)), list(range(PAGES)))
    state.lease_hot_region(0, [8, 9])
    host = [kv_rows(0, torch.arange(WIDTH), 0, ROW)]
    dev = [torch.zeros((10 * BS, ROW), dtype=torch.uint8)]
    step = StepView(2, "cpu")
    binding = IndexGroupResidency(state, host, dev, DeviceRowLayout(BS, BS), step,
                                  gather_mode="single", scores=scores)
    return state, binding, step, dev


def _decode_step(binding, step, dev, step_id, logits, topk_buffer):
    """vLLM's top-k over ``logits`` [1, WIDTH] into ``topk_buffer``, then the leader's
    conversion of that buffer; checks every row read against the ground truth."""
    topk_module = compat.indexer_topk_class()("torch")
    seq_lens = torch.tensor([[WIDTH]], dtype=torch.int32)
    topk = topk_buffer[:1, :K]
    topk_module(logits, seq_lens, 1, topk, K, WIDTH)
    step.begin(step_id, [0])
    rows = convert_with_residency(binding, 0, topk, torch.zeros(1, dtype=torch.int32), 1,
                                  torch.full_like(topk, -1), block_stride_rows=BS,
                                  return_valid_counts=False)
    assert torch.equal(dev[0][rows[0].long()], kv_rows(0, topk[0].long(), 0, ROW))
    return topk[0].tolist()


def _logits(high: dict[int, float]) -> torch.Tensor:
    logits = torch.zeros((1, WIDTH))
    for p, v in high.items():
        logits[0, p] = v
    return logits


def _run(binding, step, dev, buffer):
    """Steps 1-2 fill the 8 slots with positions 0-3, then 4-7 (so 0-3 are least recent).
    Step 3 selects 8-11 and scores 0 and 1 just below the cut: returns the positions held."""
    # (distinct scores: vLLM's top-k lists them best first, the order misses take slots in)
    assert _decode_step(binding, step, dev, 1, _logits({0: 8, 1: 7, 2: 6, 3: 5}),
                        buffer) == [0, 1, 2, 3]
    assert _decode_step(binding, step, dev, 2, _logits({4: 8, 5: 7, 6: 6, 7: 5}),
                        buffer) == [4, 5, 6, 7]
    # threshold 10, mean 10.75: width 0.75, so 9.9 is class 3 and 0.0 class 0
    scores = {8: 10.0, 9: 10.5, 10: 11.0, 11: 11.5, 0: 9.9, 1: 9.9}
    assert sorted(_decode_step(binding, step, dev, 3, _logits(scores), buffer)) == [8, 9, 10, 11]
    return set(binding.hot_state.slot_pos[0].tolist())


def test_score_eviction_keeps_the_positions_near_the_cut(tap):
    state, binding, step, dev = _binding(tap)
    held = _run(binding, step, dev, torch.full((4, 8), -1, dtype=torch.int32))
    # LRU would evict 0-3 (the least recent); the classes evict 2, 3, 4, 5 instead
    assert held == {0, 1, 6, 7, 8, 9, 10, 11}
    assert state.slot_class is not None


def test_lru_without_scores(tap):
    state, binding, step, dev = _binding(None)
    held = _run(binding, step, dev, torch.full((4, 8), -1, dtype=torch.int32))
    assert held == {4, 5, 6, 7, 8, 9, 10, 11}
    assert state.slot_class is None


def test_a_record_of_another_buffer_is_not_used(tap):
    """The conversion converts a tensor the recorded top-k was not written to: no classes
    this step (plain LRU), and the record is dropped."""
    state, binding, step, dev = _binding(tap)
    buffer = torch.full((4, 8), -1, dtype=torch.int32)
    _decode_step(binding, step, dev, 1, _logits({0: 5, 1: 5, 2: 5, 3: 5}), buffer)
    logits = _logits({4: 5, 5: 5, 6: 5, 7: 5})
    compat.indexer_topk_class()("torch")(logits, torch.tensor([[WIDTH]], dtype=torch.int32), 1,
                                         buffer[:1, :K], K, WIDTH)
    assert tap.take(buffer[:1, :K].clone()) is None
    assert tap.take(buffer[:1, :K]) is None  # dropped by the first take


def test_the_tap_records_nothing_until_enabled():
    tap = ScoreTap()
    patches.INDEXER_SCORES.remove()
    patches.INDEXER_SCORES.install(tap.record_decode_topk)
    try:
        buffer = torch.full((1, K), -1, dtype=torch.int32)
        compat.indexer_topk_class()("torch")(_logits({3: 1.0}), torch.tensor([[WIDTH]],
                                             dtype=torch.int32), 1, buffer, K, WIDTH)
        assert 3 in buffer[0].tolist()  # vLLM's top-k ran
        assert tap.take(buffer) is None
        tap.enable()
        compat.indexer_topk_class()("torch")(_logits({3: 1.0}), torch.tensor([[WIDTH]],
                                             dtype=torch.int32), 1, buffer, K, WIDTH)
        record = tap.take(buffer)
        assert record is not None and record.next_n == 1 and record.threshold.shape == (1,)
    finally:
        patches.INDEXER_SCORES.remove()


def test_the_worker_role_binds_scores_only_with_score_eviction(model_dir):  # noqa: F811
    from vllm_hisparse.vllm.worker_side import score_tap

    patches.INDEXER_SCORES.remove()
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44)
    assert not patches.INDEXER_SCORES.installed()
    assert all(b.scores is None and b.hot_state.slot_class is None for b in rig.role.bindings)
    rig.role.shutdown()
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44,
              extra={"hot_region_eviction": "score"})
    try:
        assert patches.INDEXER_SCORES.installed() and score_tap.TAP.enabled
        assert all(b.scores is score_tap.TAP for b in rig.role.bindings)
        assert all(b.hot_state.slot_class.shape == (b.hot_state.num_state_rows,
                                                    b.hot_state.hot_slots)
                   for b in rig.role.bindings)
        # steps whose top-k did not come through vLLM's indexer: plain LRU, every read exact
        run_decode_loop(rig, steps=12)
        assert rig.reads_checked > 0
        assert_nothing_leaked(rig)
        # a record no conversion took (an all-FULL step) is dropped when the step ends
        buffer = torch.full((1, K), -1, dtype=torch.int32)
        compat.indexer_topk_class()("torch")(_logits({3: 1.0}), torch.tensor([[WIDTH]],
                                             dtype=torch.int32), 1, buffer, K, WIDTH)
        assert score_tap.TAP._record is not None
        rig.step({})
        assert score_tap.TAP.take(buffer) is None
    finally:
        rig.role.shutdown()
        patches.INDEXER_SCORES.remove()
        score_tap.TAP.enabled = False
