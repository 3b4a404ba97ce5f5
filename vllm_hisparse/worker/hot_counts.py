"""Per-request miss counts for adaptive hot regions (``core/hot_regions.py``).

After each resolve, :meth:`RowHotCounts.add` adds, per state row, the misses the resolve
planned and the host-backed selections it saw into one int64 ``[R, 2]`` device tensor
(a gather and one ``index_add_``: no host sync, nothing sized by the batch kept, so a CUDA
graph may capture it). The connector's worker counts the resolves of its first index group
only: one group's rate samples the request's (the sizing decides over windows of steps), and
counting every group would add a handful of small kernels to every sparse layer. :meth:`RowHotCounts.poll` reads it the way the
connector reads its other counters (:class:`AsyncCounterReader`: a copy behind an event,
taken one poll later) and returns what changed since the previous poll.

References are counted per selection: one decode token selects distinct positions, so for
a request of one query token they are its distinct host-backed positions exactly; with
speculative tokens a position two tokens select counts twice (the rate reads lower).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_hisparse.worker.counter_reader import AsyncCounterReader


class RowHotCounts:
    """Cumulative ``(misses, host-backed references)`` per state row, on the device.

    Args:
        num_state_rows: R, rows of the per-request tables.
        device: where the counters live (the hot states' device).
    """

    def __init__(self, num_state_rows: int, device: torch.device | str = "cpu"):
        self.counts = torch.zeros((num_state_rows, 2), dtype=torch.int64, device=device)
        self._reader = AsyncCounterReader([self.counts])
        self._reported = np.zeros((num_state_rows, 2), dtype=np.int64)

    def add(self, topk: torch.Tensor, token_rows: torch.Tensor, residency: torch.Tensor,
            miss_count: torch.Tensor, block_size: int) -> None:
        """Count one resolve: ``topk`` int32 ``[T, K]`` (-1 padding), ``token_rows`` int32
        ``[T]`` (-1 padding token), ``residency`` int32 ``[R, P]`` (-1 = page not resident),
        ``miss_count`` int32 ``[T]`` (the resolve's copies per token row)."""
        if topk.shape[0] == 0:
            return
        rows = token_rows.long()
        safe = rows.clamp(min=0)
        pages = (topk.long().clamp(min=0) // block_size).clamp(max=residency.shape[1] - 1)
        host_backed = (topk >= 0) & (residency[safe.unsqueeze(1), pages] < 0)
        both = torch.stack([miss_count.long(), host_backed.sum(1)], dim=1)
        self.counts.index_add_(0, safe, both * (rows >= 0).unsqueeze(1))

    def poll(self, sync: bool = False) -> dict[int, tuple[int, int]]:
        """``{state row: (misses, references)}`` counted since the previous poll, rows with
        references only. Never blocks unless ``sync`` (shutdown, tests)."""
        values = (self._reader.read_now() if sync else self._reader.poll()).reshape(-1, 2)
        delta = values - self._reported
        self._reported = values
        rows = np.nonzero(delta[:, 1] > 0)[0]
        return {int(r): (int(delta[r, 0]), int(delta[r, 1])) for r in rows}
