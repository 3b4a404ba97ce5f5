"""Adaptive hot regions (``core/hot_regions.py``): the worker's per-row miss counts resize a
MIXED/NONE request's hot lease in the step command (grow from free blocks, never under
pressure; shrink gives blocks back), within the sizing bounds, with the invariants held."""

from __future__ import annotations

import pytest

from core_harness import Driver, make_policy
from vllm_hisparse.core import Residency
from vllm_hisparse.core.hot_sizing import HotSizingConfig


def _mixed_driver(**sizing) -> tuple[Driver, int]:
    """Request "a" MIXED with a 2-block hot region; watermarks that neither demote nor
    promote afterwards (free blocks between low and high)."""
    cfg = dict(block_size=4, min_blocks=1, max_blocks=4, target_miss_rate=0.1, window_steps=2)
    cfg.update(sizing)
    d = Driver(make_policy(num_device_blocks=64, hot_blocks=2, hot_sizing=HotSizingConfig(**cfg)))
    d.add("a")
    d.step({"a": 30})
    d.step({"a": 1})
    d.policy.low_watermark_blocks = d.policy.high_watermark_blocks = 62
    d.step({"a": 1})
    assert d.policy.residency("a") == Residency.MIXED
    d.policy.low_watermark_blocks, d.policy.high_watermark_blocks = 4, 63
    return d, d.policy.row_of("a")


def _window(d: Driver, row: int, misses: int, references: int):
    """One sizing window (2 steps) of counts; returns the second step's hot resizes."""
    d.policy.observe_hot_counts({row: (misses, references)})
    d.step({"a": 1})
    d.policy.observe_hot_counts({row: (misses, references)})
    cmd = d.step({"a": 1})
    return [lease for lease in cmd.hot_leases if lease.resize]


def test_grow_takes_free_blocks_and_keeps_the_old_blocks_first():
    d, row = _mixed_driver()
    old = d.policy.hot_block_ids("a")
    free = d.policy.device_pool.get_num_free_blocks()
    resizes = _window(d, row, 50, 100)
    new = d.policy.hot_block_ids("a")
    assert len(new) == 4 and new[:2] == old
    assert [(r.row, r.block_ids) for r in resizes] == [(row, new)]
    assert d.policy.device_pool.get_num_free_blocks() == free - 2
    assert d.policy.stats.num_hot_grows == 1
    d.policy.check_invariants()


def test_no_grow_under_pressure_or_below_the_low_watermark():
    d, row = _mixed_driver()
    free = d.policy.device_pool.get_num_free_blocks()
    # A grow of 2 would leave free - 2 < low: refused, size kept.
    d.policy.low_watermark_blocks = free - 1
    assert _window(d, row, 50, 100) == []
    assert len(d.policy.hot_block_ids("a")) == 2
    # Unmet demand this step is pressure: the sizer may not grow either.
    d.policy.low_watermark_blocks = 4
    d.policy.observe_hot_counts({row: (50, 100)})
    d.step({"a": 1})
    d.policy.observe_hot_counts({row: (50, 100)})
    d.policy.schedule("a", 1)
    d.policy.note_device_demand(1)
    cmd = d.policy.build_step()
    d.worker.run(cmd)
    d.ack_all()
    assert not [lease for lease in cmd.hot_leases if lease.resize]
    assert len(d.policy.hot_block_ids("a")) == 2
    assert d.policy.stats.num_hot_grows == 0


def test_shrink_returns_the_last_blocks_to_the_pool():
    d, row = _mixed_driver()
    old = d.policy.hot_block_ids("a")
    free = d.policy.device_pool.get_num_free_blocks()
    resizes = _window(d, row, 0, 100)
    assert d.policy.hot_block_ids("a") == old[:1]
    assert [(r.row, r.block_ids) for r in resizes] == [(row, old[:1])]
    assert d.policy.device_pool.get_num_free_blocks() == free + 1
    assert d.policy.device_pool.is_free(old[1])
    assert d.policy.stats.num_hot_shrinks == 1
    d.policy.check_invariants()


def test_size_stays_within_the_bounds():
    d, row = _mixed_driver(min_blocks=1, max_blocks=4)
    for _ in range(4):
        _window(d, row, 0, 100)
    assert len(d.policy.hot_block_ids("a")) == 1  # min_blocks
    for _ in range(5):
        _window(d, row, 90, 100)
    assert len(d.policy.hot_block_ids("a")) == 4  # max_blocks
    assert d.policy.stats.num_hot_grows == 2  # 1 -> 3 -> 4, then no change
    d.policy.check_invariants()


def test_finish_returns_a_resized_lease_without_leaks():
    d, row = _mixed_driver()
    _window(d, row, 50, 100)
    d.policy.finish("a")
    d.flush()
    d.ack_all()
    assert d.policy.is_idle()
    assert d.policy.device_pool.get_num_free_blocks() == 64
    d.policy.check_invariants()


def test_counts_of_full_requests_are_dropped_and_bad_counts_raise():
    d = Driver(make_policy(hot_sizing=HotSizingConfig(block_size=4, min_blocks=1, max_blocks=4,
                                                       target_miss_rate=0.1, window_steps=1)))
    d.add("a")
    d.step({"a": 8})
    d.policy.observe_hot_counts({d.policy.row_of("a"): (9, 10)})
    cmd = d.step({"a": 1})
    assert not cmd.hot_leases and d.policy.residency("a") == Residency.FULL
    with pytest.raises(ValueError, match="misses"):
        d.policy.observe_hot_counts({0: (3, 2)})
    with pytest.raises(ValueError, match="state row"):
        d.policy.observe_hot_counts({99: (0, 1)})


def test_without_sizing_counts_change_nothing():
    d = Driver(make_policy(num_device_blocks=64))
    d.add("a")
    d.step({"a": 30})
    d.policy.low_watermark_blocks = d.policy.high_watermark_blocks = 62
    d.step({"a": 1})
    assert d.policy.residency("a") == Residency.MIXED
    old = d.policy.hot_block_ids("a")
    for _ in range(3):
        d.policy.observe_hot_counts({d.policy.row_of("a"): (99, 100)})
        d.step({"a": 1})
    assert d.policy.hot_block_ids("a") == old
