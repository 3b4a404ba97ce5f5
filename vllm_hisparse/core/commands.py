"""The scheduler → worker step command and the worker → scheduler acknowledgements.

Both are plain dataclasses of ints and lists of ints (request ids are strings), so they
pickle, cross process boundaries cheaply and round-trip through JSON via ``to_dict`` /
``from_dict``. They carry ids only, never tensors.

Worker contract for one :class:`StepCommand`, in order:

1. apply ``cleared_rows`` (every page of those rows: not resident, no host block, hot
   state reset), then ``page_updates`` to its ``residency`` / ``host_blocks`` tables, then
   ``hot_leases`` (a new lease resets that row's hot slots; a resize keeps the slots of the
   blocks it keeps and empties the others);
2. launch transfers with ``after_forward == False`` before the step's forward, which waits
   for those with ``forward_reads`` (and for earlier spills, whose blocks it may reuse);
3. run the forward;
4. launch transfers with ``after_forward == True`` (page spills of pages the forward
   sealed, and the ``MIRROR`` of the rows it wrote);
5. report each transfer id in :class:`WorkerAcks`: ``enqueued`` once it is on the
   worker's stream ahead of any later command's work (optional), then ``completed``
   once its event was observed, or ``failed``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import IntEnum


class TransferKind(IntEnum):
    """Direction and granularity of a transfer."""

    SPILL = 0
    """Whole pages device → host (``device_blocks[i]`` → ``host_blocks[i]``)."""
    RESTORE = 1
    """Whole pages host → device (``host_blocks[i]`` → ``device_blocks[i]``)."""
    MIRROR = 2
    """Rows written by this step's forward, device → host: for each ``i``, positions
    ``[mirror_starts[i], mirror_ends[i])`` of state row ``mirror_rows[i]``, through the
    worker's page tables."""


class Residency(IntEnum):
    """Request-level residency (docs/core.md, "The state machine")."""

    FULL = 0
    """Every page resident on the device; no hot region."""
    MIXED = 1
    """Hot region held; clean non-tail pages may be host-only; entered from FULL."""
    NONE = 2
    """Hot region held; entered from the host tier (import, resume, host prefix hit):
    only the tail pages were made resident."""


@dataclass
class TransferSpec:
    """One transaction: a batch of page copies, or this step's row mirror.

    ``forward_reads`` (RESTORE): this step's forward reads the destination pages (a host
    prefix loaded into pages the engine already gave the request). False for every other
    restore: its pages reach the worker's tables only in a command after its completion
    ack, so the forward has no reason to wait for the copy.
    """

    transfer_id: int
    kind: int
    after_forward: bool
    device_blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    mirror_rows: list[int] = field(default_factory=list)
    mirror_starts: list[int] = field(default_factory=list)
    mirror_ends: list[int] = field(default_factory=list)
    forward_reads: bool = True


@dataclass
class HotLease:
    """A row's hot region changed: ``block_ids`` leased (empty list = lease released).

    ``resize=False``: a new region, every slot empty. ``resize=True``: the same region grown
    or shrunk in whole blocks (``block_ids`` keeps the old list as a prefix, or is a prefix
    of it); slots of the kept blocks keep their positions, slots past ``block_ids`` are
    emptied and their table entries set to -1 (``resolve`` never takes them).
    """

    row: int
    block_ids: list[int]
    resize: bool = False


@dataclass
class ResidencyChange:
    """A request changed residency state (for metrics and the worker's fast paths)."""

    request_id: str
    row: int
    residency: int


@dataclass
class StepCommand:
    """Everything the worker must do for one scheduler step (ids only)."""

    step_id: int
    cleared_rows: list[int] = field(default_factory=list)
    # Parallel lists: worker tables get residency[row, page] = device_block and
    # host_blocks[row, page] = host_block (-1 = none).
    page_rows: list[int] = field(default_factory=list)
    page_indices: list[int] = field(default_factory=list)
    page_device_blocks: list[int] = field(default_factory=list)
    page_host_blocks: list[int] = field(default_factory=list)
    hot_leases: list[HotLease] = field(default_factory=list)
    residency_changes: list[ResidencyChange] = field(default_factory=list)
    transfers: list[TransferSpec] = field(default_factory=list)

    @property
    def num_page_updates(self) -> int:
        """Number of page-table entries this command rewrites."""
        return len(self.page_rows)

    def is_empty(self) -> bool:
        """True when the worker has nothing to do beyond the forward."""
        return not (
            self.cleared_rows or self.page_rows or self.hot_leases or self.residency_changes or self.transfers
        )

    def to_dict(self) -> dict:
        """JSON-able form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StepCommand":
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        data["hot_leases"] = [HotLease(**x) for x in data.get("hot_leases", [])]
        data["residency_changes"] = [ResidencyChange(**x) for x in data.get("residency_changes", [])]
        data["transfers"] = [TransferSpec(**x) for x in data.get("transfers", [])]
        return cls(**data)


@dataclass
class WorkerAcks:
    """Transfer outcomes the worker observed since its last report.

    Rules: ``enqueued`` is optional and comes before (or together with) ``completed`` or
    ``failed`` for the same id; ``completed`` and ``failed`` are final and exclusive;
    ids of different transfers may come in any order.
    """

    enqueued: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)

    def is_empty(self) -> bool:
        """True when nothing is reported."""
        return not (self.enqueued or self.completed or self.failed)

    def to_dict(self) -> dict:
        """JSON-able form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "WorkerAcks":
        """Inverse of :meth:`to_dict`."""
        return cls(**data)
