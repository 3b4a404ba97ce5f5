"""Merging transfer acks of several executors that each run their share of one transfer.

A vLLM DSA model's sparse-MLA layers sit in several KV cache groups, each with its own
device block per page; the worker runs one :class:`~vllm_hisparse.worker.StepExecutor`
(one transfer engine) per group and every transfer id of a command runs in each of them.
For the scheduler a transfer is one transaction, so:

* **enqueued** once every executor enqueued it (only then may its source block be reused);
* **completed** once every executor completed it;
* **failed** as soon as any executor failed it (reported once; later reports of the same id
  from other executors are swallowed, as are their completions).
"""

from __future__ import annotations

from typing import Sequence

from vllm_hisparse.core.commands import WorkerAcks


class AckMerger:
    """Combines per-executor :class:`WorkerAcks` into one stream of transaction acks.

    Args:
        num_parts: executors that each report every transfer id.
    """

    def __init__(self, num_parts: int):
        if num_parts <= 0:
            raise ValueError(f"AckMerger: num_parts must be >= 1, got {num_parts}")
        self.num_parts = num_parts
        self._enqueued: dict[int, int] = {}
        self._completed: dict[int, int] = {}
        self._failed: set[int] = set()

    def merge(self, parts: Sequence[WorkerAcks]) -> WorkerAcks:
        """Fold this round's reports (one per executor) in; return what became final."""
        if len(parts) != self.num_parts:
            raise ValueError(f"AckMerger: expected {self.num_parts} reports, got {len(parts)}")
        if self.num_parts == 1:
            return parts[0]
        out = WorkerAcks()
        for acks in parts:
            for tid in acks.failed:
                if tid not in self._failed:
                    self._failed.add(tid)
                    out.failed.append(tid)
                self._enqueued.pop(tid, None)
                self._completed.pop(tid, None)
        for acks in parts:
            for tid in acks.enqueued:
                if tid in self._failed:
                    continue
                n = self._enqueued.get(tid, 0) + 1
                self._enqueued[tid] = n
                if n == self.num_parts:
                    out.enqueued.append(tid)
            for tid in acks.completed:
                if tid in self._failed:
                    continue
                n = self._completed.get(tid, 0) + 1
                if n == self.num_parts:
                    out.completed.append(tid)
                    self._completed.pop(tid, None)
                    self._enqueued.pop(tid, None)
                else:
                    self._completed[tid] = n
        return out

    def forget_failed(self, transfer_ids: Sequence[int]) -> None:
        """Drop remembered failures (their ids may be reused by the scheduler later)."""
        for tid in transfer_ids:
            self._failed.discard(tid)

    @property
    def num_open(self) -> int:
        """Transfers some but not all executors have completed."""
        return len(self._completed)
