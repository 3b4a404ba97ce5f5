"""The default synthetic trace against the HiSparse paper's miss-rate table, and the
``current`` (swap-vanilla) policy model."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_hisparse.core.replacement import replay, replay_request
from vllm_hisparse.core.trace import PAPER_MISS_RATES, synthetic_trace


def test_current_policy_misses_what_the_previous_step_did_not_select():
    sets = [np.array([1, 2, 3]), np.array([2, 3, 4]), np.array([7, 8, 9]), np.array([7])]
    misses, refs = replay_request("current", sets, capacity=4)
    assert (misses, refs) == (3 + 1 + 3 + 0, 10)
    with pytest.raises(ValueError, match="more than the capacity"):
        replay_request("current", sets, capacity=2)


def test_synthetic_trace_is_deterministic_and_leaves_the_tail_out():
    a = synthetic_trace(1, 5, top_k=256, context_tokens=4096, seed=3)
    b = synthetic_trace(1, 5, top_k=256, context_tokens=4096, seed=3)
    assert np.array_equal(a.positions, b.positions)
    for _, sets in a.requests():
        for step, chosen in enumerate(sets):
            assert chosen.shape[0] == 256 - 128  # the newest 128 are the resident tail
            assert np.all(np.diff(chosen) > 0) and chosen.max() < 4096 + step - 128


@pytest.mark.slow
def test_default_trace_reproduces_the_paper_table():
    trace = synthetic_trace()
    rates = {}
    for policy, rows in PAPER_MISS_RATES:
        (result,) = replay(trace, [policy], [rows])
        rates[(policy, rows)] = result.miss_rate
    for key, paper in PAPER_MISS_RATES.items():
        assert abs(rates[key] - paper) < 0.015, (key, rates[key], paper)
