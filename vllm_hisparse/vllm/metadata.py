"""What crosses the scheduler ↔ worker boundary each step, in vLLM's connector types.

* scheduler → worker: :class:`HiSparseConnectorMetadata` wraps the core policy's
  :class:`~vllm_hisparse.core.StepCommand` for the step (ids only);
* worker → scheduler: :class:`HiSparseWorkerMetadata` wraps the
  :class:`~vllm_hisparse.core.WorkerAcks` observed since the previous step. With several
  workers (tensor parallel) vLLM aggregates them; a transfer counts as completed only when
  every worker completed it, and as failed when any worker failed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_hisparse.core.commands import StepCommand, WorkerAcks
from vllm_hisparse.vllm.compat import KVConnectorMetadata, KVConnectorWorkerMetadata


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
    sparse-MLA KV cache group. With several sparse groups (``kv_planning`` splits a
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


@dataclass
class HiSparseWorkerMetadata(KVConnectorWorkerMetadata):
    """Transfer acks of one worker (or, after :meth:`aggregate`, of all of them)."""

    acks: WorkerAcks = field(default_factory=WorkerAcks)
    num_workers: int = 1
    # Ids of MIRROR transfers whose indexer page saves failed on this worker: their
    # pages must not be published (a later hit could not load their indexer KV).
    failed_indexer_saves: list[int] = field(default_factory=list)

    def aggregate(self, other: "HiSparseWorkerMetadata") -> "HiSparseWorkerMetadata":
        """Combine two workers' reports.

        An id is failed if either failed it. Completion must be unanimous: an id is
        completed only after every worker reported it, so partial completions are kept as
        ``pending`` counts by the scheduler side (see ``connector_scheduler.py``); here the
        reports are simply concatenated and the worker count summed, and the scheduler
        counts completions per id against ``num_workers``.
        """
        return HiSparseWorkerMetadata(
            acks=WorkerAcks(enqueued=self.acks.enqueued + other.acks.enqueued,
                            completed=self.acks.completed + other.acks.completed,
                            failed=self.acks.failed + other.acks.failed),
            num_workers=self.num_workers + other.num_workers,
            failed_indexer_saves=self.failed_indexer_saves + other.failed_indexer_saves)
