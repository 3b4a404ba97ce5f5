"""Scenario tests for the residency policy: one story per transition and event.

Every story runs against the fake worker (``core_harness``), which checks after each step
that every written position reads back its own KV through the worker's tables.
"""

from __future__ import annotations

import numpy as np
import pytest

from core_harness import Driver, make_policy, tag
from vllm_hisparse.core import (
    ACTIVE_TAIL_PAGES,
    HostPoolExhausted,
    Outcome,
    ProtocolError,
    RequestStatus,
    Residency,
    TransferKind,
    WorkerAcks,
)

BS = 4  # tokens per page in these stories


def decode(d: Driver, ids, steps: int, ack: bool = True):
    for _ in range(steps):
        d.step({r: 1 for r in ids}, ack=ack)


# -- FULL: no pressure, no I/O beyond the mirror ----------------------------------------------
def test_full_request_stays_full_and_its_pages_become_clean():
    """One request, plenty of blocks: it stays FULL, every sealed page becomes host-valid,
    nothing is released and no hot region is leased."""
    d = Driver(make_policy(num_device_blocks=64))
    d.add("a")
    d.step({"a": 10})
    decode(d, ["a"], 6)
    table = d.policy.page_table("a")
    assert d.policy.residency("a") == Residency.FULL
    assert table.pinned.all() and not table.released.any()
    assert table.host_valid.tolist() == [True, True, True, True]  # 16 tokens, 4 sealed pages
    assert d.policy.hot_block_ids("a") == []
    assert d.policy.stats.num_demotions == 0


# -- FULL → MIXED under pressure: selection rule ------------------------------------------------
def test_pressure_demotes_only_the_requests_it_needs_most_reclaimable_first():
    """Four requests of different lengths fill the pool under the low watermark. The policy
    flips only the longest (most reclaimable pages per hot block) until the deficit is covered,
    not every request."""
    d = Driver(make_policy(num_device_blocks=40, low_watermark_blocks=6, high_watermark_blocks=8, hot_blocks=2))
    lengths = {"long": 64, "mid": 40, "short1": 12, "short2": 12}
    for rid in lengths:
        d.add(rid)
    d.step({rid: n for rid, n in lengths.items()})  # 16+10+3+3 = 32 pages, free = 8
    assert d.policy.device_pool.get_num_free_blocks() == 8
    d.step({rid: 1 for rid in lengths})  # 4 new pages -> free 4 < low 6: pressure
    res = {rid: d.policy.residency(rid) for rid in lengths}
    assert res["long"] == Residency.MIXED
    assert res["short1"] == res["short2"] == Residency.FULL  # never worth a hot region
    assert sum(r == Residency.MIXED for r in res.values()) < len(lengths)
    assert d.policy.device_pool.get_num_free_blocks() >= d.policy.high_watermark_blocks
    assert d.policy.stats.num_demotions == 1


def test_mixed_request_releases_clean_pages_but_never_its_tail():
    """After demotion, clean non-tail pages are released (still readable) and the last
    ACTIVE_TAIL_PAGES pages stay pinned while it keeps decoding."""
    d = Driver(make_policy(num_device_blocks=40, low_watermark_blocks=30, high_watermark_blocks=32))
    d.add("a")
    d.step({"a": 30})  # 8 pages, free 32 -> no pressure yet
    d.step({"a": 1})  # mirror of prefill completed last step; now 31 < low? free=32 -> still fine
    d.policy.low_watermark_blocks = 40  # force pressure from now on
    d.policy.high_watermark_blocks = 40
    d.step({"a": 1})
    assert d.policy.residency("a") == Residency.MIXED
    table = d.policy.page_table("a")
    n = len(table.pinned)
    assert table.pinned[-ACTIVE_TAIL_PAGES:].all()
    assert table.released[: n - ACTIVE_TAIL_PAGES].all()  # all clean, all released
    assert (table.device_blocks >= 0).all()  # released pages are still readable
    decode(d, ["a"], 8)  # pages that leave the tail get released as they become clean
    table = d.policy.page_table("a")
    assert table.pinned[-ACTIVE_TAIL_PAGES:].all()
    assert not table.pinned[: len(table.pinned) - ACTIVE_TAIL_PAGES].any()


def test_released_page_is_readable_until_reused_then_read_from_host():
    """A released page keeps its device block in the worker's table; when another request
    takes the block, the same command points the page at the host copy (data checked)."""
    d = Driver(make_policy(num_device_blocks=16, low_watermark_blocks=16, high_watermark_blocks=16,
                           hot_blocks=1))
    d.add("a", family=1)
    d.step({"a": 24})  # 6 pages
    d.step({"a": 4})  # 7 pages; pressure -> MIXED, 5 clean non-tail pages released (readable)
    assert d.policy.residency("a") == Residency.MIXED
    released = d.policy.page_table("a").released
    assert released.sum() == 5
    d.add("b", family=2)
    d.step({"b": 40})  # 10 pages: 8 never-used blocks, then released blocks of "a"
    table = d.policy.page_table("a")
    assert d.policy.stats.num_pages_reused >= 1
    assert (table.device_blocks[:5] == -1).sum() == d.policy.stats.num_pages_reused
    row = d.policy.row_of("a")
    assert (d.worker.residency[row, :5] == table.device_blocks[:5]).all()


# -- MIXED → FULL (hysteresis) --------------------------------------------------------------------
def test_mixed_request_goes_back_to_full_when_pressure_is_gone():
    """Pressure passes (another request finishes): the MIXED request re-pins its unreused
    pages without a copy, restores the reused ones, returns its hot lease and is FULL again."""
    d = Driver(make_policy(num_device_blocks=24, low_watermark_blocks=4, high_watermark_blocks=6, hot_blocks=1))
    d.add("a", family=1)
    d.add("b", family=2)
    d.step({"a": 40, "b": 28})  # 10 + 7 pages, free 7
    d.step({"a": 1, "b": 1})  # 2 more pages -> free 5 ... still above low
    d.step({"a": 4, "b": 4})  # 2 more pages -> free 3 < low: "a" (most reclaimable) flips
    assert d.policy.residency("a") == Residency.MIXED
    assert d.policy.residency("b") == Residency.FULL
    d.policy.finish("b")
    d.step({"a": 1})
    assert d.policy.residency("a") == Residency.FULL or d.policy.stats.num_promotions == 1
    d.step({"a": 1})  # restores (if any) completed and acked
    d.step({"a": 1})
    assert d.policy.residency("a") == Residency.FULL
    assert d.policy.hot_block_ids("a") == []
    assert d.policy.page_table("a").pinned.all()
    assert d.policy.stats.num_promotions == 1 and d.policy.stats.num_pages_repinned > 0


def test_no_promotion_inside_the_hysteresis_band():
    """Free blocks between the watermarks: a MIXED request stays MIXED (no flapping)."""
    d = Driver(make_policy(num_device_blocks=30, low_watermark_blocks=4, high_watermark_blocks=20, hot_blocks=1))
    d.add("a")
    d.step({"a": 100})  # 25 pages, free 5
    d.step({"a": 4})  # free 4 - 1 = 4 -> wait: 26 pages, free 4: not under low
    d.step({"a": 4})  # 27 pages, free 3 < low -> MIXED, releases to >= high
    assert d.policy.residency("a") == Residency.MIXED
    free = d.policy.device_pool.get_num_free_blocks()
    assert free >= d.policy.high_watermark_blocks
    decode(d, ["a"], 12)
    # Promotion would need every page back (cost ~ 25 blocks): free - cost < high, so no.
    assert d.policy.residency("a") == Residency.MIXED
    assert d.policy.stats.num_promotions == 0


def test_chunked_prefill_outgrowing_admission_window_is_demoted_without_pressure():
    """A FULL request whose chunked prefill exceeds the admission window goes MIXED even
    though the pool is nearly empty."""
    # A long cooldown keeps the story on the window rule (no promotion back right away).
    d = Driver(make_policy(num_device_blocks=64, admission_window_pages=6, hot_blocks=1,
                           min_steps_between_transitions=100))
    d.add("p")
    d.step({"p": 16})  # 4 pages
    d.step({"p": 16})  # 8 pages > window 6
    assert d.policy.residency("p") == Residency.MIXED
    assert d.policy.device_pool.get_num_free_blocks() > d.policy.low_watermark_blocks
    d.step({"p": 8})
    assert d.policy.page_table("p").released.any()


# -- transactions ------------------------------------------------------------------------------
def test_spill_is_two_phase_source_pinned_until_enqueued_host_valid_when_completed():
    """Without eager mirroring a sealed page is spilled: planned (source and destination
    pinned), enqueued (source lease dropped), completed (host valid, prefix published)."""
    d = Driver(make_policy(eager_host_mirror=False))
    d.add("a", family=3, num_hashed_pages=1)
    cmd = d.step({"a": 4}, ack=False)  # page 0 sealed by this forward
    (spill,) = cmd.transfers
    assert spill.kind == TransferKind.SPILL and spill.after_forward
    dev, host = spill.device_blocks[0], spill.host_blocks[0]
    pool, hpool = d.policy.device_pool, d.policy.host_pool
    assert pool.ref_counts[dev] == 2 and hpool.ref_counts[host] == 2  # page + transfer
    assert d.policy.page_table("a").pending[0] == spill.transfer_id
    d.policy.apply_acks(d.worker.ack(enqueue_only=True))
    assert pool.ref_counts[dev] == 1 and not d.policy.page_table("a").host_valid[0]
    assert d.policy.lookup_host_prefix([("fam", 3, 0)]) == 0  # not durable: not published
    d.ack_all()
    assert pool.ref_counts[dev] == 1 and hpool.ref_counts[host] == 1
    assert d.policy.page_table("a").host_valid[0]
    assert d.policy.lookup_host_prefix([("fam", 3, 0)]) == 1


def test_failed_spill_keeps_the_resident_copy_and_is_retried():
    """A spill reported failed marks nothing valid; the page stays pinned and is spilled again."""
    d = Driver(make_policy(eager_host_mirror=False))
    d.add("a")
    cmd = d.step({"a": 4}, ack=False)
    tid = cmd.transfers[0].transfer_id
    d.step({}, ack=False, fail_ids=frozenset())
    d.worker.launched[tid].will_fail = True
    d.ack_all()
    table = d.policy.page_table("a")
    assert not table.host_valid[0] and table.pinned[0] and table.pending[0] == -1
    assert d.policy.stats.num_failed_transfers == 1
    retry = d.step({})
    assert [t.kind for t in retry.transfers] == [TransferKind.SPILL]
    assert d.policy.page_table("a").host_valid[0]


def test_failed_mirror_falls_back_to_a_whole_page_spill():
    """Rows of a failed mirror never count as on-host; once the page is sealed it is spilled."""
    d = Driver(make_policy())
    d.add("a")
    cmd = d.step({"a": 2}, ack=False, fail_ids=frozenset({1}))
    assert cmd.transfers[0].kind == TransferKind.MIRROR
    d.ack_all()
    d.step({"a": 2})  # seals page 0: its mirror covers rows 2-3 only
    assert not d.policy.page_table("a").host_valid[0]
    cmd = d.step({"a": 1})
    assert TransferKind.SPILL in [t.kind for t in cmd.transfers]
    assert d.policy.page_table("a").host_valid[0]


def test_acks_out_of_order_and_protocol_errors():
    """Completions may arrive in any order and without 'enqueued'; unknown or repeated ids
    are caller bugs and raise."""
    d = Driver(make_policy())
    d.add("a")
    first = d.step({"a": 4}, ack=False).transfers[0].transfer_id
    second = d.step({"a": 4}, ack=False).transfers[0].transfer_id
    d.policy.apply_acks(d.worker.ack([second]))
    d.policy.apply_acks(d.worker.ack([first]))
    assert d.policy.page_table("a").host_valid.tolist() == [True, True]
    with pytest.raises(ProtocolError):
        d.policy.apply_acks(WorkerAcks(completed=[first]))
    with pytest.raises(ProtocolError):
        d.policy.apply_acks(WorkerAcks(enqueued=[12345]))



def test_a_bad_ack_batch_is_applied_not_at_all():
    """A batch whose last id is unknown (or whose enqueued ids repeat) raises
    ProtocolError before any of it is applied: the valid completion ahead of the bad id
    stays open and can be applied afterwards."""
    d = Driver(make_policy())
    d.add("a")
    mirror = d.step({"a": 4}, ack=False).transfers[0].transfer_id
    host_before = d.policy.host_pool.ref_counts.copy()
    with pytest.raises(ProtocolError, match="12345"):
        d.policy.apply_acks(WorkerAcks(completed=[mirror, 12345]))
    assert d.policy.num_open_transfers == 1
    assert d.policy.page_table("a").host_valid.tolist() == [False]
    with pytest.raises(ProtocolError, match="enqueued twice"):
        d.policy.apply_acks(WorkerAcks(enqueued=[mirror, mirror]))
    with pytest.raises(ProtocolError, match="already finished"):
        d.policy.apply_acks(WorkerAcks(completed=[mirror], failed=[mirror]))
    assert d.policy.num_open_transfers == 1
    assert d.policy.page_table("a").host_valid.tolist() == [False]
    assert np.array_equal(d.policy.host_pool.ref_counts, host_before)
    d.check()
    d.policy.apply_acks(d.worker.ack([mirror]))
    assert d.policy.num_open_transfers == 0
    assert d.policy.page_table("a").host_valid.tolist() == [True]
    d.check()

# -- request events ------------------------------------------------------------------------------
def test_preempt_releases_hot_lease_keeps_host_pages_and_resume_needs_no_recompute():
    """A MIXED request is preempted: hot lease and device pages go back, host pages stay.
    Resumed, it is NONE with a resident tail and a fresh hot region, and reads its own KV."""
    d = Driver(make_policy(num_device_blocks=24, low_watermark_blocks=8, high_watermark_blocks=10, hot_blocks=2))
    d.add("a", family=5)
    d.step({"a": 60})  # 15 pages, free 9
    d.step({"a": 5})  # 17 pages, free 7 < low 8 -> MIXED
    assert d.policy.residency("a") == Residency.MIXED
    free_before = d.policy.device_pool.get_num_free_blocks()
    d.policy.preempt("a")
    d.flush()
    assert d.policy.status("a") == RequestStatus.PARKED and d.policy.hot_block_ids("a") == []
    assert d.policy.page_table("a").pinned.sum() == 0  # everything is on host
    assert d.policy.device_pool.get_num_free_blocks() > free_before
    assert (d.policy.page_table("a").host_blocks >= 0).all()
    out = d.policy.resume("a")
    assert out in (Outcome.OK, Outcome.WAIT_TRANSFER)
    d.flush()
    assert d.policy.residency("a") == Residency.NONE and d.policy.is_ready("a")
    assert len(d.policy.hot_block_ids("a")) == 2
    assert d.policy.page_table("a").pinned[-ACTIVE_TAIL_PAGES:].all()
    decode(d, ["a"], 5)
    assert d.policy.tables.num_tokens[d.policy.row_of("a")] == 70  # continued, not recomputed


def test_preempt_with_dirty_pages_spills_them_before_releasing():
    """Pages not yet on host at preemption stay pinned until a spill of their written rows
    completes; only then are they released."""
    d = Driver(make_policy(eager_host_mirror=False))
    d.add("a", family=2)
    d.step({"a": 6})  # page 0 sealed (spilled), page 1 half written (dirty)
    d.policy.preempt("a")
    assert d.policy.page_table("a").pinned.tolist() == [False, True]
    cmd = d.flush()  # spill of the partial page
    assert [t.kind for t in cmd.transfers] == [TransferKind.SPILL]
    assert not d.policy.page_table("a").pinned.any()
    assert d.policy.resume("a") == Outcome.OK  # both tail pages re-pinned, no copy needed
    d.flush()
    d.step({"a": 2})
    assert d.policy.page_table("a").host_valid.tolist() == [True, True]


def test_finish_publishes_and_a_new_request_hits_host_prefix():
    """A finished request's clean pages stay in the host pool; a new request with the same
    prefix takes them over, starts NONE with restored tail pages and reads the right KV."""
    d = Driver(make_policy())
    d.add("first", family=7, num_hashed_pages=3)
    d.step({"first": 13})
    d.step({"first": 1})
    d.policy.finish("first")
    d.flush()
    assert d.policy.lookup_host_prefix([("fam", 7, i) for i in range(3)]) == 3
    result = d.add("second", family=7, num_hashed_pages=3)
    assert result.num_host_hit_tokens == 12
    assert d.policy.residency("second") == Residency.NONE
    assert result.outcome == Outcome.WAIT_TRANSFER  # tail restores in flight
    assert d.policy.stats.num_host_prefix_hit_pages == 3
    d.flush()
    assert d.policy.is_ready("second")
    decode(d, ["second"], 4)


def test_abort_with_spill_in_flight_publishes_on_completion_and_pools_return_to_rest():
    """Abort while a spill is in flight: the transfer keeps its leases, publishes the page
    when it completes, and then both pools are back at rest."""
    d = Driver(make_policy(eager_host_mirror=False))
    d.add("a", family=4, num_hashed_pages=1)
    d.step({"a": 4}, ack=False)
    d.policy.abort("a")
    assert d.policy.lookup_host_prefix([("fam", 4, 0)]) == 0
    assert d.policy.device_pool.get_num_free_blocks() < d.policy.device_pool.num_blocks  # transfer lease
    d.ack_all()
    d.flush()
    assert d.policy.lookup_host_prefix([("fam", 4, 0)]) == 1
    assert d.policy.is_idle()
    assert np.all(d.policy.device_pool.ref_counts == 0)
    assert np.all(d.policy.host_pool.ref_counts == 0)


def test_regression_partial_spill_of_ended_request_is_never_published():
    """Bug found by the state machine: a preempted request spills its half-written page,
    resumes, seals it, finishes while the partial spill is in flight; the partial copy was
    published as if it held the whole page. Only whole-page copies may be published."""
    d = Driver(make_policy(eager_host_mirror=False))
    d.add("a", family=1, num_hashed_pages=2)
    d.step({"a": 6})
    d.policy.preempt("a")
    d.step({}, ack=False)  # partial spill of page 1 planned and launched, not reported
    assert d.policy.resume("a") == Outcome.OK
    d.step({"a": 2}, ack=False)  # page 1 sealed
    d.policy.finish("a")
    d.ack_all()
    d.flush()
    assert d.policy.lookup_host_prefix([("fam", 1, 0), ("fam", 1, 1)]) == 1


def test_import_from_host_success_and_failure():
    """P/D import: host blocks are handed out, written externally, then the request is
    activated NONE. A failed import returns the blocks and asks for recomputation."""
    d = Driver(make_policy())
    d.add("imp", family=9)
    blocks = d.policy.begin_import("imp", 10)
    assert len(blocks) == 3 and d.policy.status("imp") == RequestStatus.IMPORTING
    for page, block in enumerate(blocks):
        d.worker.host_mem[block] = [tag(9, page * BS + i) for i in range(BS)]
    out = d.policy.finish_import("imp", success=True)
    assert out == Outcome.WAIT_TRANSFER and d.policy.residency("imp") == Residency.NONE
    d.flush()
    assert d.policy.is_ready("imp")
    decode(d, ["imp"], 3)
    d.add("bad", family=8)
    free_host = d.policy.host_pool.num_allocatable_blocks
    d.policy.begin_import("bad", 8)
    assert d.policy.finish_import("bad", success=False) == Outcome.RECOMPUTE
    assert d.policy.host_pool.num_allocatable_blocks == free_host
    d.step({"bad": 8})  # computed from scratch


def test_host_pool_exhaustion_makes_the_request_wait_and_eviction_lets_it_continue():
    """A request that needs a host block when none is free waits (nothing changes); blocks
    cached by a finished request are evicted to let it go on."""
    d = Driver(make_policy(num_host_blocks=6))
    d.add("a", family=1, num_hashed_pages=2)
    d.step({"a": 8})
    d.step({"a": 1})
    d.add("b", family=2)
    d.step({"b": 8})  # host: a 3, b 2 -> 1 free
    assert d.step({"b": 12}) and d.last_outcomes["b"] == Outcome.WAIT_HOST  # needs 3, 1 free
    assert d.policy.tables.num_tokens[d.policy.row_of("b")] == 8
    assert d.policy.stats.num_host_backpressure == 1
    with pytest.raises(HostPoolExhausted):
        d.policy.begin_import(d.add("c").row and "c", 40)
    d.policy.finish("a")  # 2 pages published and cached, 1 freed
    d.step({"b": 12})
    assert d.last_outcomes["b"] == Outcome.OK
    assert d.policy.host_pool.num_evictions >= 1


def test_device_pool_exhaustion_is_back_pressure():
    """No free device block for a new page: the request waits and nothing changes."""
    d = Driver(make_policy(num_device_blocks=4, low_watermark_blocks=0, high_watermark_blocks=0))
    d.add("a")
    d.step({"a": 16})
    d.step({"a": 1})
    assert d.last_outcomes["a"] == Outcome.WAIT_DEVICE
    assert d.policy.tables.num_tokens[d.policy.row_of("a")] == 16
    assert d.policy.can_admit(4) == Outcome.WAIT_DEVICE


def test_can_admit_checks_device_host_and_hot_capacity():
    """Admission looks at the three capacities together."""
    policy = make_policy(num_device_blocks=10, num_host_blocks=5, admission_window_pages=3, hot_blocks=4)
    assert policy.can_admit(40) == Outcome.WAIT_HOST  # 10 pages > 5 host blocks
    assert policy.can_admit(16) == Outcome.OK  # window 3 pages <= 10 free
    assert policy.can_admit(40, num_host_hit_pages=6) == Outcome.OK  # 4 hot + 2 tail + 4 new
    assert policy.can_admit(60, num_host_hit_pages=6) == Outcome.WAIT_DEVICE  # 4 + 2 + 9


def test_engine_chosen_state_row_and_per_request_hot_size():
    """The engine's state row is used as-is; a request may lease a hot region of its own size."""
    d = Driver(make_policy(num_device_blocks=40, low_watermark_blocks=30, high_watermark_blocks=30))
    d.add("a", state_row=5, hot_rows=3 * BS)
    assert d.policy.row_of("a") == 5
    with pytest.raises(ProtocolError):
        d.add("b", state_row=5)
    d.step({"a": 40})
    d.step({"a": 1})
    assert d.policy.residency("a") == Residency.MIXED
    assert len(d.policy.hot_block_ids("a")) == 3


def test_finish_with_mirror_in_flight_keeps_blocks_until_acknowledged():
    """The mirror of the last step still reads the request's blocks: they stay leased by the
    transfer after finish, and come back once the worker reports it."""
    d = Driver(make_policy())
    d.add("a")
    d.step({"a": 6}, ack=False)
    d.policy.finish("a")
    d.policy.check_invariants()
    assert d.policy.device_pool.get_num_free_blocks() == d.policy.device_pool.num_blocks - 2
    d.ack_all()
    assert d.policy.is_idle()
    assert d.policy.device_pool.get_num_free_blocks() == d.policy.device_pool.num_blocks


def test_command_round_trips_through_json():
    """The step command and the acks are plain data: JSON round trip is lossless."""
    import json

    from vllm_hisparse.core import StepCommand

    d = Driver(make_policy(num_device_blocks=40, low_watermark_blocks=30, high_watermark_blocks=30))
    d.add("a")
    d.step({"a": 40})
    cmd = d.step({"a": 1})
    assert cmd.hot_leases and cmd.residency_changes and cmd.transfers
    again = StepCommand.from_dict(json.loads(json.dumps(cmd.to_dict())))
    assert again == cmd
    acks = WorkerAcks(enqueued=[1], completed=[2, 3], failed=[4])
    assert WorkerAcks.from_dict(json.loads(json.dumps(acks.to_dict()))) == acks
