"""Cross-layer miss prediction (``core.miss_prediction``) on hand-built traces whose answers are
known exactly, and the trace's index groups it reads."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_hisparse.core.miss_prediction import ONE_GROUP_NOTE, PREDICTORS, evaluate_prediction
from vllm_hisparse.core.replacement import replay_request
from vllm_hisparse.core.trace import SelectionTrace, TraceRecorder


def trace_of(groups: dict[int, list[list[int]]], request: int = 0,
             rec: TraceRecorder | None = None) -> SelectionTrace:
    """One request's selection sets per index group, step i = list index i."""
    rec = rec or TraceRecorder(top_k=4, block_size=4, source="test")
    for g, steps in groups.items():
        for step, positions in enumerate(steps):
            rec.add(request, step, positions, group=g)
    return rec.trace()


def counts(report, name, gap=None):
    c = report.overall[name] if gap is None else report.gaps[gap].counts[name]
    return c.miss_rows, c.predicted_rows, c.covered_rows


def random_sets(seed, steps=30, k=12, positions=60):
    rng = np.random.default_rng(seed)
    return [sorted(rng.choice(positions, size=k, replace=False).tolist()) for _ in range(steps)]


def test_identical_layers_are_predicted_exactly():
    sets = random_sets(0)
    report = evaluate_prediction(trace_of({0: sets, 1: sets}), 24)
    misses = replay_request("hisparse", sets, 24)[0]
    layer = report.overall["layer"]
    assert (layer.miss_rows, layer.predicted_rows, layer.covered_rows) == (misses,) * 3
    assert layer.recall == 1.0 and layer.precision == 1.0 and layer.extra_traffic == 0.0
    assert report.note is None and [(g.source_group, g.target_group) for g in report.gaps] == \
        [(0, 1)]
    assert list(report.overall) == list(PREDICTORS)


def test_disjoint_layers_predict_nothing_useful():
    even = [[2 * p for p in s] for s in random_sets(1)]
    odd = [[2 * p + 1 for p in s] for s in random_sets(2)]
    report = evaluate_prediction(trace_of({0: even, 1: odd}), 24)
    misses = replay_request("hisparse", odd, 24)[0]
    # group 1's region never holds an even position: every one of group 0's rows is predicted
    assert counts(report, "layer") == (misses, sum(map(len, even)), 0)
    assert counts(report, "layer_step") == (misses, sum(map(len, even[:-1])), 0)
    assert report.overall["layer"].recall == 0.0 and report.overall["layer"].precision == 0.0


def test_partial_overlap_counts_exactly():
    """Capacity 4, the kernel's LRU. Group 1's region: t0 holds {} and misses 1 2 9; t1 holds
    {1 2 9}, misses 4 5 8; t2 holds {9 4 5 8}, misses 7 10 (9 hits): 8 misses.
    previous layer: t0 {1 2 3} covers 1 2; t1 {4 5 6} covers 4 5; t2 {1 7} covers 7 -> 8
    predicted, 5 covered. previous layer, previous step: t1 {3}, t2 {6} -> 2, 0 covered.
    Group 2 equals group 1: its gap is predicted exactly."""
    g0 = [[1, 2, 3], [4, 5, 6], [1, 7]]
    g1 = [[1, 2, 9], [4, 5, 8], [7, 9, 10]]
    report = evaluate_prediction(trace_of({0: g0, 1: g1, 2: g1}), 4)
    assert report.index_groups == (0, 1, 2) and report.requests == 1
    gap = report.gaps[0]
    assert (gap.steps, gap.references, gap.miss_rows) == (3, 9, 8)
    assert counts(report, "layer", 0) == (8, 8, 5)
    assert counts(report, "step", 0) == (8, 0, 0)
    assert counts(report, "layer_step", 0) == (8, 2, 0)
    assert counts(report, "union", 0) == (8, 10, 5)  # t0 {1 2 3}, t1 {3 4 5 6}, t2 {1 6 7}
    c = gap.counts["union"]
    assert (c.recall, c.precision, c.extra_traffic, c.extra_rows) == (5 / 8, 5 / 10, 5 / 8, 5)
    assert counts(report, "layer", 1) == (8, 8, 8)
    assert counts(report, "layer") == (16, 16, 13)  # overall = the sum over the gaps
    assert report.to_dict()["overall"]["layer"]["covered_rows"] == 13


def test_own_previous_step_is_always_held():
    """A region holds every position of the step before (capacity >= one step), so L+1's own
    previous selections name no miss: the control row is 0 on any trace and policy."""
    for policy in ("hisparse", "lru", "fifo", "random", "current", "belady", "frequency"):
        report = evaluate_prediction(trace_of({0: random_sets(3), 1: random_sets(4)}), 12,
                                     policy=policy)
        assert report.overall["step"].predicted_rows == 0
        assert report.overall["step"].miss_rows == replay_request(
            policy, random_sets(4), 12, seed=0)[0]
        assert report.overall["step"].precision is None


def test_previous_step_is_the_requests_previous_record():
    """Group 0 has no record at step 1: nothing is predicted for group 1 at step 1 from the
    layer, and at step 2 nothing from the layer's step before (step 1). Step ids need not
    be consecutive (an engine step id), and requests are replayed apart."""
    rec = TraceRecorder(top_k=4, block_size=4)
    for step, g0, g1 in ((10, [1, 2], [1, 2]), (12, None, [3, 4]), (17, [5], [5, 6])):
        if g0 is not None:
            rec.add(3, step, g0, group=0)
        rec.add(3, step, g1, group=1)
    rec.add(8, 0, [1], group=0)  # another request: its own region
    rec.add(8, 0, [1], group=1)
    report = evaluate_prediction(rec.trace(), 4)
    # group 1 misses: request 3: 1 2 | 3 4 | 5 6; request 8: 1 -> 7
    assert counts(report, "layer") == (7, 2 + 0 + 1 + 1, 2 + 0 + 1 + 1)
    assert counts(report, "layer_step") == (7, 0, 0)
    assert report.requests == 2 and report.gaps[0].steps == 4


def test_one_index_group_has_nothing_to_predict():
    report = evaluate_prediction(trace_of({0: [[1, 2], [3]]}), 4)
    assert report.note == ONE_GROUP_NOTE and report.gaps == []
    assert all(c.predicted_rows == 0 for c in report.overall.values())
    assert report.to_dict()["note"] == ONE_GROUP_NOTE


def test_bad_capacity_and_policy_are_refused():
    trace = trace_of({0: [[1, 2, 3]], 1: [[1]]})
    with pytest.raises(ValueError,
                       match=r"smaller than the largest selection set of the trace \(3 rows\)"):
        evaluate_prediction(trace, 2)
    with pytest.raises(ValueError, match="policy 'score'"):
        evaluate_prediction(trace, 4, policy="score")
