"""The scheduler role's ack intake: the workers' reports, voted and applied.

Each worker reports its transfer acks under its rank (``HiSparseWorkerMetadata``); the
role votes them per (transfer, worker) with the one vote of the package
(``core.ack_vote.AckVote``, also used by the worker role across its group executors):

* a transfer completes once every worker completed it and fails once every worker
  reported it and one failed (no copy can still be in flight when its blocks return);
* a repeated ack is counted once, dropped, counted in ``num_duplicate_acks`` and logged
  at most once a minute;
* a transfer without every worker's final ack for ``ack_deadline_s`` stops the engine
  with :class:`~vllm_hisparse.core.ack_vote.WorkerSilentError` naming the silent workers
  (docs/core.md, "Failure semantics").

The role applies the voted acks (after the host-prefix service settled the identities
riding with them); :class:`AckIntake` owns the vote, the step count and the duplicate log.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from vllm_hisparse.core.ack_vote import AckVote, WorkerSilentError
from vllm_hisparse.core.commands import StepCommand, WorkerAcks
from vllm_hisparse.vllm.metadata import HiSparseWorkerMetadata
from vllm_hisparse.vllm.metrics import HiSparseConnectorStats
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME

logger = logging.getLogger(__name__)

#: Duplicate acks are logged at most once per this many seconds.
DUPLICATE_LOG_EVERY_S = 60.0


class AckIntake:
    """Worker acks, voted per (transfer, worker rank) (module docstring).

    Verbs: :meth:`issue` (a step's command was built), :meth:`worker_meta` (the workers'
    reports in a step's output), :meth:`vote`, :meth:`check_deadline`.
    """

    def __init__(self, num_workers: int, ack_deadline_s: float, stats: HiSparseConnectorStats) -> None:
        # A transfer without every worker's final ack for ack_deadline_s stops the engine.
        self._vote = AckVote(num_workers, "worker")
        self.ack_deadline_s = ack_deadline_s
        self.stats = stats
        self._num_steps = 0
        self._duplicates_seen = 0
        self._duplicates_logged_s = -math.inf

    @property
    def num_workers(self) -> int:
        """Workers that ack every transfer (the replica's world size)."""
        return self._vote.num_voters

    @num_workers.setter
    def num_workers(self, value: int) -> None:
        if self._vote.num_open:
            raise RuntimeError(f"{CONNECTOR_NAME}: num_workers changed with transfers open")
        self._vote = AckVote(value, "worker")

    @property
    def num_open(self) -> int:
        """Transfers issued and not decided yet."""
        return self._vote.num_open

    @property
    def num_duplicates_seen(self) -> int:
        return self._duplicates_seen

    def issue(self, command: StepCommand) -> None:
        """A step's command was built: its transfers wait for every worker's ack."""
        self._num_steps += 1
        if command.transfers:
            self._vote.expect((t.transfer_id for t in command.transfers), self._num_steps,
                              time.monotonic())

    def worker_meta(self, connector_output: Any) -> HiSparseWorkerMetadata | None:
        """The workers' reports in a step's output (None without any)."""
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return None
        if not isinstance(meta, HiSparseWorkerMetadata):
            raise TypeError(
                f"{CONNECTOR_NAME}: expected HiSparseWorkerMetadata from the workers, got {type(meta).__name__}"
            )
        return meta

    def vote(self, meta: HiSparseWorkerMetadata) -> WorkerAcks:
        """The transfers decided by these reports (``core.ack_vote``: completed once every
        worker completed it, failed once every worker reported it and one failed;
        duplicates are counted and dropped)."""
        acks = self._vote.vote(meta.reports())
        self._note_duplicates()
        return acks

    def _note_duplicates(self) -> None:
        """Count duplicate acks in the stats; log them at most once a minute."""
        new = self._vote.num_duplicates - self._duplicates_seen
        if not new:
            return
        self._duplicates_seen += new
        self.stats.add("num_duplicate_acks", new)
        now = time.monotonic()
        if now - self._duplicates_logged_s >= DUPLICATE_LOG_EVERY_S:
            self._duplicates_logged_s = now
            logger.warning("%s: dropped %d duplicate transfer ack(s) (%d so far); acks are "
                           "idempotent, a worker repeats reports", CONNECTOR_NAME, new,
                           self._duplicates_seen)

    def check_deadline(self) -> None:
        """Raise :class:`WorkerSilentError` if a transfer has waited longer than
        ``ack_deadline_s`` for some worker's final ack (docs/core.md, "Failure
        semantics": its copy may still be in flight, so its blocks cannot be reused).
        O(1) per step unless transfers are overdue (ballots are kept in issue order)."""
        late = self._vote.overdue(self._num_steps, time.monotonic(), None, self.ack_deadline_s)
        if not late:
            return
        tid, silent, reported = late[0]
        step, issued_s = self._vote.issued_at(tid)
        raise WorkerSilentError(
            f"{CONNECTOR_NAME}: worker(s) {silent} went silent: transfer {tid} (issued "
            f"{time.monotonic() - issued_s:.1f} s ago, at scheduler step {step}) has no final "
            f"ack from them after ack_deadline_s={self.ack_deadline_s:g}; "
            f"{len(late)} transfer(s) overdue; workers that reported it: {reported}. Its "
            "copies may still be in flight, so its blocks cannot be reused: stopping")

