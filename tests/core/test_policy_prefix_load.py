"""Host-prefix loads into engine-allocated blocks (``acquire_host_prefix`` /
``adopt_host_prefix``) and late prefix identities (``set_block_hashes``).

This is the path vLLM takes: the engine allocates a block for every page of the hit, and
the forward of the same step reads them, so the restore goes into pinned pages before the
forward and the request is FULL at once.
"""

from __future__ import annotations

import pytest

from core_harness import Driver, hashes_for, make_policy
from test_policy_scenarios import decode
from vllm_hisparse.core import Outcome, ProtocolError, Residency, TransferKind


def _published_family(d: Driver, family: int, num_tokens: int, num_hashed: int) -> None:
    """Run one request of ``family`` to completion so its first pages are published."""
    rid = f"src-{family}"
    d.add(rid, family=family, num_hashed_pages=num_hashed)
    d.step({rid: num_tokens})
    d.step({rid: 1})
    d.policy.finish(rid)
    d.flush()


def _adopt(d: Driver, rid: str, family: int, num_pages: int, first_load_page: int = 0):
    """Add ``rid`` and adopt ``num_pages`` host-hit pages into fresh engine blocks."""
    policy = d.policy
    d.add(rid, family=family, prefilling=True)
    hits = policy.acquire_host_prefix(hashes_for(family, num_pages))
    assert len(hits) == num_pages
    blocks = policy.device_pool.get_new_blocks(num_pages)  # the engine's allocation
    for page in range(first_load_page):  # the engine's own prefix cache holds these
        d.worker.device_mem[blocks[page]] = d.worker.host_mem[hits[page]]
    policy.adopt_host_prefix(rid, blocks, hits, first_load_page)
    return blocks, hits


def test_adopted_prefix_is_restored_before_the_forward_and_reads_exactly():
    d = Driver(make_policy())
    _published_family(d, family=3, num_tokens=13, num_hashed=3)
    assert d.policy.lookup_host_prefix(hashes_for(3, 3)) == 3
    blocks, hits = _adopt(d, "b", family=3, num_pages=3)
    assert d.policy.residency("b") == Residency.FULL
    assert d.policy.is_ready("b")
    # The prompt's remainder is scheduled in the same step as the load.
    cmd = d.step({"b": 2})
    loads = [t for t in cmd.transfers if t.kind == TransferKind.RESTORE]
    assert len(loads) == 1 and not loads[0].after_forward and loads[0].forward_reads
    assert loads[0].device_blocks == blocks and loads[0].host_blocks == hits
    table = d.policy.page_table("b")
    assert table.pinned.all() and table.host_valid[:3].all()
    assert d.policy.stats.num_prefix_load_pages == 3
    d.policy.set_prefilling("b", False)
    decode(d, ["b"], 5)
    d.policy.finish("b")
    d.flush()
    assert d.policy.is_idle()


def test_pages_already_on_the_device_are_not_loaded_again():
    d = Driver(make_policy())
    _published_family(d, family=5, num_tokens=17, num_hashed=4)
    _, hits = _adopt(d, "b", family=5, num_pages=4, first_load_page=2)
    cmd = d.step({"b": 1})
    (load,) = [t for t in cmd.transfers if t.kind == TransferKind.RESTORE]
    assert load.host_blocks == hits[2:]
    assert d.policy.stats.num_prefix_load_pages == 2


def test_acquired_prefix_survives_host_pressure_until_released():
    """The lease taken at lookup keeps the blocks from LRU eviction."""
    d = Driver(make_policy(num_host_blocks=8))
    _published_family(d, family=1, num_tokens=12, num_hashed=3)
    hits = d.policy.acquire_host_prefix(hashes_for(1, 3))
    assert d.policy.host_pool.num_allocatable_blocks == 8 - 3
    d.policy.release_host_prefix(hits)
    assert d.policy.host_pool.num_allocatable_blocks == 8
    assert d.policy.lookup_host_prefix(hashes_for(1, 3)) == 3  # still cached
    d.policy.check_invariants()


def test_max_pages_caps_the_acquired_prefix():
    d = Driver(make_policy())
    _published_family(d, family=2, num_tokens=16, num_hashed=4)
    hits = d.policy.acquire_host_prefix(hashes_for(2, 4), max_pages=2)
    assert len(hits) == 2
    d.policy.release_host_prefix(hits)
    assert d.policy.acquire_host_prefix(hashes_for(2, 4), max_pages=0) == []


def test_a_failed_prefix_load_is_counted_and_leaks_nothing():
    d = Driver(make_policy())
    _published_family(d, family=4, num_tokens=8, num_hashed=2)
    _adopt(d, "b", family=4, num_pages=2)
    cmd = d.policy.build_step()
    (load,) = [t for t in cmd.transfers if t.kind == TransferKind.RESTORE]
    from vllm_hisparse.core import WorkerAcks

    d.policy.apply_acks(WorkerAcks(failed=[load.transfer_id]))
    assert d.policy.stats.num_failed_prefix_load_pages == 2
    assert d.policy.page_table("b").pending.max() < 0
    # The engine fails the request; its pages go back, the published copies stay.
    d.policy.abort("b", publish=False)
    d.policy.check_invariants()
    assert d.policy.is_idle()
    assert d.policy.lookup_host_prefix(hashes_for(4, 2)) == 2


def test_abort_with_the_load_in_flight_returns_every_lease_on_completion():
    d = Driver(make_policy())
    _published_family(d, family=6, num_tokens=8, num_hashed=2)
    _adopt(d, "b", family=6, num_pages=2)
    d.step({"b": 1}, ack=False)
    d.policy.abort("b")
    d.policy.check_invariants()
    d.ack_all()
    d.flush()
    assert d.policy.is_idle()
    assert d.policy.host_pool.num_free_blocks + d.policy.host_pool.num_cached_blocks == d.policy.host_pool.num_blocks


def test_adopt_rejects_bad_arguments():
    d = Driver(make_policy())
    _published_family(d, family=8, num_tokens=8, num_hashed=2)
    d.add("b", family=8)
    hits = d.policy.acquire_host_prefix(hashes_for(8, 2))
    with pytest.raises(ProtocolError, match="one prefix"):
        d.policy.adopt_host_prefix("b", [1], hits, 0)
    with pytest.raises(ProtocolError, match="one prefix"):
        d.policy.adopt_host_prefix("b", [1, 2], hits, 3)
    d.policy.release_host_prefix(hits)
    d.step({"b": 1})
    hits = d.policy.acquire_host_prefix(hashes_for(8, 2))
    with pytest.raises(ProtocolError, match="new, empty request"):
        d.policy.adopt_host_prefix("b", [1, 2], hits, 0)
    d.policy.release_host_prefix(hits)
    d.policy.check_invariants()


def test_identity_given_after_the_page_is_clean_publishes_it():
    """``set_block_hashes``: publication waits for both the identity and a clean page."""
    d = Driver(make_policy())
    d.add("a", family=9)
    d.step({"a": 9})  # pages 0, 1 sealed and mirrored, page 2 partial
    assert d.policy.lookup_host_prefix(hashes_for(9, 2)) == 0
    published = d.policy.set_block_hashes("a", 0, hashes_for(9, 3))
    assert published == 2  # page 2 is not clean yet
    assert d.policy.lookup_host_prefix(hashes_for(9, 3)) == 2
    decode(d, ["a"], 3)  # seals page 2: it is published when its mirror completes
    assert d.policy.lookup_host_prefix(hashes_for(9, 3)) == 3
    # Unknown identities (None) never publish.
    d.add("c", family=10)
    d.step({"c": 8})
    assert d.policy.set_block_hashes("c", 0, [None, None]) == 0
    with pytest.raises(ProtocolError):
        d.policy.set_block_hashes("c", -1, [None])


def test_resumed_identity_after_preemption_hits_the_whole_written_prefix():
    """An aborted (preempted) request publishes its clean pages; a request with the same
    tokens adopts them all and decodes on exactly."""
    d = Driver(make_policy())
    d.add("a", family=11)
    d.step({"a": 16})
    decode(d, ["a"], 2)
    d.policy.set_block_hashes("a", 0, hashes_for(11, 4))
    d.policy.abort("a")
    d.flush()
    assert d.policy.lookup_host_prefix(hashes_for(11, 5)) == 4
    _adopt(d, "a2", family=11, num_pages=4)
    d.step({"a2": 2})
    assert d.last_outcomes == {"a2": Outcome.OK}
    d.policy.set_prefilling("a2", False)
    decode(d, ["a2"], 3)
