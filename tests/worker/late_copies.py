"""A slow copy stream on one rank, on CPU: :class:`LateCompletions` makes a
``TransferEngine`` complete every transfer ``polls`` polls after it was submitted.

On a GPU a device → host copy reads its source in stream order (before any later work of the
rank overwrites it) but its bytes are in host memory only by the time its event completes;
another rank that reads the host rows earlier sees stale bytes. On CPU copies are synchronous,
so a protocol that let a reader in before the writer's completion would still read the right
bytes. This helper restores the GPU's timing: a device → host copy snapshots its source at
submission and lands in host memory when it completes, ``polls`` polls later. Host → device
copies (restores) run at once, as the rank's own fence orders them before its forward; only
their completion report is late. A rank that does not write the host pool
(``writes_host=False``) copies nothing; its acknowledgements come late all the same.

Every completion is stamped with a sequence number shared by all instances (``SEQUENCE``), so
a test can check that whoever consumes acks (the scheduler's vote) acted only after every rank
reported."""

from __future__ import annotations

import itertools
from collections import deque

import torch

from vllm_hisparse.worker.transfer import TransferEngine, TransferKind

#: Shared by every instance: orders completions on different ranks against other events.
SEQUENCE = itertools.count()


class _Due:
    """Stands in for a copy's CUDA event: done once the engine was polled ``due`` times."""

    def __init__(self, late: "LateCompletions", due: int):
        self.late, self.due = late, due

    def query(self) -> bool:
        return self.late.polls >= self.due


class LateCompletions:
    """Wraps ``engine`` (CPU) in place; see the module docstring.

    Attributes:
        completed_at: transfer id -> ``SEQUENCE`` number of the poll that reported it complete.
        landed: device → host copies whose bytes landed late (at their completion).
    """

    def __init__(self, engine: TransferEngine, polls: int):
        if engine.device.type != "cpu":
            raise ValueError("LateCompletions models a slow copy stream on CPU only")
        self.engine, self.lag, self.polls = engine, polls, 0
        self.completed_at: dict[int, int] = {}
        self.landed = 0
        self._landings: deque[tuple[int, list[torch.Tensor], torch.Tensor]] = deque()
        self._submit, self._launch = engine._submit, engine._launch
        self._poll = engine.poll
        self._tid = -1
        engine._submit, engine._launch = self.submit, self.launch
        engine.poll, engine.wait_all = self.poll, self.wait_all

    def submit(self, transfer_id, kind, src_ids, dst_ids, *, background=False) -> None:
        self._tid = transfer_id
        self._submit(transfer_id, kind, src_ids, dst_ids, background=background)
        flight = self.engine._in_flight
        if flight and flight[-1].transfer_id == transfer_id:
            flight[-1].event = _Due(self, self.polls + self.lag)

    def launch(self, kind, src_ids, dst_ids, background=False) -> None:
        if kind is TransferKind.RESTORE:
            self._launch(kind, src_ids, dst_ids, background)
            return
        src = torch.as_tensor(list(src_ids), dtype=torch.int64)
        dst = torch.as_tensor(list(dst_ids), dtype=torch.int64)
        keep = (src >= 0) & (dst >= 0)  # -1 on either side: skipped, as by the ops
        src, dst = src[keep], dst[keep]
        if kind is TransferKind.SPILL:  # whole pages: every row of each block
            offsets = torch.arange(self.engine.block_size)
            src = (src[:, None] * self.engine.block_size + offsets).reshape(-1)
            dst = (dst[:, None] * self.engine.block_size + offsets).reshape(-1)
        # Read now (stream order), land at completion.
        data = [layer[src].clone() for layer in self.engine.device_layers]
        self._landings.append((self.polls + self.lag, data, dst))

    def _land(self, upto: int) -> None:
        while self._landings and self._landings[0][0] <= upto:
            _, data, dst = self._landings.popleft()
            for layer, rows in zip(self.engine.host_layers, data):
                layer[dst] = rows
            self.landed += 1

    def poll(self, *, everything: bool = False):
        self.polls += 1 << 40 if everything else 1
        self._land(self.polls)
        report = self._poll()
        for tid in report.completed:
            self.completed_at[tid] = next(SEQUENCE)
        return report

    def wait_all(self):
        return self.poll(everything=True)
