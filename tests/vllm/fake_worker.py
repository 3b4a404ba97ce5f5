"""A fake of the worker role's acks, for driving the real scheduler on CPU.

The real worker role (``vllm_hisparse.vllm.worker_side.role``) copies KV and reports each
transfer once its event completed. Here each step's command is read from the
``SchedulerOutput`` (directly or as a ``MultiConnector`` child) and its transfers are
acknowledged later, in a configurable way:

* ``delay_steps``: steps between the forward that received a transfer and its ack
  (``0`` = acked with that step's output, like a synchronous worker);
* ``jitter_steps``: an extra random delay per transfer, so acks of different
  transfers arrive out of order across steps;
* ``order``: ``"fifo"``, ``"reverse"`` or ``"random"`` order within one report;
* ``num_workers`` with ``stagger_steps``: worker ``i`` reports each transfer
  ``i * stagger_steps`` steps later than worker 0 (vLLM aggregates the reports);
* ``fail``: a predicate on ``(TransferSpec, worker index)`` that fails that copy once
  (later copies of a retried page get new transfer ids);
* ``lose``: a predicate on ``(TransferSpec, worker index)``: that worker never acks it;
* ``repeat``: a predicate on ``(transfer id, worker index)``: that final ack is sent twice
  in its report, and once more in the next report.

Each worker's report carries its rank (``worker_rank``), as the real worker role's does.
A host-prefix load (``metadata.load_requests``) is reported per request, as vLLM's
``KVOutputAggregator`` hands it over: in ``finished_recving`` once every worker acked its
RESTORE, and in ``failed_recving`` too when one of them failed it.

It also checks the command protocol a real worker relies on: every transfer id is new
and every lease's blocks are distinct.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm.v1.outputs import KVConnectorOutput

from vllm_hisparse.core.commands import TransferSpec, WorkerAcks
from vllm_hisparse.vllm.compat import multi_connector_types
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata


@dataclass
class _Due:
    step: int
    transfer_id: int
    worker: int
    failed: bool


@dataclass
class FakeWorker:
    delay_steps: int = 0
    jitter_steps: int = 0
    order: str = "fifo"
    num_workers: int = 1
    stagger_steps: int = 0
    report_enqueued: bool = False
    fail: Callable[[TransferSpec, int], bool] | None = None
    lose: Callable[[TransferSpec, int], bool] | None = None
    repeat: Callable[[int, int], bool] | None = None
    multi_index: int | None = None
    """Position of our connector among MultiConnector children (None: used alone)."""
    multi_size: int = 2
    hot_counts: Callable[[], dict[int, tuple[int, int]]] | None = None
    """Adaptive hot regions: rank 0's per-row (misses, references) for each report."""
    seed: int = 0
    step: int = 0
    seen_ids: set[int] = field(default_factory=set)
    commands: list = field(default_factory=list)
    num_failed: int = 0
    num_lost: int = 0
    num_repeated: int = 0
    _due: list[_Due] = field(default_factory=list)
    _resend: list[_Due] = field(default_factory=list)
    _loads: dict[int, str] = field(default_factory=dict)  # RESTORE id -> request id
    _load_votes: dict[int, list] = field(default_factory=dict)  # id -> [workers, failed]

    def __post_init__(self) -> None:
        if self.order not in ("fifo", "reverse", "random"):
            raise ValueError(f"order={self.order!r}; accepted: fifo, reverse, random")
        self._rng = random.Random(self.seed)

    # -------------------------------------------------------------------------------
    def _our_metadata(self, scheduler_output) -> HiSparseConnectorMetadata | None:
        meta = scheduler_output.kv_connector_metadata
        if self.multi_index is not None and meta is not None:
            meta = meta.metadata[self.multi_index]
        if meta is None:
            return None
        assert isinstance(meta, HiSparseConnectorMetadata), type(meta)
        return meta

    def on_forward(self, scheduler_output) -> KVConnectorOutput | None:
        """Run one step's "forward": accept its transfers, return the acks now due."""
        meta = self._our_metadata(scheduler_output)
        if meta is not None:
            self.commands.append(meta)
            self._loads.update(meta.load_requests)
            for spec in meta.command.transfers:
                assert spec.transfer_id not in self.seen_ids, f"transfer id {spec.transfer_id} reused"
                self.seen_ids.add(spec.transfer_id)
                delay = self.delay_steps + (self._rng.randint(0, self.jitter_steps) if self.jitter_steps else 0)
                for worker in range(self.num_workers):
                    if self.lose and self.lose(spec, worker):
                        self.num_lost += 1
                        continue
                    failed = bool(self.fail and self.fail(spec, worker))
                    self.num_failed += failed
                    self._due.append(_Due(self.step + delay + worker * self.stagger_steps, spec.transfer_id, worker, failed))
            for lease in meta.command.hot_leases:
                assert len(set(lease.block_ids)) == len(lease.block_ids)
        self.step += 1
        return self._report()

    def flush(self) -> KVConnectorOutput | None:
        """Everything still owed, as one report (used when the workload drained)."""
        for due in self._due:
            due.step = min(due.step, self.step - 1)
        return self._report()

    def has_pending(self) -> bool:
        return bool(self._due)

    def _report(self) -> KVConnectorOutput | None:
        due = [d for d in self._due if d.step <= self.step - 1]
        resent, self._resend = self._resend, []
        counts = self.hot_counts() if self.hot_counts is not None else {}
        if not due and not resent and not counts:
            return None
        self._due = [d for d in self._due if d.step > self.step - 1]
        if self.repeat:
            twice = [d for d in due if self.repeat(d.transfer_id, d.worker)]
            self.num_repeated += len(twice)
            self._resend = list(twice)
            due = due + twice
        due = due + resent
        if self.order == "reverse":
            due.reverse()
        elif self.order == "random":
            self._rng.shuffle(due)
        finished, failed_loads = set(), set()
        for d in due:
            rid = self._loads.get(d.transfer_id)
            if rid is None:
                continue
            vote = self._load_votes.setdefault(d.transfer_id, [set(), False])
            vote[0].add(d.worker)
            vote[1] |= d.failed
            if len(vote[0]) == self.num_workers:
                del self._load_votes[d.transfer_id], self._loads[d.transfer_id]
                finished.add(rid)
                if vote[1]:
                    failed_loads.add(rid)
        per_worker = []
        for worker in range(self.num_workers):
            mine = [d for d in due if d.worker == worker]
            acks = WorkerAcks(
                enqueued=[d.transfer_id for d in mine if self.report_enqueued and not d.failed],
                completed=[d.transfer_id for d in mine if not d.failed],
                failed=[d.transfer_id for d in mine if d.failed],
            )
            per_worker.append(HiSparseWorkerMetadata(acks=acks, worker_rank=worker))
        per_worker[0].hot_counts = counts
        meta = per_worker[0]
        for other in per_worker[1:]:
            meta = meta.aggregate(other)  # what vLLM's KVOutputAggregator does
        if self.multi_index is not None:
            _, _, multi_worker_meta = multi_connector_types()
            slots = [None] * self.multi_size
            slots[self.multi_index] = meta
            meta = multi_worker_meta(metadata=tuple(slots))
        return KVConnectorOutput(kv_connector_worker_meta=meta, finished_recving=finished or None,
                                 failed_recving=failed_loads)
