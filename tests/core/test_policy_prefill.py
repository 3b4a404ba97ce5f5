"""Requirement R1: a request's prefill reads its whole context from the device.

The worker refuses a step that schedules more than ``max_decode_query_len`` tokens for a
request while a page of that request that has a host block has no device block in its
tables (docs/worker.md). The policy guarantees it:

* R1.a: a prefilling request is never demoted (pressure or admission window) and never
  releases a page; the admission-window demotion fires when the prompt completes;
* R1.b: a prefilling request that is MIXED/NONE (resume, import, host hit) is promoted
  first and waits (``WAIT_TRANSFER`` / ``WAIT_DEVICE``) until every page is resident in
  the worker's tables.

Every story checks the worker's R1 condition on the tables the fake worker actually
applied, for every request scheduled with more than one token.
"""

from __future__ import annotations

import numpy as np

from core_harness import Driver, check_with_outside_leases, make_policy, tag
from vllm_hisparse.core import Outcome, RequestStatus, Residency

BS = 4
MAX_DECODE_QUERY_LEN = 1


def r1_step(d: Driver, scheduled: dict[str, int], **kw):
    """``Driver.step`` plus the worker's R1 check on the tables it applied."""
    cmd = d.step(scheduled, **kw)
    for rid, n in scheduled.items():
        if n <= MAX_DECODE_QUERY_LEN or d.last_outcomes[rid] != Outcome.OK:
            continue
        row = d.policy.row_of(rid)
        host_only = np.nonzero((d.worker.host_blocks[row] >= 0) & (d.worker.residency[row] < 0))[0]
        assert host_only.size == 0, f"R1: {rid} prefills over host-only pages {host_only.tolist()}"
    return cmd


def hog(d: Driver, keep_free: int = 0) -> list[int]:
    """Take all but ``keep_free`` free device blocks (an outside holder the invariant
    check is told about)."""
    pool = d.policy.device_pool
    blocks = pool.get_new_blocks(max(0, pool.get_num_free_blocks() - keep_free))
    d.hogged = getattr(d, "hogged", []) + blocks
    d.check = lambda: (check_with_outside_leases(d.policy, d.hogged),
                       d.worker.check_data(d.policy, d.families))
    return blocks


def unhog(d: Driver) -> None:
    d.policy.device_pool.free_blocks(d.hogged)
    d.hogged = []


def test_window_demotion_waits_for_the_prompt_to_complete():
    """A chunked prefill crosses the admission window: it stays FULL with every page pinned
    while prefilling, and is demoted at its first decode step (no pressure needed)."""
    d = Driver(make_policy(num_device_blocks=64, admission_window_pages=6, hot_blocks=1,
                           min_steps_between_transitions=100))
    d.add("p", prefilling=True)
    for _ in range(4):
        r1_step(d, {"p": 12})  # 3 pages per chunk: crosses the window at the 3rd chunk
        assert d.policy.residency("p") == Residency.FULL
        assert d.policy.page_table("p").pinned.all()
    assert d.policy.stats.num_demotions == 0 and d.policy.stats.num_pages_released == 0
    assert d.policy.set_prefilling("p", False) == Outcome.OK
    r1_step(d, {"p": 1})  # first decode step
    assert d.policy.residency("p") == Residency.MIXED
    assert d.policy.page_table("p").released.any()
    # Only the first crossing counts: no second demotion later.
    r1_step(d, {"p": 1})
    assert d.policy.stats.num_demotions == 1


def test_window_crossed_by_a_decoding_request_still_demotes_at_once():
    d = Driver(make_policy(num_device_blocks=64, admission_window_pages=6, hot_blocks=1,
                           min_steps_between_transitions=100))
    d.add("p")  # not prefilling (e.g. a decode that grew past the window)
    r1_step(d, {"p": 16})
    r1_step(d, {"p": 16})
    assert d.policy.residency("p") == Residency.MIXED


def test_pressure_never_demotes_a_prefilling_request():
    """Under pressure the selection skips prefilling requests, however much they could
    release; once their prompt completes they are candidates like any other."""
    d = Driver(make_policy(num_device_blocks=40, low_watermark_blocks=6, high_watermark_blocks=8, hot_blocks=2))
    d.add("long", prefilling=True)
    d.add("mid")
    r1_step(d, {"long": 64, "mid": 40})  # 16 + 10 pages
    r1_step(d, {"long": 32, "mid": 1})  # 24 + 11 = 35 pages, free 5 < low 6: pressure
    assert d.policy.residency("long") == Residency.FULL
    assert d.policy.residency("mid") == Residency.MIXED  # the only eligible candidate
    assert d.policy.page_table("long").pinned.all()
    d.policy.set_prefilling("long", False)
    hog(d, keep_free=d.policy.low_watermark_blocks - 1)
    r1_step(d, {"long": 1, "mid": 1})  # pressure again: now "long" is a candidate
    assert d.policy.residency("long") == Residency.MIXED
    unhog(d)


def test_pressure_with_only_prefilling_candidates_demotes_nothing():
    d = Driver(make_policy(num_device_blocks=24, low_watermark_blocks=6, high_watermark_blocks=8, hot_blocks=2))
    d.add("a", prefilling=True)
    for _ in range(5):
        r1_step(d, {"a": 16})  # 20 pages, free 4 < low
    assert d.policy.residency("a") == Residency.FULL
    assert d.policy.stats.num_demotions == 0 and d.policy.stats.num_pages_released == 0


def test_host_prefix_hit_with_prompt_left_restores_the_whole_prefix_first():
    """R1.b: a host prefix hit enters NONE with only its tail resident. Prefilling, it is
    promoted at once: every host-only page is restored, and it waits until the restores
    are acknowledged; then it is FULL and prefills over a resident context."""
    d = Driver(make_policy(num_device_blocks=64))
    d.add("first", family=7, num_hashed_pages=6)
    r1_step(d, {"first": 24})
    r1_step(d, {"first": 1})
    d.policy.finish("first")
    d.flush()
    result = d.add("second", family=7, num_hashed_pages=6, prefilling=True)
    assert result.num_host_hit_tokens == 24
    assert result.outcome == Outcome.WAIT_TRANSFER
    assert d.policy.stats.num_restore_pages == 6  # the whole prefix, not just the tail
    # Not schedulable for prefill until the restores are acknowledged.
    r1_step(d, {"second": 8}, ack=False)
    assert d.last_outcomes["second"] == Outcome.WAIT_TRANSFER
    d.ack_all()
    r1_step(d, {"second": 8})
    assert d.last_outcomes["second"] == Outcome.OK
    assert d.policy.residency("second") == Residency.FULL
    assert d.policy.hot_block_ids("second") == []
    d.policy.set_prefilling("second", False)
    for _ in range(3):
        r1_step(d, {"second": 1})


def test_resume_of_a_prefilling_request_whose_pages_were_reused():
    """A prefilling request is preempted, its released pages are reused by others; on
    resume it waits for the restores of every page, and ``schedule_rows`` keeps it out
    of the vectorised path until then."""
    d = Driver(make_policy(num_device_blocks=24, low_watermark_blocks=2, high_watermark_blocks=4, hot_blocks=2))
    d.add("p", family=3, prefilling=True)
    r1_step(d, {"p": 24})  # 6 pages, all clean after the ack
    d.policy.preempt("p")
    d.flush()
    hog(d)
    assert d.policy.stats.num_pages_reused == 6
    assert d.policy.resume("p") == Outcome.WAIT_DEVICE
    unhog(d)
    out = d.policy.resume("p")
    assert out == Outcome.WAIT_TRANSFER
    row = d.policy.row_of("p")
    outcome = d.policy.schedule_rows(np.array([row]), np.array([8]))
    assert outcome.tolist() == [Outcome.WAIT_TRANSFER]
    d.flush()  # restores planned above are launched and acknowledged
    d.flush()  # their page entries reach the worker
    assert d.policy.residency("p") == Residency.FULL and d.policy.is_ready("p")
    outcome = d.policy.schedule_rows(np.array([row]), np.array([8]))
    assert outcome.tolist() == [Outcome.OK]
    cmd = d.policy.build_step()
    d.worker.run(cmd)
    d.ack_all()
    assert not ((d.worker.host_blocks[row] >= 0) & (d.worker.residency[row] < 0)).any()
    assert d.policy.tables.num_tokens[row] == 32


def test_set_prefilling_on_a_mixed_request_promotes_it_and_waits():
    """A MIXED request told it prefills (e.g. an engine recomputing part of it) gets every
    page back before ``schedule`` lets it run; WAIT_DEVICE while the pool is short."""
    d = Driver(make_policy(num_device_blocks=24, low_watermark_blocks=8, high_watermark_blocks=10, hot_blocks=2,
                           min_steps_between_transitions=100))
    d.add("a", family=5)
    r1_step(d, {"a": 60})
    r1_step(d, {"a": 5})  # MIXED under pressure
    assert d.policy.residency("a") == Residency.MIXED
    hog(d)
    assert d.policy.stats.num_pages_reused > 0
    assert d.policy.set_prefilling("a", True) == Outcome.WAIT_DEVICE
    r1_step(d, {"a": 4})
    assert d.last_outcomes["a"] == Outcome.WAIT_DEVICE
    unhog(d)
    r1_step(d, {"a": 4}, ack=False)
    assert d.last_outcomes["a"] == Outcome.WAIT_TRANSFER
    d.ack_all()
    r1_step(d, {"a": 4})
    assert d.last_outcomes["a"] == Outcome.OK and d.policy.residency("a") == Residency.FULL
    assert d.policy.tables.num_tokens[d.policy.row_of("a")] == 69


def test_partial_import_with_prompt_left_is_restored_before_prefill():
    d = Driver(make_policy())
    d.add("imp", family=9, prefilling=True)
    blocks = d.policy.begin_import("imp", 12)
    for page, block in enumerate(blocks):
        d.worker.host_mem[block] = [tag(9, page * BS + i) for i in range(BS)]
    assert d.policy.finish_import("imp", success=True) == Outcome.WAIT_TRANSFER
    assert d.policy.status("imp") in (RequestStatus.ACTIVATING, RequestStatus.ACTIVE)
    r1_step(d, {"imp": 6})
    assert d.last_outcomes["imp"] == Outcome.WAIT_TRANSFER
    r1_step(d, {"imp": 6})
    assert d.last_outcomes["imp"] == Outcome.OK
    assert d.policy.residency("imp") == Residency.FULL


def test_failed_restore_of_a_prefilling_request_is_retried():
    d = Driver(make_policy(num_device_blocks=64))
    d.add("first", family=2, num_hashed_pages=5)
    r1_step(d, {"first": 21})
    d.policy.finish("first")
    d.flush()
    d.add("second", family=2, num_hashed_pages=5, prefilling=True)
    restores = [s.transfer_id for s in d.flush().transfers if s.kind == 1]
    # The first flush launched and acked them; start over with a failure instead.
    assert restores
    d.policy.finish("second")
    d.flush()
    d.add("third", family=2, num_hashed_pages=5, prefilling=True)
    cmd = d.step({}, ack=False)
    fail = {s.transfer_id for s in cmd.transfers if s.kind == 1}
    d.worker.launched = {tid: l for tid, l in d.worker.launched.items()}
    for tid in fail:
        d.worker.launched[tid].will_fail = True
    d.ack_all()
    assert d.policy.residency("third") != Residency.FULL
    for _ in range(4):
        r1_step(d, {"third": 4})
        if d.last_outcomes["third"] == Outcome.OK:
            break
    assert d.last_outcomes["third"] == Outcome.OK and d.policy.residency("third") == Residency.FULL


def test_schedule_rows_takes_engine_blocks_for_growing_rows():
    """``schedule_rows(..., device_blocks_for=...)``: rows that cross into new pages get the
    engine's blocks (the policy takes over one lease each); the others stay vectorised."""
    policy = make_policy(num_device_blocks=64)
    d = Driver(policy)
    d.add("a")
    d.add("b")
    r1_step(d, {"a": 4, "b": 3})  # a: one full page, b: 3 of 4 rows
    pool = policy.device_pool
    calls = []

    def blocks_for(row, first_page, num_pages):
        calls.append((row, first_page, num_pages))
        return pool.get_new_blocks(num_pages)  # "the engine" allocated them

    rows = np.array([policy.row_of("a"), policy.row_of("b")])
    out = policy.schedule_rows(rows, np.array([6, 1]), device_blocks_for=blocks_for)
    assert out.tolist() == [Outcome.OK, Outcome.OK]
    assert calls == [(policy.row_of("a"), 1, 2)]  # b stays inside its page
    d.worker.run(policy.build_step())
    d.ack_all()
    assert policy.page_table("a").pinned.tolist() == [True, True, True]
