"""P/D import into the host tier with the engine's tail blocks (``begin_import`` with
``tail_device_blocks``): the transfer writes every page to the host and the last pages to
the engine's device blocks too; ``finish_import`` activates the request at once, NONE.

Every story runs on the fake worker of ``core_harness``, which reads every written position
back through the worker's tables after each step.
"""

from __future__ import annotations

import numpy as np
import pytest

from core_harness import Driver, check_with_outside_leases, make_policy, tag
from vllm_hisparse.core import (
    ACTIVE_TAIL_PAGES,
    DevicePoolExhausted,
    Outcome,
    ProtocolError,
    RequestStatus,
    Residency,
)

BS = 4


def _land(d: Driver, rid: str, family: int, num_tokens: int):
    """What an engine does for a host landing: allocate the tail pages' device blocks
    (its own leases), begin the import, let the transfer write host rows and tail pages."""
    num_pages = -(-num_tokens // BS)
    tail = d.policy.device_pool.get_new_blocks(min(ACTIVE_TAIL_PAGES, num_pages))
    host = d.policy.begin_import(rid, num_tokens, tail_device_blocks=tail)
    first_tail = num_pages - len(tail)
    for page, block in enumerate(host):
        rows = [tag(family, page * BS + i) if page * BS + i < num_tokens else 0 for i in range(BS)]
        d.worker.host_mem[block] = rows
        if page >= first_tail:
            d.worker.device_mem[tail[page - first_tail]] = rows
    return host, tail


def test_import_lands_in_host_and_engine_tail_and_decodes():
    # No pressure, and no promotion (free blocks never reach the high watermark).
    d = Driver(make_policy(num_device_blocks=32, low_watermark_blocks=0, high_watermark_blocks=33))
    d.add("imp", family=5)
    free_before = d.policy.device_pool.get_num_free_blocks()
    host, tail = _land(d, "imp", 5, 21)  # 6 pages, the last one partial
    assert d.policy.status("imp") == RequestStatus.IMPORTING
    assert d.policy.residency("imp") == Residency.NONE
    assert len(d.policy.hot_block_ids("imp")) == 2  # leased at begin: activation cannot wait
    assert d.policy.device_pool.get_num_free_blocks() == free_before - 2 - len(tail)
    d.check()
    assert d.policy.finish_import("imp", success=True) == Outcome.OK
    assert d.policy.is_ready("imp") and d.policy.residency("imp") == Residency.NONE
    table = d.policy.page_table("imp")
    assert table.pinned.tolist() == [False] * 4 + [True] * 2
    assert table.host_valid.tolist() == [True] * 5 + [False]  # page 5 holds 1 of 4 rows
    d.flush()  # page updates reach the worker: every position reads back (check_data)
    assert d.worker.residency[d.policy.row_of("imp"), :6].tolist() == [-1] * 4 + tail
    for _ in range(9):  # decode across two page boundaries: tail moves, old tail released
        d.step({"imp": 1})
    table = d.policy.page_table("imp")
    assert d.policy.residency("imp") == Residency.NONE
    assert table.pinned.tolist() == [False] * 6 + [True] * ACTIVE_TAIL_PAGES
    d.policy.finish("imp")
    d.flush()
    assert d.policy.is_idle()
    assert d.policy.device_pool.get_num_free_blocks() == 32
    assert (d.policy.host_pool.ref_counts == 0).all()


def test_failed_import_returns_host_and_hot_and_leaves_the_tail_to_the_engine():
    d = Driver(make_policy(num_device_blocks=16, low_watermark_blocks=0, high_watermark_blocks=0))
    d.add("imp", family=3)
    free_host = d.policy.host_pool.num_allocatable_blocks
    _, tail = _land(d, "imp", 3, 12)
    assert d.policy.finish_import("imp", success=False) == Outcome.RECOMPUTE
    assert d.policy.status("imp") == RequestStatus.ACTIVE
    assert d.policy.residency("imp") == Residency.FULL and d.policy.hot_block_ids("imp") == []
    assert d.policy.host_pool.num_allocatable_blocks == free_host
    check_with_outside_leases(d.policy, tail)
    # The engine still owns the tail blocks it allocated (exactly one lease each) ...
    assert [int(d.policy.device_pool.ref_counts[b]) for b in tail] == [1, 1]
    d.policy.device_pool.free_blocks(tail)
    # ... and the request restarts from zero tokens, computed as usual.
    d.step({"imp": 12})
    d.policy.finish("imp")
    d.flush()
    assert d.policy.device_pool.get_num_free_blocks() == 16


def test_request_ended_while_importing_returns_every_lease_once():
    d = Driver(make_policy(num_device_blocks=16, low_watermark_blocks=0, high_watermark_blocks=0))
    d.add("imp", family=2)
    _land(d, "imp", 2, 30)
    d.policy.abort("imp")
    d.flush()
    assert d.policy.is_idle()
    assert d.policy.device_pool.get_num_free_blocks() == 16  # tail and hot returned
    assert (d.policy.host_pool.ref_counts == 0).all()


def test_no_room_for_the_hot_region_changes_nothing():
    d = Driver(make_policy(num_device_blocks=4, low_watermark_blocks=0, high_watermark_blocks=0))
    d.add("imp")
    tail = d.policy.device_pool.get_new_blocks(2)
    hog = d.policy.device_pool.get_new_blocks(1)  # 1 free, the hot region needs 2
    free_host = d.policy.host_pool.num_allocatable_blocks
    with pytest.raises(DevicePoolExhausted):
        d.policy.begin_import("imp", 16, tail_device_blocks=tail)
    assert d.policy.status("imp") == RequestStatus.ACTIVE
    assert d.policy.host_pool.num_allocatable_blocks == free_host
    assert int(d.policy.tables.num_pages[d.policy.row_of("imp")]) == 0
    check_with_outside_leases(d.policy, tail + hog)


@pytest.mark.parametrize("num_tokens,num_tail", [(16, 1), (16, 3), (3, 2)])
def test_tail_of_the_wrong_length_is_a_protocol_error(num_tokens, num_tail):
    d = Driver(make_policy())
    d.add("imp")
    tail = d.policy.device_pool.get_new_blocks(num_tail)
    with pytest.raises(ProtocolError, match="tail device blocks"):
        d.policy.begin_import("imp", num_tokens, tail_device_blocks=tail)
    assert d.policy.status("imp") == RequestStatus.ACTIVE
    assert np.all(d.policy.tables.host_block[d.policy.row_of("imp")] < 0)


def test_one_page_import_has_a_one_page_tail():
    d = Driver(make_policy(low_watermark_blocks=0, high_watermark_blocks=0))
    d.add("imp", family=4)
    _, tail = _land(d, "imp", 4, 3)
    assert len(tail) == 1
    assert d.policy.finish_import("imp", success=True) == Outcome.OK
    d.flush()
    for _ in range(6):
        d.step({"imp": 1})
    d.policy.finish("imp")
    d.flush()
    assert d.policy.is_idle()
