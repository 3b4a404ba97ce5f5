"""The page tables of one lane: where each page of each request's KV lives.

A page is resident in every sparse layer of a KV cache group or in none, so the index groups
of one lane (one :class:`~vllm_hisparse.worker.hot_state.HotState` each) share one
:class:`PageTables`: the step executor writes a step's page changes into it once, however
many index groups read it (one per layer for DeepSeek-V3.2 and GLM-5.1).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class PageTables:
    """``residency`` and ``host_blocks``: int32 ``[R, P]`` (state row, page) → the page's
    device block / host block, -1 = none. ``resolve`` reads both.

    Args:
        num_state_rows: R (vLLM ``max_num_seqs``).
        max_pages: P, pages of the longest request.
        device: where the tables live (the GPU in production, CPU in tests).
    """

    def __init__(self, num_state_rows: int, max_pages: int, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        # One storage for both tables, so that a step's update is one write.
        self._tables = torch.full((2, num_state_rows, max_pages), -1, dtype=torch.int32,
                                  device=self.device)
        self.residency = self._tables[0]
        self.host_blocks = self._tables[1]

    def _stage(self, *columns: Sequence[int]) -> torch.Tensor:
        """int64 ``[len(columns), n]`` on the tables' device in one copy (pinned on CUDA)."""
        if len({len(c) for c in columns}) != 1:
            raise ValueError(f"PageTables: columns of lengths {[len(c) for c in columns]}")
        staged = torch.from_numpy(np.asarray(columns, dtype=np.int64).reshape(len(columns), -1))
        if self.device.type != "cuda":
            return staged
        return staged.pin_memory().to(self.device, non_blocking=True)

    def update(self, rows: Sequence[int], pages: Sequence[int], device_blocks: Sequence[int],
               host_blocks: Sequence[int]) -> None:
        """``residency[rows[i], pages[i]] = device_blocks[i]`` (-1 releases the page) and
        ``host_blocks[rows[i], pages[i]] = host_blocks[i]``: one copy, one write (this runs
        every step: the int64 indices and the int32 values travel in one buffer, so that no
        conversion kernel runs on the device, and both tables are one tensor)."""
        n = len(rows)
        if not n:
            return
        lengths = [n, len(pages), len(device_blocks), len(host_blocks)]
        if set(lengths) != {n}:
            raise ValueError(f"PageTables: columns of lengths {lengths}")
        # int64 [3, 2n] (table, row, page), then int32 [2n] values; residency first.
        staged = np.empty(56 * n, dtype=np.uint8)
        index = staged[:48 * n].view(np.int64).reshape(3, 2 * n)
        index[0, :n], index[0, n:] = 0, 1
        index[1, :n] = index[1, n:] = rows
        index[2, :n] = index[2, n:] = pages
        values = staged[48 * n:].view(np.int32)
        values[:n], values[n:] = device_blocks, host_blocks
        buf = torch.from_numpy(staged)
        if self.device.type == "cuda":
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        which, r, p = buf[:48 * n].view(torch.int64).view(3, 2 * n)
        self._tables.index_put_((which, r, p), buf[48 * n:].view(torch.int32))

    def set_pages(self, rows: Sequence[int], pages: Sequence[int],
                  device_blocks: Sequence[int]) -> None:
        """``residency[rows[i], pages[i]] = device_blocks[i]`` (-1 releases the page)."""
        if len(rows):
            r, p, d = self._stage(rows, pages, device_blocks)
            self.residency.index_put_((r, p), d.to(torch.int32))

    def set_host_blocks(self, rows: Sequence[int], pages: Sequence[int],
                        host_blocks: Sequence[int]) -> None:
        """``host_blocks[rows[i], pages[i]] = host_blocks[i]``."""
        if len(rows):
            r, p, h = self._stage(rows, pages, host_blocks)
            self.host_blocks.index_put_((r, p), h.to(torch.int32))

    def clear_rows(self, rows: Sequence[int]) -> None:
        """Every page of ``rows`` back to none (requests finished, aborted or preempted)."""
        if len(rows):
            (r,) = self._stage(rows)
            self._tables.index_fill_(1, r, -1)
