"""The policy's row queries (``serial_at``, ``serials_at``, ``num_tokens_at``,
``num_pages_at``, ``host_blocks_at``): what the engine reads by state row, checked after
admission, growth, demotion, preemption, import and the end of a request against numbers
known from the story and against the page tables."""

from __future__ import annotations

import numpy as np
import pytest

from core_harness import Driver, make_policy
from vllm_hisparse.core import Outcome, Residency

BS = 4  # make_policy's block size


def _rows(*rows: int) -> np.ndarray:
    return np.array(rows, dtype=np.int64)


def _assert_agrees_with_tables(policy, rows: np.ndarray) -> None:
    t = policy.tables
    assert np.array_equal(policy.serials_at(rows), t.serial[rows])
    assert np.array_equal(policy.num_tokens_at(rows), t.num_tokens[rows])
    for row in rows.tolist():
        assert policy.serial_at(row) == int(t.serial[row])
        assert policy.num_pages_at(row) == int(t.num_pages[row])
        assert np.array_equal(policy.host_blocks_at(row, 0, t.max_pages), t.host_block[row])


def test_free_rows_read_as_empty():
    policy = make_policy(max_num_rows=4, max_pages=8)
    rows = _rows(0, 1, 2, 3)
    assert policy.serials_at(rows).tolist() == [0, 0, 0, 0]
    assert policy.num_tokens_at(rows).tolist() == [0, 0, 0, 0]
    assert [policy.num_pages_at(r) for r in range(4)] == [0, 0, 0, 0]
    assert policy.host_blocks_at(2, 0, 8).tolist() == [-1] * 8
    _assert_agrees_with_tables(policy, rows)


def test_admission_and_growth():
    d = Driver(make_policy())
    a, b = d.add("a").row, d.add("b").row
    rows = _rows(a, b)
    serials = d.policy.serials_at(rows)
    assert serials.dtype == np.int64 and serials.shape == (2,)
    assert serials.tolist() == [d.policy.serial_of("a"), d.policy.serial_of("b")]
    assert 0 not in serials.tolist() and serials[0] != serials[1]
    assert d.policy.num_tokens_at(rows).tolist() == [0, 0]

    d.step({"a": 10, "b": 5})  # 3 and 2 pages of 4 positions
    tokens = d.policy.num_tokens_at(rows)
    assert tokens.dtype == np.int64 and tokens.tolist() == [10, 5]
    assert (d.policy.num_pages_at(a), d.policy.num_pages_at(b)) == (3, 2)
    host_a = d.policy.host_blocks_at(a, 0, 3)
    assert host_a.dtype == np.int32 and host_a.shape == (3,)
    assert host_a.tolist() == d.policy.page_table("a").host_blocks.tolist()
    assert (host_a >= 0).all() and len(set(host_a.tolist())) == 3
    assert d.policy.host_blocks_at(a, 1, 5).tolist() == host_a[1:].tolist() + [-1, -1]
    assert d.policy.host_blocks_at(a, 2, 2).shape == (0,)
    assert not set(host_a.tolist()) & set(d.policy.host_blocks_at(b, 0, 2).tolist())

    # The batched path: "a" stays in its last page, "b" crosses into a third.
    d.policy.schedule_rows(rows, _rows(2, 4))
    assert d.policy.num_tokens_at(rows).tolist() == [12, 9]
    assert (d.policy.num_pages_at(a), d.policy.num_pages_at(b)) == (3, 3)
    assert d.policy.host_blocks_at(b, 2, 3)[0] >= 0
    assert d.policy.serials_at(rows).tolist() == serials.tolist()  # growth keeps the incarnation
    _assert_agrees_with_tables(d.policy, rows)


def test_answers_are_copies():
    d = Driver(make_policy())
    row = d.add("a").row
    d.step({"a": 9})
    rows = _rows(row)
    tokens, serials = d.policy.num_tokens_at(rows), d.policy.serials_at(rows)
    host = d.policy.host_blocks_at(row, 0, 3)
    kept_host = host.tolist()
    tokens[0], serials[0], host[:] = 99, 99, 7  # the caller's arrays, not the tables
    assert d.policy.num_tokens_at(rows).tolist() == [9]
    assert d.policy.serial_at(row) == d.policy.serial_of("a")
    assert d.policy.host_blocks_at(row, 0, 3).tolist() == kept_host
    d.policy.check_invariants()
    before = d.policy.num_tokens_at(rows)
    d.step({"a": 4})
    assert before.tolist() == [9] and d.policy.num_tokens_at(rows).tolist() == [13]


def test_demotion_and_preemption_keep_length_pages_and_host_blocks():
    d = Driver(make_policy(num_device_blocks=40, low_watermark_blocks=30, high_watermark_blocks=32))
    row = d.add("a").row
    d.step({"a": 30})  # 8 pages
    d.step({"a": 1})
    host = d.policy.host_blocks_at(row, 0, 8).tolist()
    serial = d.policy.serial_at(row)
    d.policy.low_watermark_blocks = d.policy.high_watermark_blocks = 40  # pressure from now on
    d.step({"a": 1})
    assert d.policy.residency("a") == Residency.MIXED
    assert d.policy.num_tokens_at(_rows(row)).tolist() == [32]
    assert d.policy.num_pages_at(row) == 8
    assert d.policy.host_blocks_at(row, 0, 8).tolist() == host
    assert d.policy.serial_at(row) == serial
    d.policy.preempt("a")
    assert d.policy.num_tokens_at(_rows(row)).tolist() == [32]
    assert d.policy.num_pages_at(row) == 8 and d.policy.host_blocks_at(row, 0, 8).tolist() == host
    assert d.policy.serial_at(row) == serial
    _assert_agrees_with_tables(d.policy, _rows(row))


def test_import_reads_its_host_blocks():
    d = Driver(make_policy())
    row = d.add("imp").row
    host = d.policy.begin_import("imp", 21)  # 6 pages, the last one partial
    assert d.policy.num_tokens_at(_rows(row)).tolist() == [21]
    assert d.policy.num_pages_at(row) == 6
    assert d.policy.host_blocks_at(row, 0, 6).tolist() == list(host)
    assert d.policy.host_blocks_at(row, 6, 7).tolist() == [-1]
    assert d.policy.finish_import("imp", success=False) == Outcome.RECOMPUTE
    assert d.policy.num_pages_at(row) == 0 and d.policy.host_blocks_at(row, 0, 6).tolist() == [-1] * 6


def test_an_ended_request_frees_its_row_and_a_new_one_gets_a_new_serial():
    d = Driver(make_policy())
    a, b = d.add("a").row, d.add("b").row
    d.step({"a": 6, "b": 3})
    kept = (a, d.policy.serial_at(a))  # what an engine keeps across steps
    d.policy.finish("a")
    assert d.policy.serial_at(a) == 0 != kept[1]
    assert d.policy.num_tokens_at(_rows(a, b)).tolist() == [0, 3]
    assert d.policy.num_pages_at(a) == 0
    assert d.policy.host_blocks_at(a, 0, 2).tolist() == [-1, -1]
    again = d.add("c", state_row=a).row
    assert again == a and d.policy.serial_at(a) == d.policy.serial_of("c")
    assert d.policy.serial_at(a) not in (0, kept[1], d.policy.serial_at(b))
    _assert_agrees_with_tables(d.policy, _rows(a, b))


@pytest.mark.parametrize("first,end", [(-1, 2), (3, 2), (0, 33)])
def test_host_blocks_at_rejects_a_page_range_outside_the_table(first, end):
    policy = make_policy(max_pages=32)
    row = policy.add_request("a").row
    with pytest.raises(ValueError, match="outside"):
        policy.host_blocks_at(row, first, end)
