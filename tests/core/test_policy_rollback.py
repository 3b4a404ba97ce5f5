"""Rejected draft tokens (speculative decoding) rolled back in the policy's tables.

The fake worker (``core_harness``) writes the KV of a rejected draft as the negated tag of
its position; after every step every position below the request's length must read back
its own tag through the worker's tables (resident or from the host), and no host row at or
past the length may count as valid (``check_invariants``).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from core_harness import Driver, make_policy
from vllm_hisparse.core import ProtocolError, Residency, TransferKind


def _spec_run(d: Driver, ids, *, k: int, steps: int, seed: int, ack_every: int = 1,
              accepted=None) -> None:
    rng = random.Random(seed)
    for i in range(steps):
        plan = {}
        for rid in ids:
            a = accepted(i) if accepted is not None else rng.choice([0, 0, k, rng.randint(0, k)])
            plan[rid] = (1 + k, a)
        d.spec_step(plan, ack=(i % ack_every == ack_every - 1))
    d.ack_all()


@pytest.mark.parametrize("k,bs,blocks", [(3, 4, 48), (7, 4, 48), (11, 4, 48), (2, 8, 30)],
                         ids=["k3b4", "k7b4", "k11b4", "k2b8"])
def test_rejected_drafts_never_reach_a_valid_host_row(k, bs, blocks):
    """Large k against small pages (B7: one step's drafts span more than the tail pages),
    under pressure so that clean non-tail pages are released and reused: every kept
    position reads back right, from the device or the host, at every step."""
    d = Driver(make_policy(num_device_blocks=blocks, block_size=bs, max_pages=96, hot_blocks=2,
                           low_watermark_blocks=blocks // 5, high_watermark_blocks=blocks * 3 // 10))
    ids = ["a", "b", "c"]
    for rid in ids:
        d.add(rid)
    d.step({rid: 6 * bs for rid in ids})
    _spec_run(d, ids, k=k, steps=30, seed=k * 100 + bs)
    stats = d.policy.stats
    assert stats.num_rolled_back_tokens > 0
    assert stats.num_demotions > 0 and stats.num_pages_released > 0 and stats.num_pages_reused > 0
    assert any(d.policy.residency(r) != Residency.FULL for r in ids)


def test_full_rejection_every_step_keeps_the_length_and_no_host_row():
    """Every draft rejected: each step adds exactly one position and the pages past the
    length (adopted for the drafts) never hold a valid host row."""
    bs, k = 4, 6
    d = Driver(make_policy(num_device_blocks=64, block_size=bs, max_pages=64))
    d.add("a")
    d.step({"a": 9})
    row = d.policy.row_of("a")
    for i in range(12):
        d.spec_step({"a": (1 + k, 0)})
        assert int(d.policy.tables.num_tokens[row]) == 10 + i
    # Pages adopted ahead for the drafts stay with the request, empty on the host.
    assert int(d.policy.tables.num_pages[row]) > -(-21 // bs)
    assert d.policy.stats.num_rolled_back_tokens == 12 * k


def test_a_late_mirror_is_clipped_to_the_kept_positions():
    """Acks arriving steps after the rollback: the open MIRRORs were clipped, so their
    completion marks only kept positions valid (the rewrite's MIRROR marks the rest)."""
    bs, k = 4, 5
    d = Driver(make_policy(num_device_blocks=64, block_size=bs, max_pages=64))
    d.add("a")
    d.step({"a": 8})
    row = d.policy.row_of("a")
    d.spec_step({"a": (1 + k, 1)}, ack=False)  # writes 8..13, keeps 8..9
    mirror = next(t for t in d.policy.open_transfers() if t.kind == TransferKind.MIRROR
                  and t.step_id == d.policy.step_id - 1)
    copied = mirror.ends > mirror.starts
    assert int((mirror.pages * bs + mirror.ends)[copied].max()) == 10
    d.spec_step({"a": (1 + k, k)}, ack=False)  # writes 10..15, keeps all
    d.ack_all()
    table = d.policy.page_table("a")
    assert int(d.policy.tables.num_tokens[row]) == 16
    assert table.host_valid[:4].all()


def test_without_the_rollback_the_rejected_kv_is_read():
    """The harness sees rejected KV: a step whose drafts were rejected but not rolled back
    leaves positions below the length holding the wrong KV."""
    d = Driver(make_policy(num_device_blocks=64, block_size=4, max_pages=64))
    d.add("a")
    d.step({"a": 8})
    with pytest.raises(AssertionError, match="pos 9"):
        d.spec_step({"a": (4, 0)}, roll_back=False)


def test_roll_back_errors_change_nothing():
    d = Driver(make_policy(num_device_blocks=64, block_size=4, max_pages=64))
    d.add("a", num_hashed_pages=2)
    d.add("b")
    d.step({"a": 8, "b": 6})
    ra, rb = d.policy.row_of("a"), d.policy.row_of("b")
    before = d.policy.tables.num_tokens.copy()
    for rows, ends, what in (
        ([ra, ra], [7, 7], "twice"),
        ([rb], [7], "length"),
        ([rb], [-1], "length"),
        ([ra], [5], "identity"),  # page 1 of "a" has a prefix identity
    ):
        with pytest.raises(ProtocolError, match=what):
            d.policy.roll_back(np.array(rows), np.array(ends))
        assert np.array_equal(d.policy.tables.num_tokens, before)
    assert d.policy.roll_back(np.array([rb]), np.array([6])) == 0
    d.check()
