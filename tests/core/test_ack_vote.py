"""The one ack vote (``core.ack_vote``), used by the worker role (per sparse-group
executor) and the scheduler role (per worker rank)."""

from __future__ import annotations

import pytest

from vllm_hisparse.core.ack_vote import AckVote
from vllm_hisparse.core.commands import WorkerAcks
from vllm_hisparse.core.errors import ProtocolError


def test_needs_every_voter_and_waits_for_all_before_failing():
    vote = AckVote(2)
    vote.expect([1, 2])
    out = vote.vote([(0, WorkerAcks(enqueued=[1, 2], completed=[1])), (1, WorkerAcks(enqueued=[1]))])
    assert (out.enqueued, out.completed, out.failed) == ([1], [], [])
    out = vote.vote([(1, WorkerAcks(enqueued=[2], completed=[1]))])
    assert (out.enqueued, out.completed, out.failed) == ([2], [1], [])
    out = vote.vote([(0, WorkerAcks(failed=[2]))])
    assert out.is_empty()  # voter 1 may still be copying: not final yet
    out = vote.vote([(1, WorkerAcks(completed=[2]))])
    assert (out.completed, out.failed) == ([], [2])
    assert vote.num_open == 0 and vote.num_duplicates == 0


def test_duplicates_are_counted_once_and_never_vote_for_another_voter():
    vote = AckVote(2)
    vote.expect([1])
    out = vote.vote([(0, WorkerAcks(completed=[1, 1]))])  # the same id twice in one report
    assert out.is_empty() and vote.num_duplicates == 1
    out = vote.vote([(0, WorkerAcks(completed=[1]))])  # re-sent a step later
    assert out.is_empty() and vote.num_duplicates == 2
    out = vote.vote([(1, WorkerAcks(completed=[1]))])
    assert out.completed == [1]
    out = vote.vote([(1, WorkerAcks(completed=[1])), (0, WorkerAcks(failed=[1]))])  # decided
    assert out.is_empty() and vote.num_duplicates == 4


def test_never_issued_ids_and_unknown_voters_are_protocol_errors():
    vote = AckVote(2, "worker")
    vote.expect([3])
    with pytest.raises(ProtocolError, match="never issued"):
        vote.vote([(0, WorkerAcks(completed=[4]))])
    with pytest.raises(ProtocolError, match="worker 2"):
        vote.vote([(2, WorkerAcks(completed=[3]))])
    with pytest.raises(ProtocolError, match="ids must increase"):
        vote.expect([3])


def test_memory_is_bounded_by_the_open_transfers():
    vote = AckVote(3)
    for tid in range(1, 20_001):
        vote.expect([tid])
        vote.vote([(v, WorkerAcks(completed=[tid, tid])) for v in range(3)])
        assert vote.num_open == 0
    assert len(vote._open) == 0 and vote.num_duplicates == 60_000


def test_overdue_names_the_silent_voters_oldest_first():
    vote = AckVote(3)
    vote.expect([1], step=1, time_s=10.0)
    vote.expect([2], step=2, time_s=11.0)
    vote.expect([3], step=3, time_s=30.0)
    vote.vote([(0, WorkerAcks(completed=[1, 2])), (2, WorkerAcks(completed=[1]))])
    assert vote.overdue(4, 25.0, None, 10.0) == [(1, [1], [0, 2]), (2, [1, 2], [0])]
    assert vote.overdue(4, 25.0, 2, None) == [(1, [1], [0, 2])]
    assert vote.overdue(4, 15.0, None, 10.0) == []
