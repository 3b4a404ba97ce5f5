"""A fault-injecting fake of the worker role's acks, for the real scheduler on CPU.

Like ``FakeWorker`` (the harness's well-behaved fake) it reads each step's
``HiSparseConnectorMetadata`` from the ``SchedulerOutput`` and answers with the
``KVConnectorOutput`` the real worker role (``vllm_hisparse.vllm.worker_side.role``) would
send: per-worker ``WorkerAcks`` under each worker's ``worker_rank``, aggregated the way
vLLM's ``KVOutputAggregator`` does, and each host-prefix load (``metadata.load_requests``)
per request: in ``finished_recving`` once every worker reported its RESTORE, in
``failed_recving`` too if one failed it (``get_transfer_results``). Only the copies are fake.

Fault kinds (``kinds``, any subset of :data:`WORKER_FAULTS`), drawn per (transfer, worker)
from one seeded RNG:

* ``delay``: the report comes ``0..max_delay_steps`` steps late (independently per
  worker), and a spill's ``enqueued`` ack may come before its completion;
* ``shuffle``: the order within each list of a report, and of the workers, is random;
* ``fail``: a copy fails (never a host-prefix load: that is ``fail_prefix_load``);
* ``fail_prefix_load``: a host-prefix RESTORE fails after the forward read its blocks;
* ``duplicate``: a completion is reported twice, in one report or a few steps apart;
* ``lost``: a worker never reports the transfer.

It also checks what a real worker relies on (every transfer id new, every hot lease's
blocks distinct) and, through :meth:`early_closes`, that the scheduler never treats a
transfer as finished while a worker that will still report it has not (with private
per-rank pools a host block would be published before its copy exists).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from vllm.v1.outputs import KVConnectorOutput

from vllm_hisparse.core.commands import TransferKind, WorkerAcks
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata

#: Every fault kind the worker can inject.
WORKER_FAULTS = frozenset({"delay", "shuffle", "fail", "fail_prefix_load", "duplicate", "lost"})


@dataclass(frozen=True)
class FaultRates:
    """Probabilities per (transfer, worker) and the largest delay, in steps."""

    max_delay_steps: int = 4
    enqueued_early: float = 0.3
    fail: float = 0.03
    fail_prefix_load: float = 0.3
    duplicate: float = 0.05
    lost: float = 0.01


@dataclass
class _Report:
    step: int
    kind: str  # "enqueued", "completed" or "failed"
    transfer_id: int
    worker: int


class FaultWorker:
    """Acks with injected faults; ``counts`` tallies every fault injected, by kind."""

    def __init__(self, *, kinds: frozenset[str], num_workers: int = 1, seed: int = 0,
                 rates: FaultRates = FaultRates()) -> None:
        unknown = set(kinds) - WORKER_FAULTS
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; accepted: {sorted(WORKER_FAULTS)}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.kinds = frozenset(kinds)
        self.num_workers = num_workers
        self.rates = rates
        self.multi_index: int | None = None  # the harness sets it under MultiConnector (unused)
        self._rng = random.Random(seed)
        self.step = 0
        self.counts: Counter[str] = Counter()
        self._seen_ids: set[int] = set()
        self._due: list[_Report] = []
        # transfer id -> workers whose first completed/failed report is still owed.
        self._owed: dict[int, set[int]] = {}
        self._failed: set[int] = set()  # ids some worker reported failed
        self._lost: set[int] = set()  # ids some worker will never report
        self._loads: dict[int, str] = {}  # host-prefix RESTORE id -> request id
        self._load_votes: dict[int, list] = {}  # RESTORE id -> [workers reported, failed]

    # ------------------------------------------------------------------ the step
    def on_forward(self, scheduler_output) -> KVConnectorOutput | None:
        """Accept the step's transfers; return the reports due with this step's output."""
        meta = scheduler_output.kv_connector_metadata
        if meta is not None:
            assert isinstance(meta, HiSparseConnectorMetadata), type(meta)
            for lease in meta.command.hot_leases:
                assert len(set(lease.block_ids)) == len(lease.block_ids), lease
            for spec in meta.command.transfers:
                self._accept(meta, spec)
        self.step += 1
        return self._report()

    def _accept(self, meta: HiSparseConnectorMetadata, spec) -> None:
        tid = spec.transfer_id
        assert tid not in self._seen_ids, f"transfer id {tid} reused"
        self._seen_ids.add(tid)
        rng, rates, kinds = self._rng, self.rates, self.kinds
        prefix_load = tid in meta.load_requests
        if prefix_load:
            assert spec.kind == TransferKind.RESTORE, spec
            self._loads[tid] = meta.load_requests[tid]
        owed = self._owed[tid] = set()
        for worker in range(self.num_workers):
            if "lost" in kinds and rng.random() < rates.lost:
                self.counts["lost"] += 1
                self._lost.add(tid)
                continue
            owed.add(worker)
            delay = rng.randint(0, rates.max_delay_steps) if "delay" in kinds else 0
            self.counts["delay"] += delay > 0
            at = self.step + delay
            if prefix_load:
                failed = "fail_prefix_load" in kinds and rng.random() < rates.fail_prefix_load
                self.counts["fail_prefix_load"] += failed
            else:
                failed = "fail" in kinds and rng.random() < rates.fail
                self.counts["fail"] += failed
            if failed:
                self._due.append(_Report(at, "failed", tid, worker))
                continue
            if spec.kind == TransferKind.SPILL and delay > 0 and rng.random() < rates.enqueued_early:
                self._due.append(_Report(self.step + rng.randint(0, delay - 1), "enqueued", tid, worker))
            self._due.append(_Report(at, "completed", tid, worker))
            if "duplicate" in kinds and rng.random() < rates.duplicate:
                self.counts["duplicate"] += 1
                self._due.append(_Report(at + rng.randint(0, 2), "completed", tid, worker))
        if not owed:
            del self._owed[tid]

    def _report(self) -> KVConnectorOutput | None:
        now = self.step - 1
        due = [r for r in self._due if r.step <= now]
        if not due:
            return None
        self._due = [r for r in self._due if r.step > now]
        workers = list(range(self.num_workers))
        if "shuffle" in self.kinds:
            self._rng.shuffle(due)
            self._rng.shuffle(workers)
            self.counts["shuffle"] += len(due) > 1
        meta = None
        finished: set[str] = set()
        failed_loads: set[str] = set()
        for worker in workers:
            lists: dict[str, list[int]] = {"enqueued": [], "completed": [], "failed": []}
            for r in due:
                if r.worker == worker:
                    lists[r.kind].append(r.transfer_id)
                    self._delivered(r)
                    self._vote_load(r, finished, failed_loads)
            mine = HiSparseWorkerMetadata(acks=WorkerAcks(**lists), worker_rank=worker)
            meta = mine if meta is None else meta.aggregate(mine)
        return KVConnectorOutput(kv_connector_worker_meta=meta, finished_recving=finished or None,
                                 failed_recving=failed_loads)

    def _vote_load(self, report: _Report, finished: set[str], failed_loads: set[str]) -> None:
        """A host-prefix load is decided for vLLM once every worker reported it final
        (a duplicate report counts once)."""
        rid = self._loads.get(report.transfer_id)
        if rid is None or report.kind == "enqueued":
            return
        vote = self._load_votes.setdefault(report.transfer_id, [set(), False])
        vote[0].add(report.worker)
        vote[1] |= report.kind == "failed"
        if len(vote[0]) == self.num_workers:
            del self._load_votes[report.transfer_id], self._loads[report.transfer_id]
            finished.add(rid)
            if vote[1]:
                failed_loads.add(rid)

    def _delivered(self, report: _Report) -> None:
        if report.kind == "enqueued":
            return
        if report.kind == "failed":
            self._failed.add(report.transfer_id)
        owed = self._owed.get(report.transfer_id)
        if owed is not None:
            owed.discard(report.worker)
            if not owed:
                del self._owed[report.transfer_id]

    # ------------------------------------------------------------------ queries
    def has_pending(self) -> bool:
        return bool(self._due)

    def flush(self) -> KVConnectorOutput | None:
        """Everything still owed (lost reports stay lost), as one report."""
        for report in self._due:
            report.step = min(report.step, self.step - 1)
        return self._report()

    def early_closes(self, open_ids) -> list[tuple[int, list[int]]]:
        """Transfers the scheduler closed although a worker that will still report them
        has not, and none failed them or went silent: ``[(id, workers owed)]``.
        ``open_ids`` answers ``in`` with the scheduler's open transfer ids."""
        return [(tid, sorted(owed)) for tid, owed in self._owed.items()
                if tid not in open_ids and tid not in self._failed and tid not in self._lost]
