"""Replacement-policy models and selection traces."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_hisparse.core.replacement import POLICIES, replay, replay_request
from vllm_hisparse.core.trace import SelectionTrace, TraceRecorder, synthetic_trace
from vllm_hisparse.ops import reference


def sets(*steps):
    return [np.array(s, dtype=np.int32) for s in steps]


def test_hisparse_keeps_hits_more_recent_than_misses():
    """Capacity 3. Step 2 hits 1 and misses 4: the hisparse order makes 1 more recent than
    4, so step 3's miss evicts 4 (hisparse) but 1 in position-order LRU... and step 4 tells
    them apart."""
    trace = sets([1, 2, 3], [1, 4], [5], [1])
    m_hisparse, refs = replay_request("hisparse", trace, 3)
    m_lru, _ = replay_request("lru", trace, 3)
    assert refs == 7
    # hisparse: after step 2 order = [2|3 survivors..] -> [3, 4, 1]; step 3 evicts 3 -> [4,1,5]
    # step 4 hits 1. lru: after step 2 order = [2... ] -> [3, 1, 4]; step 3 evicts 3 -> hit too.
    assert m_hisparse == 3 + 1 + 1 + 0
    assert m_lru == m_hisparse  # same here; the next case separates them
    trace = sets([1, 2], [2, 3], [4], [2])  # capacity 2
    # hisparse: [1,2] -> step 2: hit 2, miss 3 takes 1 -> [3, 2]; step 3 evicts 3 -> [2, 4]; hit.
    # lru (position order): [1,2] -> [2, 3] (3 most recent) -> evicts 2 -> [3, 4]; miss.
    assert replay_request("hisparse", trace, 2)[0] == 2 + 1 + 1 + 0
    assert replay_request("lru", trace, 2)[0] == 2 + 1 + 1 + 1


def test_fifo_ignores_hits():
    trace = sets([1, 2], [1], [3], [1], [2])
    # 3 evicts 1 (oldest although just hit) -> 1 misses, evicting 2 -> 2 misses.
    assert replay_request("fifo", trace, 2)[0] == 2 + 0 + 1 + 1 + 1
    # hisparse evicts 2 (least recent) -> 1 hits -> 2 misses.
    assert replay_request("hisparse", trace, 2)[0] == 2 + 0 + 1 + 0 + 1


def test_belady_exact_small_case():
    trace = sets([1, 2], [3], [1], [2])
    # capacity 2: step 2 must evict 1 (next use 3) or 2 (next use 4): Belady evicts 2.
    assert replay_request("belady", trace, 2)[0] == 2 + 1 + 0 + 1
    assert replay_request("hisparse", trace, 2)[0] == 2 + 1 + 1 + 1


def test_capacity_too_small_for_a_step_is_an_error():
    with pytest.raises(ValueError, match="more than the capacity 1"):
        replay_request("lru", sets([1, 2]), 1)
    with pytest.raises(ValueError, match="unknown policy"):
        replay_request("clock", sets([1]), 1)


@pytest.mark.parametrize("seed", range(20))
def test_hisparse_model_matches_the_reference_resolve(seed):
    """The policy model and ops.reference.resolve count the same misses step after step."""
    rng = random.Random(seed)
    bs, capacity, num_positions = 4, 16, 96
    steps = [rng.sample(range(num_positions), rng.randint(1, capacity)) for _ in range(15)]
    model_misses, _ = replay_request("hisparse", [np.array(sorted(s)) for s in steps], capacity)
    num_pages = num_positions // bs
    slot_pos = torch.full((1, capacity), -1, dtype=torch.int32)
    lru = torch.arange(capacity, dtype=torch.int16).reshape(1, -1)
    stats = torch.zeros(3, dtype=torch.int64)
    for s in steps:
        k = len(s)
        reference.resolve(
            torch.tensor([sorted(s)], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.full((1, num_pages), -1, dtype=torch.int32),
            torch.arange(num_pages, dtype=torch.int32).reshape(1, -1),
            torch.arange(capacity // bs, dtype=torch.int32).reshape(1, -1), slot_pos, lru, bs,
            torch.empty((1, k), dtype=torch.int32), torch.empty((1, k), dtype=torch.int32),
            torch.empty((1, k), dtype=torch.int32), torch.empty(1, dtype=torch.int32), stats)
    assert stats[2].item() == model_misses


def test_belady_is_lowest_for_every_capacity_on_the_embedded_trace():
    trace = synthetic_trace(num_requests=3, num_steps=60, top_k=512, context_tokens=8192)
    largest = max(s.shape[0] for _, ss in trace.requests() for s in ss)
    capacities = [largest, largest + 128, 2 * largest, 4 * largest]
    results = replay(trace, POLICIES, capacities)
    assert len(results) == len(POLICIES) * len(capacities)
    for capacity in capacities:
        rates = {r.policy: r.miss_rate for r in results if r.capacity == capacity}
        assert rates["belady"] == min(rates.values()), (capacity, rates)
        assert all(0 < v < 1 for v in rates.values())


@pytest.mark.parametrize("seed", range(10))
def test_belady_is_lowest_on_random_traces(seed):
    rng = random.Random(seed)
    trace = [np.array(rng.sample(range(40), rng.randint(1, 6))) for _ in range(60)]
    for capacity in (6, 8, 12):
        belady = replay_request("belady", trace, capacity)[0]
        scores = [(np.array(rng.sample(range(40), 5)), np.ones(5, np.uint8)) for _ in trace]
        scores = [(np.sort(p), c) for p, c in scores]
        for policy in POLICIES:
            assert belady <= replay_request(policy, trace, capacity, seed=seed,
                                            scores=scores)[0]


def test_belady_uses_next_use_of_unsorted_sets():
    """Regression: sets recorded out of order must still pair positions with their next use."""
    trace = [np.array([2, 1]), np.array([3]), np.array([2])]
    assert replay_request("belady", trace, 2)[0] == 3


def test_replay_skips_capacities_below_the_largest_set():
    rec = TraceRecorder(top_k=4, block_size=4, source="test")
    rec.add(0, 0, [1, 2, 3])
    rec.add(0, 1, [3, 4])
    results = replay(rec.trace(), ["lru"], [2, 3])
    assert [(r.capacity, r.misses, r.references) for r in results] == [(3, 4, 5)]


def test_trace_roundtrip_and_format_errors(tmp_path):
    rec = TraceRecorder(top_k=8, block_size=4, source="test")
    rec.add(1, 0, [5, 3, 3])
    rec.add(0, 0, [])
    rec.add(1, 1, [7])
    trace = rec.trace()
    path = tmp_path / "t.npz"
    trace.save(str(path))
    loaded = SelectionTrace.load(str(path))
    assert loaded.meta["top_k"] == 8 and loaded.meta["format"] == "vllm-hisparse-trace"
    assert [(r, [s.tolist() for s in ss]) for r, ss in loaded.requests()] == \
        [(0, [[]]), (1, [[3, 5], [7]])]
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros(3))
    with pytest.raises(ValueError, match="not a vllm-hisparse selection trace"):
        SelectionTrace.load(str(bad))
    with pytest.raises(ValueError, match="offsets"):
        SelectionTrace(np.zeros(1, np.int32), np.zeros(1, np.int32), np.array([0, 5]),
                       np.zeros(3, np.int32), {})


def test_score_policy_evicts_the_lowest_class_first_then_least_recent():
    # capacity 3: {1, 2, 3} fill the region; step 1 needs 4: one victim among 1, 2, 3
    sets = [np.array([1, 2, 3]), np.array([4]), np.array([1, 2])]
    no_scores = [(np.zeros(0, np.int32), np.zeros(0, np.uint8))] * 3
    # without classes it is the kernel's LRU: victim 1 (least recent), then 1 misses again
    assert replay_request("score", sets, 3, scores=no_scores)[0] == \
        replay_request("hisparse", sets, 3)[0] == 3 + 1 + 1
    # 3 is class 0, 1 and 2 are close to the threshold (class 2): 3 goes, step 2 hits both
    scores = [no_scores[0], (np.array([1, 2]), np.array([2, 2], np.uint8)), no_scores[0]]
    assert replay_request("score", sets, 3, scores=scores)[0] == 3 + 1 + 0
    with pytest.raises(ValueError, match="needs a trace with score classes"):
        replay_request("score", sets, 3)


def test_frequency_policy_keeps_often_selected_positions():
    # 1 is selected at every step, 2 once: at step 3 the victim is 2 although 1 is older
    sets = [np.array([1, 2]), np.array([1]), np.array([1]), np.array([3]), np.array([1])]
    assert replay_request("frequency", sets, 2)[0] == 2 + 0 + 0 + 1 + 0


def test_trace_score_classes_round_trip_and_are_checked(tmp_path):
    trace = synthetic_trace(num_requests=2, num_steps=4, top_k=256, context_tokens=4096)
    assert trace.has_scores
    path = tmp_path / "t.npz"
    trace.save(str(path))
    loaded = type(trace).load(str(path))
    for a, b in zip(trace.scored_requests(), loaded.scored_requests()):
        for (pa, ca), (pb, cb), chosen in zip(a[2], b[2], a[1]):
            assert np.array_equal(pa, pb) and np.array_equal(ca, cb)
            assert ca.min() >= 1 and ca.max() <= 3 and not np.isin(pa, chosen).any()
    plain = synthetic_trace(num_requests=2, num_steps=4, top_k=256, context_tokens=4096,
                            score_class_width=None)
    assert not plain.has_scores and np.array_equal(plain.positions, trace.positions)
    with pytest.raises(ValueError, match="come together"):
        type(trace)(trace.request, trace.step, trace.offsets, trace.positions, {},
                    score_offsets=trace.score_offsets)
    with pytest.raises(ValueError, match=r"score_classes must be in \[1, 4\)"):
        type(trace)(trace.request, trace.step, trace.offsets, trace.positions, {},
                    trace.score_offsets, trace.score_positions, trace.score_classes * 0)


def test_trace_index_groups_round_trip(tmp_path):
    rec = TraceRecorder(top_k=4, block_size=4)
    for g, steps in ((0, [[1, 2], [3]]), (2, [[5], [5, 6, 7]])):
        for step, positions in enumerate(steps):
            rec.add(0, step, positions, group=g)
    trace = rec.trace()
    assert trace.index_groups == (0, 2)
    path = str(tmp_path / "g.npz")
    trace.save(path)
    loaded = SelectionTrace.load(path)
    assert loaded.meta["version"] == 2 and loaded.index_groups == (0, 2)
    assert [[s.tolist() for s in ss] for _, ss in loaded.requests()] == [[[1, 2], [3]]]
    assert [[s.tolist() for s in ss] for _, ss in loaded.requests(2)] == [[[5], [5, 6, 7]]]
    assert [(steps, [s.tolist() for s in ss]) for _, steps, ss in
            loaded.stepped_requests(2)] == [([0, 1], [[5], [5, 6, 7]])]
    # each group has its own region: replay scores one group, the first by default
    assert [(r.misses, r.references) for r in replay(loaded, ["hisparse"], [4])] == [(3, 3)]
    assert [(r.misses, r.references) for r in replay(loaded, ["hisparse"], [4], group=2)] == \
        [(3, 4)]
    # one group: no group array, version 1 (what every earlier build reads)
    rec = TraceRecorder(top_k=4, block_size=4)
    rec.add(0, 0, [1])
    single = rec.trace()
    single.save(path)
    assert single.group is None and SelectionTrace.load(path).meta["version"] == 1
    assert list(single.requests(1)) == []
    with pytest.raises(ValueError, match="one per record"):
        SelectionTrace(trace.request, trace.step, trace.offsets, trace.positions, {},
                       group=trace.group[:1])


def test_synthetic_index_groups_are_independent_draws():
    one = synthetic_trace(1, 4, 512, 4096, score_class_width=None)
    three = synthetic_trace(1, 4, 512, 4096, score_class_width=None, index_groups=3)
    assert one.group is None and three.index_groups == (0, 1, 2)
    assert three.num_records == 3 * one.num_records and three.meta["index_groups_independent"]
    first = [s.tolist() for _, ss in three.requests(0) for s in ss]
    second = [s.tolist() for _, ss in three.requests(1) for s in ss]
    assert first != second
