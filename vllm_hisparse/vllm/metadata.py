"""What crosses the scheduler ↔ worker boundary each step, in vLLM's connector types.

* scheduler → worker: :class:`HiSparseConnectorMetadata` wraps the core policy's
  :class:`~vllm_hisparse.core.StepCommand` for the step (ids only);
* worker → scheduler: :class:`HiSparseWorkerMetadata` wraps the
  :class:`~vllm_hisparse.core.WorkerAcks` observed since the previous step, with the
  worker's rank. With several workers (tensor parallel) vLLM aggregates them; the
  scheduler votes per (transfer, worker): completed once every worker completed it,
  failed once every worker reported it and one failed (``core.ack_vote``). With adaptive
  hot regions it also carries the per-row miss counts of rank 0 (``hot_counts``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_hisparse.core.commands import StepCommand, WorkerAcks
from vllm_hisparse.vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm_hisparse.vllm.pd.import_order import Heartbeat, ImportOrder


@dataclass
class IndexerPages:
    """Whole indexer pages that ride with one of the command's transfers.

    ``device_blocks[g][i]`` is page ``i``'s block in the ``g``-th indexer KV cache group
    and ``host_blocks[i]`` its host block. ``to_host``: saved after the forward, before
    the step's ``MIRROR`` (so the mirror's completion implies theirs); otherwise loaded
    before the forward, with the ``RESTORE`` of a host-prefix hit.
    """

    device_blocks: list[list[int]]
    host_blocks: list[int]
    to_host: bool


@dataclass
class HiSparseConnectorMetadata(KVConnectorMetadata):
    """The step's command for every worker.

    ``command`` names a page's device block by its *lead* block: the block of the first
    sparse-MLA KV cache group. With several sparse groups (``kv_planner`` splits a
    DSA model's sparse layers into up to 8), ``bundles`` gives, for every lead block the
    command mentions, the block of each sparse group in group order (empty with one
    sparse group: the lead block is the only one). ``new_rows`` maps the requests the
    policy started tracking this step to their state rows.
    """

    command: StepCommand
    new_rows: dict[str, int] = field(default_factory=dict)
    bundles: dict[int, list[int]] = field(default_factory=dict)
    # Transfer id -> indexer pages copied with it (host-prefix publication and loads).
    indexer_pages: dict[int, IndexerPages] = field(default_factory=dict)
    #: RESTORE id -> the request whose host-prefix hit it loads (an asynchronous load:
    #: the worker reports the request in ``finished_recving`` / ``failed_recving``).
    load_requests: dict[int, str] = field(default_factory=dict)
    #: P/D imports that start this step (``pd/landings.py``): every worker reads its share and
    #: reports the request in ``finished_recving``.
    imports: list[ImportOrder] = field(default_factory=list)
    #: Prefill leases to renew now (P/D requests waiting here or being read).
    heartbeats: list[Heartbeat] = field(default_factory=list)


@dataclass
class HiSparseWorkerMetadata(KVConnectorWorkerMetadata):
    """Transfer acks of one worker, by its rank; after :meth:`aggregate`, of several.

    vLLM's ``KVOutputAggregator`` folds the workers' reports with :meth:`aggregate`; each
    report keeps its rank (``peers``), so the scheduler votes per (transfer, worker)
    (``core.ack_vote``): a worker repeating a completion never stands in for another.
    """

    acks: WorkerAcks = field(default_factory=WorkerAcks)
    #: The reporting worker's rank in its replica, ``0 .. world_size - 1``.
    worker_rank: int = 0
    # Ids of MIRROR transfers whose indexer page saves failed on this worker: their
    # pages must not be published (a later hit could not load their indexer KV).
    failed_indexer_saves: list[int] = field(default_factory=list)
    #: Reports of the other workers folded in by :meth:`aggregate` (their own ``peers``
    #: empty).
    peers: list["HiSparseWorkerMetadata"] = field(default_factory=list)
    #: Adaptive hot regions: ``{state row: (misses, host-backed references)}`` since the
    #: last report. Only rank 0 fills it: tensor-parallel ranks resolve the same
    #: selections, so one rank's counts stand for the replica (a sum would double them).
    hot_counts: dict[int, tuple[int, int]] = field(default_factory=dict)

    def aggregate(self, other: "HiSparseWorkerMetadata") -> "HiSparseWorkerMetadata":
        """Both workers' reports, each under its rank (nothing is counted here)."""
        return HiSparseWorkerMetadata(
            acks=self.acks, worker_rank=self.worker_rank,
            failed_indexer_saves=self.failed_indexer_saves + other.failed_indexer_saves,
            peers=[*self.peers, other.solo(), *other.peers],
            hot_counts=self.hot_counts or other.hot_counts)

    def solo(self) -> "HiSparseWorkerMetadata":
        """This worker's own report, without peers."""
        return HiSparseWorkerMetadata(acks=self.acks, worker_rank=self.worker_rank)

    def reports(self) -> list[tuple[int, WorkerAcks]]:
        """``(worker rank, acks)`` of every worker folded in."""
        return [(self.worker_rank, self.acks), *((p.worker_rank, p.acks) for p in self.peers)]
