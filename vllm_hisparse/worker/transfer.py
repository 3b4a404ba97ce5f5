"""Transfer engine: executes spills, restores and row mirrors and reports their progress.

Each transfer carries an id chosen by the scheduler side. The engine reports an id twice, in
this order, through :meth:`TransferEngine.poll`:

* **enqueued**: the copy sits on the engine's copy stream. Later GPU work that the step fences
  (:meth:`TransferEngine.fence`) runs after it, so a spilled device block may be reused;
* **completed**: the copy's event has been observed: the destination bytes are valid (a host
  page may now be published and its source released).

A transfer whose launch raised is reported as **failed** (with the reason) and never as
completed; the scheduler side keeps the source copy and marks nothing valid.

On CUDA spills and restores run on a dedicated stream that first waits for the compute stream
(the bytes it reads were written by the forward), and each transfer records an event;
:meth:`TransferEngine.fence` makes the compute stream wait for that stream. A restore whose
pages the step's forward does not read (``fenced=False``: the scheduler shows them to the
worker only after their completion ack, e.g. a promotion's) runs on a second stream, which
first waits for the copy stream and the compute stream and which no fence covers: no step
waits for it (the copy kernel still shares the GPU with the steps it runs beside). Its id is reported enqueued and completed together, once done. Mirrors
(a step's newly written rows: a few µs of copy) run on the compute stream itself, after the
forward: a copy stream queued behind the forward's end stalls every launch of that forward
(the step's GPU gaps doubled on the H200 with one such stream per lane; docs/benchmarks.md,
"Where the all-FULL cost went"). On CPU (tests,
the simulator) copies run synchronously and an id is enqueued and completed at the same poll.

An engine built with ``writes_host=False`` (a tensor-parallel rank that maps a host pool another
rank writes, docs/worker.md "Tensor parallelism") copies nothing device → host: its spills and
mirrors are acknowledged (enqueued and completed, in submission order) without a copy, so the
scheduler still gets one report per worker; the host copy is valid once the writer's report
arrives too. Restores run on every engine.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections import deque
from typing import Callable, Sequence

import torch

from vllm_hisparse import ops

logger = logging.getLogger("vllm_hisparse.worker")


class TransferKind(enum.Enum):
    SPILL = "spill"  # whole pages, device -> host
    RESTORE = "restore"  # whole pages, host -> device
    MIRROR = "mirror"  # single rows, device -> host


@dataclasses.dataclass
class TransferReport:
    """Progress since the previous poll. Ids appear in ``enqueued`` before (or in the same
    report as) ``completed``; a failed id appears only in ``failed``."""

    enqueued: list[int] = dataclasses.field(default_factory=list)
    completed: list[int] = dataclasses.field(default_factory=list)
    failed: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    bytes_to_host: int = 0
    bytes_to_device: int = 0

    def __bool__(self) -> bool:
        return bool(self.enqueued or self.completed or self.failed)


@dataclasses.dataclass
class _InFlight:
    transfer_id: int
    event: torch.cuda.Event | None


class TransferEngine:
    """Copies between one device layer list and one host layer list (same layer order).

    Args:
        device_layers: L uint8 ``[device_rows, row_bytes]`` views of the device KV.
        host_layers: L uint8 ``[host_rows, row_bytes]`` views of the host pool.
        block_size: rows per page.
        ops_backend: ``"auto"``, ``"cuda"`` or ``"reference"`` (see :func:`ops.select`).
        fail_transfer: fault injection for tests and drills: called with each transfer id
            before launch; True makes that transfer fail as a failed launch would.
        writes_host: False on a rank that shares a host pool written by another rank:
            spills and mirrors are acknowledged without copying (see the module docstring).
    """

    def __init__(self, device_layers: Sequence[torch.Tensor], host_layers: Sequence[torch.Tensor],
                 block_size: int, *, ops_backend: str = "auto",
                 fail_transfer: Callable[[int], bool] | None = None,
                 writes_host: bool = True):
        if len(device_layers) != len(host_layers):
            raise ValueError(f"TransferEngine: {len(device_layers)} device layers but "
                             f"{len(host_layers)} host layers")
        self.device_layers = list(device_layers)
        self.host_layers = list(host_layers)
        self.block_size = block_size
        self.row_bytes = device_layers[0].shape[1] if device_layers else 0
        self._ops = ops.select(ops_backend)
        self._fail_transfer = fail_transfer
        self.writes_host = bool(writes_host)
        self.num_skipped_host_writes = 0  # spills / mirrors acknowledged without a copy
        self.device = device_layers[0].device if device_layers else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        # restores no step waits for (``fenced=False``): their own stream and queue
        self._background = torch.cuda.Stream(self.device) if self._cuda else None
        self._in_flight: deque[_InFlight] = deque()
        self._in_background: deque[_InFlight] = deque()
        self._report = TransferReport()
        # the copy stream's last event (fence) and the last mirror's, on the compute stream
        self._last_event: torch.cuda.Event | None = None
        self._last_mirror_event: torch.cuda.Event | None = None
        self._ids_in_use: set[int] = set()

    # ---------------------------------------------------------------- submit

    def spill(self, transfer_id: int, device_blocks: Sequence[int],
              host_blocks: Sequence[int]) -> None:
        """Copy whole pages device → host for every layer."""
        self._submit(transfer_id, TransferKind.SPILL, device_blocks, host_blocks)

    def restore(self, transfer_id: int, host_blocks: Sequence[int],
                device_blocks: Sequence[int], *, fenced: bool = True) -> None:
        """Copy whole pages host → device for every layer. ``fenced=False``: nothing on the
        compute stream waits for the copy (see the module docstring); the destination
        blocks must not be read or written until its completion is reported."""
        self._submit(transfer_id, TransferKind.RESTORE, host_blocks, device_blocks,
                     background=not fenced and self._cuda)

    def mirror(self, transfer_id: int, device_rows: Sequence[int],
               host_rows: Sequence[int]) -> None:
        """Copy single rows device → host for every layer (newly written KV)."""
        self._submit(transfer_id, TransferKind.MIRROR, device_rows, host_rows)

    def _submit(self, transfer_id: int, kind: TransferKind, src_ids: Sequence[int],
                dst_ids: Sequence[int], *, background: bool = False) -> None:
        if transfer_id in self._ids_in_use:
            raise ValueError(f"TransferEngine: transfer id {transfer_id} is already in flight")
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"TransferEngine: {kind.value} {transfer_id} has {len(src_ids)} "
                             f"sources but {len(dst_ids)} destinations")
        # Another rank writes the shared host pool: nothing to copy, acknowledge only.
        skip = not self.writes_host and kind is not TransferKind.RESTORE
        try:
            if self._fail_transfer is not None and self._fail_transfer(transfer_id):
                raise RuntimeError("injected failure")
            if not skip:
                self._launch(kind, src_ids, dst_ids, background)
        except Exception as exc:  # reported to the scheduler, which keeps the source copy
            logger.warning("transfer %d (%s) failed: %s", transfer_id, kind.value, exc)
            self._report.failed.append((transfer_id, f"{type(exc).__name__}: {exc}"))
            return
        moved = 0 if skip else len(src_ids) * len(self.device_layers) * self.row_bytes
        if kind is not TransferKind.MIRROR:
            moved *= self.block_size
        if kind is TransferKind.RESTORE:
            self._report.bytes_to_device += moved
        else:
            self._report.bytes_to_host += moved
        if not background:  # no later fenced work is ordered after a background copy
            self._report.enqueued.append(transfer_id)
        self.num_skipped_host_writes += skip
        event = None
        if self._cuda and not skip:
            event = torch.cuda.Event()
            event.record(self._stream_of(kind, background))
            if kind is TransferKind.MIRROR:
                self._last_mirror_event = event
            elif not background:
                self._last_event = event
        self._ids_in_use.add(transfer_id)
        (self._in_background if background else self._in_flight).append(
            _InFlight(transfer_id, event))

    def _launch(self, kind: TransferKind, src_ids: Sequence[int], dst_ids: Sequence[int],
                background: bool = False) -> None:
        index_device = self.device if self._cuda else torch.device("cpu")
        # Both id lists in one tensor: on CUDA one pinned copy (a step's mirrors are small).
        ids = torch.tensor([list(src_ids), list(dst_ids)], dtype=torch.int32).reshape(2, -1)
        src, dst = ids[0], ids[1]
        if kind is TransferKind.RESTORE:
            src_layers, dst_layers = self.host_layers, self.device_layers
        else:
            src_layers, dst_layers = self.device_layers, self.host_layers
        if not self._cuda:
            if kind is TransferKind.MIRROR:
                self._ops.mirror_rows(src_layers, dst_layers, src, dst)
            else:
                self._ops.copy_blocks(src_layers, dst_layers, src, dst, self.block_size)
            return
        stream = self._stream_of(kind, background)
        if stream != torch.cuda.current_stream(self.device):
            stream.wait_stream(torch.cuda.current_stream(self.device))  # what the forward wrote
        if background:  # an enqueued spill may still read a block handed to this restore
            stream.wait_stream(self._stream)
        with torch.cuda.stream(stream):
            ids = ids.pin_memory().to(index_device, non_blocking=True)
            src, dst = ids[0], ids[1]
            if kind is TransferKind.MIRROR:
                self._ops.mirror_rows(src_layers, dst_layers, src, dst)
            else:
                self._ops.copy_blocks(src_layers, dst_layers, src, dst, self.block_size)
            # The index tensors must outlive the copy: tie them to the copy stream.
            ids.record_stream(stream)

    def _stream_of(self, kind: TransferKind, background: bool = False) -> "torch.cuda.Stream":
        """Mirrors on the compute stream, spills and fenced restores on the copy stream, the
        other restores on the background stream."""
        if kind is TransferKind.MIRROR:
            return torch.cuda.current_stream(self.device)
        return self._background if background else self._stream

    # ---------------------------------------------------------------- progress

    def fence(self) -> None:
        """Make later work on the current (compute) stream run after every enqueued copy:
        restored pages are readable and spilled blocks may be overwritten."""
        if self._cuda and self._last_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._last_event)

    def poll(self) -> TransferReport:
        """Progress since the last poll; never blocks."""
        for queue, background in ((self._in_flight, False), (self._in_background, True)):
            while queue:
                head = queue[0]
                if head.event is not None and not head.event.query():
                    break  # copies complete in stream order: nothing behind it is done either
                queue.popleft()
                self._ids_in_use.discard(head.transfer_id)
                if background:
                    self._report.enqueued.append(head.transfer_id)
                self._report.completed.append(head.transfer_id)
        report, self._report = self._report, TransferReport()
        return report

    def wait_all(self) -> TransferReport:
        """Block until every enqueued copy has completed, then poll."""
        if self._cuda and self._stream is not None:
            self._stream.synchronize()
            self._background.synchronize()
        if self._last_mirror_event is not None:
            self._last_mirror_event.synchronize()
        return self.poll()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight) + len(self._in_background)
