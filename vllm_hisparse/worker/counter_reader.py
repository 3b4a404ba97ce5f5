"""Reading small device counters without stalling the GPU.

vLLM asks the connector for its stats after every forward. Reading a CUDA tensor with
``.tolist()`` there would wait for the whole step's GPU work each time. Instead,
:class:`AsyncCounterReader` queues, on the current stream, a copy of the counters into a
pinned host buffer and records an event; a later :meth:`~AsyncCounterReader.poll` takes the
copy once the event has completed (``Event.query``, which never blocks) and queues the next
one. Values therefore arrive one poll late (or later, if the GPU is still behind). The
counters are cumulative, so a late value is never a lost one.

On CPU the copy is immediate, but the one-poll lag is kept so that tests see the same
semantics as the GPU. No vLLM import.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class AsyncCounterReader:
    """Non-blocking reader of int64 device counters.

    Args:
        sources: int64 tensors on one device (e.g. every ``HotState.stats``); read in order
            and concatenated.
    """

    def __init__(self, sources: Sequence[torch.Tensor]):
        if not sources:
            raise ValueError("AsyncCounterReader: need at least one counter tensor")
        devices = {t.device for t in sources}
        if len(devices) != 1 or any(t.dtype != torch.int64 for t in sources):
            raise ValueError("AsyncCounterReader: counters must be int64 tensors on one device")
        self.sources = list(sources)
        self.device = devices.pop()
        self._cuda = self.device.type == "cuda"
        n = sum(t.numel() for t in self.sources)
        self._staging = torch.empty(n, dtype=torch.int64, device=self.device)
        self._host = torch.zeros(n, dtype=torch.int64, pin_memory=self._cuda)
        self._event = torch.cuda.Event() if self._cuda else None
        self._pending = False
        self._latest = np.zeros(n, dtype=np.int64)
        self.num_snapshots = 0

    def _queue(self) -> None:
        torch.cat([t.reshape(-1) for t in self.sources], out=self._staging)
        self._host.copy_(self._staging, non_blocking=self._cuda)
        if self._event is not None:
            self._event.record()
        self._pending = True
        self.num_snapshots += 1

    def _landed(self) -> bool:
        return self._pending and (self._event is None or self._event.query())

    def poll(self) -> np.ndarray:
        """Take the queued copy if it has landed, queue a new one when none is in flight,
        and return the newest landed values (int64 ``[n]``, a copy). Never blocks."""
        if self._landed():
            self._latest = self._host.numpy().copy()
            self._pending = False
        if not self._pending:
            self._queue()
        return self._latest.copy()

    def read_now(self) -> np.ndarray:
        """The current values (waits for the device: shutdown, tests). Resets the lag."""
        if self._event is not None and self._pending:
            self._event.synchronize()
        self._pending = False
        values = torch.cat([t.reshape(-1) for t in self.sources]).cpu().numpy().copy()
        self._latest = values
        return values.copy()
