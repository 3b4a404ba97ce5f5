"""The policy's engine-facing queries and hooks: ``note_device_demand``,
``num_device_blocks_pending_release``, ``non_full_rows``; and the mirror path when a
request is scheduled more than once in a step (repeated ``(row, page)`` entries).
"""

from __future__ import annotations

from collections.abc import Set

import numpy as np
import pytest

from core_harness import Driver, make_policy
from vllm_hisparse.core import Residency, RequestStatus


def _demote_one(d: Driver) -> None:
    """Drive request "a" to MIXED (8 clean pages, tail pinned)."""
    d.add("a")
    d.step({"a": 30})
    d.step({"a": 1})
    d.policy.low_watermark_blocks = 40  # pressure from now on
    d.policy.high_watermark_blocks = 40
    d.step({"a": 1})
    assert d.policy.residency("a") == Residency.MIXED


# -- note_device_demand ------------------------------------------------------------------------
def test_note_device_demand_feeds_one_pressure_decision():
    """Free blocks are well above the low watermark, so nothing demotes on its own. The
    engine's reported shortfall makes the next step demote just enough to cover
    ``high - free + demand``; the demand is forgotten after that step."""
    d = Driver(make_policy(num_device_blocks=64))
    d.add("a")
    d.add("b")
    d.step({"a": 40, "b": 36})  # 10 + 9 clean pages, 45 blocks free
    d.step({})
    assert d.policy.device_pool.get_num_free_blocks() == 45
    assert d.policy.residency("a") == d.policy.residency("b") == Residency.FULL
    stats_before = (d.policy.stats.num_device_backpressure, d.policy.stats.num_demotions)

    d.policy.note_device_demand(40)  # need = high 8 + 40 - free 45 = 3 blocks
    d.step({})
    # "a" alone (8 reclaimable for 2 hot blocks: net 6 >= 3) covers the deficit.
    assert d.policy.residency("a") == Residency.MIXED
    assert d.policy.residency("b") == Residency.FULL
    assert d.policy.stats.num_demotions == stats_before[1] + 1
    assert d.policy.stats.num_device_backpressure == stats_before[0]  # counters untouched

    d.step({})  # no demand reported this step: no further demotion
    d.step({})
    assert d.policy.residency("b") == Residency.FULL
    assert d.policy.stats.num_demotions == stats_before[1] + 1


def test_note_device_demand_rejects_negative_and_accepts_zero():
    policy = make_policy()
    with pytest.raises(ValueError):
        policy.note_device_demand(-1)
    policy.note_device_demand(0)
    policy.build_step()
    assert policy.stats.num_demotions == 0


# -- num_device_blocks_pending_release ----------------------------------------------------------
def _free(d: Driver) -> int:
    return d.policy.device_pool.get_num_free_blocks()


def test_pending_release_counts_sealed_pages_whose_mirror_is_in_flight():
    """A MIXED request decodes without acks: the page that left the tail while its mirror
    was in flight is released by the ack, and the query said so beforehand."""
    d = Driver(make_policy(num_device_blocks=40, low_watermark_blocks=30, high_watermark_blocks=32))
    _demote_one(d)
    assert d.policy.num_device_blocks_pending_release() == 0
    for _ in range(9):  # tokens 33..41: page 8 sealed and out of the tail, mirrors unacked
        d.step({"a": 1}, ack=False)
    pending = d.policy.num_device_blocks_pending_release()
    assert pending == 1
    before = _free(d)
    d.ack_all()
    assert _free(d) - before == pending
    assert d.policy.num_device_blocks_pending_release() == 0


def test_pending_release_counts_leases_of_ended_requests():
    """Mirrors still reading a finished request's blocks hold them; their ack frees them."""
    d = Driver(make_policy())
    d.add("a")
    d.step({"a": 6}, ack=False)
    assert d.policy.num_device_blocks_pending_release() == 0  # FULL: nothing released on ack
    d.policy.finish("a")
    pending = d.policy.num_device_blocks_pending_release()
    assert pending == 2
    before = _free(d)
    d.ack_all()
    assert _free(d) - before == pending
    assert d.policy.num_device_blocks_pending_release() == 0


def test_pending_release_counts_parked_pages_waiting_for_their_copy():
    """A request preempted while its mirror is in flight keeps its pages pinned; the ack
    puts every written row on the host and releases them all."""
    d = Driver(make_policy())
    d.add("a")
    d.step({"a": 10}, ack=False)  # 3 pages (the last one half written), mirror in flight
    d.policy.preempt("a")
    assert d.policy.status("a") == RequestStatus.PARKED
    pending = d.policy.num_device_blocks_pending_release()
    assert pending == 3
    before = _free(d)
    d.ack_all()
    assert _free(d) - before == pending
    d.step({})  # any spill the ack queued
    d.ack_all()
    assert d.policy.num_device_blocks_pending_release() == 0


# -- non_full_rows -------------------------------------------------------------------------------
def test_non_full_rows_is_a_live_read_only_view():
    d = Driver(make_policy(num_device_blocks=40, low_watermark_blocks=30, high_watermark_blocks=32))
    view = d.policy.non_full_rows
    assert isinstance(view, Set) and len(view) == 0
    assert not hasattr(view, "add") and not hasattr(view, "discard")
    _demote_one(d)
    row = d.policy.row_of("a")
    assert row in view and set(view) == {row} and len(view) == 1  # same object, updated
    d.add("b")
    d.step({"b": 4})
    assert d.policy.row_of("b") not in view  # FULL
    d.policy.finish("a")
    assert row not in view and len(view) == 0
    grown = view | {5}  # set operations build new sets; the policy's rows are untouched
    assert 5 in grown and 5 not in d.policy.non_full_rows


# -- a request scheduled twice in one step ----------------------------------------------------------
@pytest.mark.parametrize("batched", [False, True])
def test_request_scheduled_twice_in_a_step_mirrors_each_page_once(batched):
    """Two ranges of one request on the same page in one step: the mirror carries the page
    twice, and its completion counts the page clean exactly once."""
    d = Driver(make_policy())
    d.add("a")
    d.add("b")
    d.step({"a": 1, "b": 1})
    policy = d.policy
    rows = np.array([policy.row_of("a"), policy.row_of("b")], dtype=np.int64)
    # "a": positions 1-2 then 3 (page 0 completes); "b": positions 1-2 then 3-5.
    if batched:
        policy.schedule_rows(rows, np.array([2, 2], dtype=np.int64))
    else:
        policy.schedule("a", 2)
        policy.schedule("b", 2)
    policy.schedule("a", 1)
    policy.schedule("b", 3)
    cmd = policy.build_step()
    (mirror,) = cmd.transfers
    assert sorted(zip(mirror.mirror_rows, mirror.mirror_starts, mirror.mirror_ends)) == sorted(
        [(rows[0], 1, 3), (rows[1], 1, 3), (rows[0], 3, 4), (rows[1], 3, 6)]
    )
    d.worker.run(cmd)
    d.check()
    d.ack_all()
    for rid, clean in (("a", [True]), ("b", [True, False])):
        table = policy.page_table(rid)
        assert table.host_valid.tolist() == clean
        assert policy.tables.num_clean_pinned[policy.row_of(rid)] == sum(clean)
    assert int(policy.tables.mirror_inflight.sum()) == 0
