"""The score ops of score-aware eviction (``ops.score_threshold``, ``ops.slot_classes``):
the torch twin against the numpy twin (``core.trace.score_classes``) and against the torch
path it replaced, the fixed summation order, the edge cases and the argument checks; on a
GPU the CUDA kernels against the twin, bit for bit, incl. the largest sizes and a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hisparse import ops
from vllm_hisparse.core.trace import (NUM_SCORE_CLASSES, SCORE_CLASS_WIDTH, SCORE_SUM_LANES,
                                      lane_tree_sum, score_classes)
from vllm_hisparse.ops import reference, reference_scores

CUDA = pytest.mark.skipif(not torch.cuda.is_available() or not ops.cuda.available(),
                          reason="needs a CUDA device and the compiled extension")

#: One top-k row whose float32 width depends on the order of the float64 sum: the lane tree
#: gives 1.1377578e16, a left-to-right sum 1.1377577e16 (found by a search over random rows
#: with a wide exponent spread).
ORDER_SENSITIVE_ROW = [0.0, 8054271639552000.0, 0.04849982261657715, 1.9092970024206336e16,
                       4.5313544273376465, 4.111822159557427e16]


def _previous_torch_path(logits, topk, next_n, batch_state_rows, slot_pos):
    """The torch ops these kernels replaced (``worker/score_classes.py`` before the fusion),
    kept as an oracle: classes ``[R + 1, D]`` (row R: scratch), sum in ``torch.sum``'s order."""
    valid = (topk >= 0) & (topk < logits.shape[1])
    scores = logits.gather(1, topk.clamp(0, logits.shape[1] - 1).long()).float()
    valid &= torch.isfinite(scores)
    thr = torch.where(valid, scores, torch.full_like(scores, float("inf"))).amin(dim=1)
    count = valid.sum(dim=1).clamp(min=1).double()
    mean = torch.where(valid, scores, torch.zeros_like(scores)).double().sum(dim=1) / count
    tiny = torch.finfo(torch.float32).tiny
    w = ((mean - thr.double()) * SCORE_CLASS_WIDTH).float()
    w = torch.where(torch.isfinite(w) & (w > tiny), w, torch.full_like(w, tiny))
    num_requests, (num_rows, num_slots) = logits.shape[0] // next_n, slot_pos.shape
    state = batch_state_rows[:num_requests].long()
    positions = slot_pos[state.clamp(min=0)].repeat_interleave(next_n, dim=0)
    s = logits.gather(1, positions.clamp(0, logits.shape[1] - 1).long()).float()
    classes = torch.zeros_like(s, dtype=torch.uint8)
    for c in range(1, NUM_SCORE_CLASSES):
        classes += (s >= thr[:, None] - c * w[:, None]).to(torch.uint8)
    classes = torch.where(positions >= 0, classes, torch.zeros_like(classes))
    classes = classes.view(num_requests, next_n, num_slots).amax(dim=1)
    out = torch.zeros((num_rows + 1, num_slots), dtype=torch.uint8)
    out.index_copy_(0, torch.where(state >= 0, state, torch.full_like(state, num_rows)), classes)
    return thr, w, out


def _topk(logits: torch.Tensor, k: int, lengths: list[int]) -> torch.Tensor:
    """The top-k columns of each row within its length, -1 padded (as vLLM's top-k)."""
    cols = torch.arange(logits.shape[1])
    ends = torch.tensor(lengths)[:, None]
    masked = logits.float().masked_fill(cols[None, :] >= ends, float("-inf"))
    idx = masked.topk(k, dim=1).indices.to(torch.int32)
    return torch.where(torch.arange(k)[None, :] < ends, idx, -1)


def _case(seed: int, requests=5, next_n=1, width_cols=700, k=64, slots=96, extra_rows=3,
          dtype=torch.float32):
    """(logits, topk, batch_state_rows, slot_pos): distinct state rows, some requests
    untracked, hot slots holding distinct positions below each request's length."""
    g = torch.Generator().manual_seed(seed)
    rows = requests * next_n
    lengths = [int(x) for x in torch.randint(k // 2, width_cols + 1, (rows,), generator=g)]
    logits = torch.randn((rows, width_cols), generator=g).to(dtype)
    topk = _topk(logits, k, lengths)
    num_rows = requests + extra_rows
    state_rows = torch.randperm(num_rows, generator=g)[:requests].to(torch.int32)
    state_rows[::4] = -1
    slot_pos = torch.full((num_rows, slots), -1, dtype=torch.int32)
    for r in range(num_rows):
        n = int(torch.randint(slots // 2, slots + 1, (1,), generator=g))
        slot_pos[r, :n] = torch.randperm(width_cols, generator=g)[:n].to(torch.int32)
    # half of a request's slots hold positions ranked near its cut (all classes occur)
    for b, r in enumerate(state_rows.tolist()):
        if r >= 0:
            near = logits[b * next_n].float().argsort(descending=True)[k // 2:4 * k]
            pick = near[torch.randperm(near.numel(), generator=g)[:slots // 2]]
            slot_pos[r, :pick.numel()] = pick.to(torch.int32)
    return logits, topk, state_rows, slot_pos


def _run(backend, logits, topk, next_n, state_rows, slot_pos, fill=9):
    rows = logits.shape[0]
    thr = torch.empty(rows, dtype=torch.float32, device=logits.device)
    w = torch.empty(rows, dtype=torch.float32, device=logits.device)
    out = torch.full(tuple(slot_pos.shape), fill, dtype=torch.uint8, device=logits.device)
    backend.score_threshold(logits, topk, thr, w)
    backend.slot_classes(logits, thr, w, next_n, state_rows, slot_pos, out)
    return thr, w, out


REF = ops.select("reference")


# ---------------------------------------------------------------------------- CPU: twins


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("next_n", [1, 2])
def test_twin_matches_the_torch_path_it_replaced(seed, next_n):
    """Same thresholds, widths and classes (these float32 scores sum exactly in float64, so
    the order of the sum does not show); rows of no decode request are left alone."""
    logits, topk, state_rows, slot_pos = _case(seed, next_n=next_n)
    thr, w, out = _run(REF, logits, topk, next_n, state_rows, slot_pos)
    old_thr, old_w, old_out = _previous_torch_path(logits, topk, next_n, state_rows, slot_pos)
    assert torch.equal(thr, old_thr) and torch.equal(w, old_w)
    tracked = state_rows[state_rows >= 0].long()
    assert torch.equal(out[tracked], old_out[tracked])
    untouched = torch.ones(slot_pos.shape[0], dtype=torch.bool)
    untouched[tracked] = False
    assert bool((out[untouched] == 9).all())
    assert set(out[tracked].unique().tolist()) == set(range(NUM_SCORE_CLASSES))


@pytest.mark.parametrize("seed", range(3))
def test_twin_matches_the_numpy_twin(seed):
    logits, topk, state_rows, slot_pos = _case(seed, requests=6, width_cols=900, k=300)
    _, _, out = _run(REF, logits, topk, 1, state_rows, slot_pos)
    for b, row in enumerate(state_rows.tolist()):
        if row < 0:
            continue
        chosen = topk[b].numpy()
        positions, classes = score_classes(logits[b].numpy(), chosen)
        want = np.zeros(logits.shape[1], dtype=np.uint8)
        want[positions] = classes
        want[chosen[chosen >= 0]] = NUM_SCORE_CLASSES - 1  # selected: as close as it gets
        pos = slot_pos[row].numpy()
        assert np.array_equal(out[row].numpy(), np.where(pos >= 0, want[np.maximum(pos, 0)], 0))


def test_lane_tree_sum_is_the_documented_order():
    """numpy and torch sum in one order: lanes j % 256 left to right, then halved pairwise;
    a left-to-right sum of the same values differs (so the order is observable)."""
    g = np.random.default_rng(0)
    values = np.ldexp(g.random((3, 700)), g.integers(-30, 60, (3, 700)))
    values[:, ::97] = 2.0 ** 60
    want = []
    for row in values:
        lanes = [0.0] * SCORE_SUM_LANES
        for j, v in enumerate(row):
            lanes[j % SCORE_SUM_LANES] += v
        h = SCORE_SUM_LANES // 2
        while h:
            lanes = [lanes[i] + lanes[i + h] for i in range(h)]
            h //= 2
        want.append(lanes[0])
    assert lane_tree_sum(values).tolist() == want
    assert reference_scores._lane_tree_sum(torch.from_numpy(values)).tolist() == want
    assert [float(sum(row.tolist())) for row in values] != want


def test_width_follows_the_lane_tree_order():
    logits = torch.tensor([ORDER_SENSITIVE_ROW])
    topk = torch.arange(6, dtype=torch.int32)[None]
    thr, w = torch.empty(1), torch.empty(1)
    REF.score_threshold(logits, topk, thr, w)
    values = np.array(ORDER_SENSITIVE_ROW, dtype=np.float32).astype(np.float64)
    tree = np.float32(lane_tree_sum(values) / 6 - 0.0)
    left_to_right = np.float32(sum(values.tolist()) / 6 - 0.0)
    assert tree != left_to_right
    assert float(w[0]) == float(tree) and float(thr[0]) == 0.0


def _adversarial_rows():
    """logits [6, 40], topk [6, 8]: all -inf, no selection (padding), ties at the threshold,
    NaN and +inf among the selections, columns outside [0, W), a constant row."""
    logits = torch.randn((6, 40), generator=torch.Generator().manual_seed(5))
    topk = torch.arange(8, dtype=torch.int32).repeat(6, 1)
    logits[0] = float("-inf")
    topk[1] = -1
    logits[2, :8] = 4.0
    logits[2, 8:12] = 4.0            # unselected ties at the threshold: class 3
    logits[2, 7] = 5.0
    logits[3, 2], logits[3, 5] = float("nan"), float("inf")
    topk[4, 3], topk[4, 6] = 40, 1000
    logits[5] = 1.5
    return logits, topk


def test_adversarial_rows():
    logits, topk = _adversarial_rows()
    slot_pos = torch.arange(40, dtype=torch.int32).view(1, 40).repeat(6, 1)
    slot_pos[:, -3:] = torch.tensor([-1, 40, 7 << 20], dtype=torch.int32)  # empty, outside
    state_rows = torch.arange(6, dtype=torch.int32)
    thr, w, out = _run(REF, logits, topk, 1, state_rows, slot_pos)
    old_thr, old_w, old_out = _previous_torch_path(logits, topk, 1, state_rows,
                                                   slot_pos.clamp(max=39))
    tiny = torch.finfo(torch.float32).tiny
    assert thr[0] == float("inf") and thr[1] == float("inf") and bool((out[:2] == 0).all())
    assert thr[2] == 4.0 and torch.isclose(w[2], torch.tensor(1 / 8))
    assert out[2, 8:12].tolist() == [3, 3, 3, 3]
    assert w[5] == tiny and out[5, :37].tolist() == [3] * 37  # every score at the threshold
    assert bool((out[:, -3:] == 0).all())                     # empty or outside [0, W)
    assert torch.equal(thr, old_thr) and torch.equal(w, old_w)
    assert torch.equal(out[:, :-3], old_out[:6, :-3])
    # the numpy twin: the same classes for the unselected positions
    for i in range(2, 6):
        positions, classes = score_classes(logits[i].numpy(), topk[i].numpy())
        want = np.zeros(40, np.uint8)
        want[positions] = classes
        got = out[i, :37].numpy().copy()
        chosen = topk[i].numpy()
        got[chosen[(chosen >= 0) & (chosen < 37)]] = 0
        assert np.array_equal(got, want[:37]), i


def test_next_n_takes_the_highest_class_over_a_requests_rows():
    next_n, width_cols = 2, 40
    logits = torch.zeros((2 * next_n, width_cols))
    logits[:, :8] = 10.0
    logits[:, 8] = 11.0                 # mean - threshold = 1/9: w = 1/9
    logits[0, 20], logits[1, 20] = 9.95, 9.8   # request 0: rows 0 and 1 -> class max(3, 2)
    logits[1, 21] = 9.8                 # class 2 from row 1 alone
    logits[2, 20] = 9.95                # request 1 (untracked)
    topk = logits.topk(9, dim=1).indices.to(torch.int32)
    slot_pos = torch.full((2, 4), -1, dtype=torch.int32)
    slot_pos[1, :3] = torch.tensor([20, 21, 30], dtype=torch.int32)
    _, _, out = _run(REF, logits, topk, next_n, torch.tensor([1, -1], dtype=torch.int32),
                     slot_pos, fill=7)
    assert out[1].tolist() == [3, 2, 0, 0]
    assert out[0].tolist() == [7, 7, 7, 7]


def test_empty_inputs():
    for rows, cols, k in ((0, 16, 4), (3, 16, 0), (3, 0, 4)):
        logits = torch.zeros((rows, cols))
        topk = torch.zeros((rows, k), dtype=torch.int32)
        slot_pos = torch.zeros((3, 8), dtype=torch.int32)
        thr, w, out = _run(REF, logits, topk, 1, torch.arange(3, dtype=torch.int32)[:rows],
                           slot_pos, fill=5)
        assert bool(torch.isinf(thr).all()) and bool((out == (5 if rows == 0 else 0)).all())


def test_bf16_and_row_strided_logits():
    logits, topk, state_rows, slot_pos = _case(1, width_cols=300, dtype=torch.bfloat16)
    wide = torch.zeros((logits.shape[0], 320), dtype=torch.bfloat16)
    wide[:, :300] = logits
    strided = wide[:, :300]
    assert not strided.is_contiguous()
    a = _run(REF, logits, topk, 1, state_rows, slot_pos)
    b = _run(REF, strided, topk, 1, state_rows, slot_pos)
    old = _previous_torch_path(logits, topk, 1, state_rows, slot_pos)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a[0], old[0]) and torch.equal(a[1], old[1])


def test_bad_arguments_are_named():
    logits, topk, state_rows, slot_pos = _case(0)
    rows = logits.shape[0]
    thr, w = torch.empty(rows), torch.empty(rows)
    out = torch.zeros(tuple(slot_pos.shape), dtype=torch.uint8)
    with pytest.raises(ValueError, match="logits must have dtype"):
        ops.score_threshold(logits.double(), topk, thr, w)
    with pytest.raises(ValueError, match="topk must have 5 rows"):
        ops.score_threshold(logits, topk[:4], thr, w)
    with pytest.raises(ValueError, match="logits must have contiguous rows"):
        ops.score_threshold(logits.t().contiguous().t(), topk, thr, w)
    with pytest.raises(ValueError, match=r"width must have shape \(5,\)"):
        ops.score_threshold(logits, topk, thr, w[:4])
    with pytest.raises(ValueError, match="width shares memory with threshold"):
        ops.score_threshold(logits, topk, thr, thr)
    with pytest.raises(ValueError, match="not a whole number of requests of next_n = 2"):
        ops.slot_classes(logits, thr, w, 2, state_rows, slot_pos, out)
    with pytest.raises(ValueError, match="next_n must be a positive int"):
        ops.slot_classes(logits, thr, w, 0, state_rows, slot_pos, out)
    with pytest.raises(ValueError, match="batch_state_rows has 4 entries for 5"):
        ops.slot_classes(logits, thr, w, 1, state_rows[:4], slot_pos, out)
    with pytest.raises(ValueError, match=r"slot_class must have shape"):
        ops.slot_classes(logits, thr, w, 1, state_rows, slot_pos, out[:4])
    twice = torch.tensor([1, 2, 1, -1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="state row 1 for two decode requests"):
        ops.slot_classes(logits, thr, w, 1, twice, slot_pos, out)
    outside = torch.tensor([1, 2, 8, -1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"batch_state_rows holds 8, outside \[0, 8\)"):
        ops.slot_classes(logits, thr, w, 1, outside, slot_pos, out)
    with pytest.raises(ValueError, match="ops backend 'cuda' needs CUDA"):
        ops.select("cuda").slot_classes(logits, thr, w, 1, state_rows, slot_pos, out)


def test_backends_bind_the_score_twins():
    assert REF.score_threshold.__doc__ == reference.score_threshold.__doc__
    assert REF.slot_classes.__name__ == "slot_classes"


# ---------------------------------------------------------------------------- GPU: kernels


def _cuda_equals_twin(logits, topk, next_n, state_rows, slot_pos) -> torch.Tensor:
    dev = torch.device("cuda")
    want = _run(REF, logits, topk, next_n, state_rows, slot_pos)
    got = _run(ops.select("cuda"), logits.to(dev), topk.to(dev), next_n, state_rows.to(dev),
               slot_pos.to(dev))
    torch.cuda.synchronize()
    got = [t.cpu() for t in got]
    assert torch.equal(got[0], want[0]), "threshold"
    assert torch.equal(got[1], want[1]), "width"
    assert torch.equal(got[2], want[2]), "slot_class"
    return got[2]


@pytest.mark.gpu
@CUDA
def test_cuda_constants_match_the_contract():
    from vllm_hisparse.ops import _extension
    module = _extension.load()[0]
    assert module.SCORE_SUM_LANES == SCORE_SUM_LANES
    assert module.NUM_SCORE_CLASSES == NUM_SCORE_CLASSES


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_twin_random(seed, next_n, dtype):
    case = _case(seed, requests=7, next_n=next_n, width_cols=3000, k=700, slots=1536,
                 dtype=dtype)
    out = _cuda_equals_twin(case[0], case[1], next_n, case[2], case[3])
    # The case is not trivial: the batch's rows hold more than one class (other rows keep
    # the fill, in both backends).
    rows = sorted({r for r in case[2].tolist() if 0 <= r < out.shape[0]})
    assert len(set(out[rows].unique().tolist())) >= 2


@pytest.mark.gpu
@CUDA
def test_cuda_equals_twin_adversarial():
    logits, topk = _adversarial_rows()
    slot_pos = torch.arange(40, dtype=torch.int32).view(1, 40).repeat(6, 1)
    slot_pos[:, -3:] = torch.tensor([-1, 40, 7 << 20], dtype=torch.int32)
    _cuda_equals_twin(logits, topk, 1, torch.arange(6, dtype=torch.int32), slot_pos)
    _cuda_equals_twin(logits, topk, 2, torch.tensor([2, -1, 0], dtype=torch.int32), slot_pos)
    order = torch.tensor([ORDER_SENSITIVE_ROW])
    _cuda_equals_twin(order, torch.arange(6, dtype=torch.int32)[None], 1,
                      torch.zeros(1, dtype=torch.int32), torch.arange(6, dtype=torch.int32)[None])
    for rows, cols, k in ((0, 16, 4), (3, 16, 0), (3, 0, 4)):
        _cuda_equals_twin(torch.zeros((rows, cols)), torch.zeros((rows, k), dtype=torch.int32),
                          1, torch.arange(3, dtype=torch.int32)[:rows],
                          torch.zeros((3, 64), dtype=torch.int32))


@pytest.mark.gpu
@CUDA
def test_cuda_equals_twin_wide_exponents_and_strided_rows():
    """Scores over 90 binary orders of magnitude (the float64 sums round) in row-strided
    logits: the kernel sums in the twin's order."""
    g = torch.Generator().manual_seed(3)
    rows, cols, k = 64, 5000, 2048
    mant = torch.rand((rows, cols), generator=g) * 2 - 1
    logits = torch.ldexp(mant, torch.randint(-30, 60, (rows, cols), generator=g)).float()
    wide = torch.zeros((rows, cols + 24))
    wide[:, :cols] = logits
    topk = torch.randint(-1, cols, (rows, k), generator=g, dtype=torch.int32)
    slot_pos = torch.randint(-1, cols, (rows, 4096), generator=g, dtype=torch.int32)
    _cuda_equals_twin(wide[:, :cols], topk, 1, torch.arange(rows, dtype=torch.int32), slot_pos)


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_equals_twin_largest_sizes(dtype):
    """256 logits rows of W = 163840 (160K context), K 2048, D 32768 hot slots (the int16
    lru's limit), next_n 4."""
    g = torch.Generator().manual_seed(11)
    next_n, requests, cols, k, slots = 4, 64, 163840, 2048, 32768
    rows = requests * next_n
    logits = torch.randn((rows, cols), generator=g).to(dtype)
    topk = torch.randint(0, cols, (rows, k), generator=g, dtype=torch.int32)
    topk[::5, -100:] = -1
    slot_pos = torch.randint(-1, cols, (requests + 8, slots), generator=g, dtype=torch.int32)
    state_rows = torch.randperm(requests + 8, generator=g)[:requests].to(torch.int32)
    state_rows[::9] = -1
    _cuda_equals_twin(logits, topk, next_n, state_rows, slot_pos)


@pytest.mark.gpu
@CUDA
def test_cuda_ops_replay_in_a_graph():
    dev = torch.device("cuda")
    logits, topk, state_rows, slot_pos = (t.to(dev) for t in _case(2, width_cols=2000, k=512,
                                                                   slots=1024))
    backend = ops.select("cuda")
    thr = torch.empty(logits.shape[0], device=dev)
    w = torch.empty_like(thr)
    out = torch.zeros(tuple(slot_pos.shape), dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        backend.score_threshold(logits, topk, thr, w)
        backend.slot_classes(logits, thr, w, 1, state_rows, slot_pos, out)
    logits.copy_(torch.randn(logits.shape, device=dev))
    graph.replay()
    torch.cuda.synchronize()
    want = _run(REF, logits.cpu(), topk.cpu(), 1, state_rows.cpu(), slot_pos.cpu(), fill=0)
    assert torch.equal(thr.cpu(), want[0]) and torch.equal(w.cpu(), want[1])
    assert torch.equal(out.cpu(), want[2])
