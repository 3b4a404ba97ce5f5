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

A mixin of :class:`~vllm_hisparse.vllm.scheduler_side.role.SchedulerRole`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm_hisparse.core.ack_vote import AckVote, WorkerSilentError
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME
from vllm_hisparse.vllm.metadata import HiSparseWorkerMetadata

logger = logging.getLogger(__name__)

#: Duplicate acks are logged at most once per this many seconds.
DUPLICATE_LOG_EVERY_S = 60.0


class AckIntake:
    """Worker acks → policy (module docstring)."""

    def update_connector_output(self, connector_output: Any) -> None:
        """Apply the workers' transfer acks, voted per (transfer, worker rank)
        (``core.ack_vote``: completed once every worker completed it, failed once every
        worker reported it and one failed; duplicates are counted and dropped)."""
        # Rejected drafts first: the acks below may complete their rows' mirror.
        self._roll_back_rejected()
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, HiSparseWorkerMetadata):
            raise TypeError(
                f"{CONNECTOR_NAME}: expected HiSparseWorkerMetadata from the workers, got {type(meta).__name__}"
            )
        # Before the acks that make pages clean (a clean page with an identity is
        # published): a worker that failed to save indexer pages reports it no later
        # than its own completion of the mirror.
        for tid in meta.failed_indexer_saves:
            self._revoke_identities(tid)
        if meta.hot_counts:  # adaptive hot regions: sized in the next build_step
            self._require_policy().observe_hot_counts(meta.hot_counts)
        acks = self._vote.vote(meta.reports())
        self._note_duplicates()
        if acks.is_empty():
            return
        policy = self._require_policy()
        if self._identity_pending:
            for tid in acks.failed:  # the pages may become clean later, by a spill
                self._revoke_identities(tid)
            for tid in acks.completed:
                entries = self._identity_pending.pop(tid, None)
                if entries:
                    self._give_late_identities(entries)
        policy.apply_acks(acks)

    @property
    def num_workers(self) -> int:
        """Workers that ack every transfer (the replica's world size)."""
        return self._vote.num_voters

    @num_workers.setter
    def num_workers(self, value: int) -> None:
        if self._vote.num_open:
            raise RuntimeError(f"{CONNECTOR_NAME}: num_workers changed with transfers open")
        self._vote = AckVote(value, "worker")

    def _note_duplicates(self) -> None:
        """Count duplicate acks in the stats; log them at most once a minute."""
        new = self._vote.num_duplicates - self._duplicates_seen
        if not new:
            return
        self._duplicates_seen += new
        self._stats.add("num_duplicate_acks", new)
        now = time.monotonic()
        if now - self._duplicates_logged_s >= DUPLICATE_LOG_EVERY_S:
            self._duplicates_logged_s = now
            logger.warning("%s: dropped %d duplicate transfer ack(s) (%d so far); acks are "
                           "idempotent, a worker repeats reports", CONNECTOR_NAME, new,
                           self._duplicates_seen)

    def check_ack_deadline(self) -> None:
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

