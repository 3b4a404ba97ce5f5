"""One vote over transfer acks, keyed by (transfer id, voter).

Every transfer runs on several *voters* that each report it: the per-group executors of
one worker (a DSA model's sparse-MLA layers sit in several KV cache groups), and the
workers of one replica (tensor/pipeline parallel ranks). For the policy a transfer is
one transaction, so the vote turns the voters' reports into transaction acks:

* **enqueued** once every voter enqueued it or reported it final (only then may its
  source block be reused: every voter's read is on its stream);
* **final** once every voter reported it final (completed or failed): **completed** if
  all completed, **failed** if any failed. A failure waits for the other voters, so no
  copy of the transfer can still be in flight when the policy returns its blocks.

Acks are idempotent: a report a voter already made (the same id twice in one report, or
re-sent later), and any report about a transfer already decided, is a *duplicate*:
counted in :attr:`AckVote.num_duplicates` and dropped. An id that was never issued is a
protocol error. Memory is bounded by the open transfers: a decided id is forgotten
(ids are issued in increasing order, so "at most the newest issued id and not open"
means "decided").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from vllm_hisparse.core.commands import WorkerAcks
from vllm_hisparse.core.errors import ProtocolError


class WorkerSilentError(RuntimeError):
    """A transfer stayed without a final ack from some voter past the ack deadline."""


@dataclass
class _Ballot:
    step: int
    time_s: float
    enqueued: set[int] = field(default_factory=set)
    final: set[int] = field(default_factory=set)
    failed: bool = False
    enqueue_decided: bool = False


class AckVote:
    """Decides transfers from per-voter :class:`WorkerAcks` (see the module docstring).

    Args:
        num_voters: voters that each report every transfer (ids ``0 .. num_voters-1``).
        name: who votes, for error messages (``"worker"``, ``"group executor"``).
    """

    def __init__(self, num_voters: int, name: str = "voter"):
        if num_voters <= 0:
            raise ValueError(f"AckVote: num_voters must be >= 1, got {num_voters}")
        self.num_voters = num_voters
        self.name = name
        self._open: dict[int, _Ballot] = {}  # in issue order (dicts keep insertion order)
        self._newest_id = 0
        self.num_duplicates = 0  # lifetime count of dropped duplicate reports

    @property
    def num_open(self) -> int:
        """Issued transfers not decided yet."""
        return len(self._open)

    def expect(self, transfer_ids: Iterable[int], step: int = 0, time_s: float = 0.0) -> None:
        """Open ballots for newly issued transfers (ids increasing), stamped with the step
        and time they were issued (for :meth:`overdue`)."""
        for tid in sorted(int(t) for t in transfer_ids):
            if tid <= self._newest_id:
                raise ProtocolError(f"transfer {tid} issued after transfer {self._newest_id}: "
                                    "ids must increase")
            self._newest_id = tid
            self._open[tid] = _Ballot(step, time_s)

    def vote(self, reports: Sequence[tuple[int, WorkerAcks]]) -> WorkerAcks:
        """Fold in one round of ``(voter, acks)`` reports; return what got decided.

        A voter absent from ``reports`` said nothing this round. Raises ``ProtocolError``
        for a voter outside ``[0, num_voters)`` or an id that was never issued."""
        out = WorkerAcks()
        touched: list[int] = []
        for voter, acks in reports:
            if not 0 <= voter < self.num_voters:
                raise ProtocolError(f"ack from {self.name} {voter}; expected one of "
                                    f"0..{self.num_voters - 1}")
            for tid in acks.enqueued:
                ballot = self._ballot(tid)
                if ballot is None or voter in ballot.enqueued or voter in ballot.final:
                    self.num_duplicates += 1
                    continue
                ballot.enqueued.add(voter)
                touched.append(tid)
            for tids, failed in ((acks.completed, False), (acks.failed, True)):
                for tid in tids:
                    ballot = self._ballot(tid)
                    if ballot is None or voter in ballot.final:
                        self.num_duplicates += 1
                        continue
                    ballot.final.add(voter)
                    ballot.enqueued.add(voter)
                    ballot.failed |= failed
                    touched.append(tid)
        n = self.num_voters
        for tid in dict.fromkeys(touched):
            ballot = self._open.get(tid)
            if ballot is None:
                continue
            if len(ballot.final) == n:
                del self._open[tid]
                (out.failed if ballot.failed else out.completed).append(tid)
            elif not ballot.enqueue_decided and len(ballot.enqueued) == n:
                ballot.enqueue_decided = True
                out.enqueued.append(tid)
        return out

    def _ballot(self, tid: int) -> _Ballot | None:
        """The open ballot of ``tid``; None if it was decided already (a duplicate)."""
        ballot = self._open.get(tid)
        if ballot is None and not 0 < tid <= self._newest_id:
            raise ProtocolError(f"ack for transfer {tid}, which was never issued "
                                f"(newest issued: {self._newest_id})")
        return ballot

    def overdue(self, step: int, time_s: float, max_steps: int | None,
                max_s: float | None) -> list[tuple[int, list[int], list[int]]]:
        """Open transfers issued more than ``max_steps`` steps or ``max_s`` seconds before
        (``step``, ``time_s``), oldest first: ``(transfer id, silent voters, voters that
        reported it final)``. O(overdue + 1): ballots are kept in issue order."""
        found = []
        for tid, ballot in self._open.items():
            late = ((max_steps is not None and step - ballot.step > max_steps)
                    or (max_s is not None and time_s - ballot.time_s > max_s))
            if not late:
                break
            silent = [v for v in range(self.num_voters) if v not in ballot.final]
            found.append((tid, silent, sorted(ballot.final)))
        return found

    def issued_at(self, tid: int) -> tuple[int, float]:
        """``(step, time_s)`` an open transfer was issued at."""
        ballot = self._open[tid]
        return ballot.step, ballot.time_s
