"""Per-index-group residency tables and hot-region state, and the resolve + gather step.

One :class:`HotState` exists per index group (a layer that runs the indexer plus the layers
that reuse its top-k). Every table is indexed by **state row** (the request's persistent row,
never its batch position):

| table | dtype, shape | meaning |
|---|---|---|
| ``residency`` | int32 ``[R, P]`` | device block of each resident page, -1 = not resident |
| ``host_blocks`` | int32 ``[R, P]`` | host block of each page, -1 = none |
| ``hot_blocks`` | int32 ``[R, D / bs]`` | device blocks of the hot region, -1 = no region |
| ``slot_pos`` | int32 ``[R, D]`` | position held by each hot slot, -1 = empty |
| ``lru`` | int16 ``[R, D]`` | hot slots, least recently used first |

Updates arrive as vectors (one ``index_put_`` per table and step, not one per entry), so a step
that changes n pages costs O(n) on the host and a handful of small copies on the GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from vllm_hisparse import ops


@dataclasses.dataclass
class ResolveResult:
    """Outputs of one :meth:`HotState.resolve` (views into buffers the state reuses)."""

    out_rows: torch.Tensor  # int32 [T, K] device row per selection, -1 padding
    miss_src: torch.Tensor  # int32 [T, K] host rows to copy
    miss_dst: torch.Tensor  # int32 [T, K] device rows to fill
    miss_count: torch.Tensor  # int32 [T]


class HotState:
    """Residency and hot-slot state of one index group.

    Args:
        num_state_rows: R, the number of request-state rows (vLLM ``max_num_seqs``).
        max_pages: P, pages of the longest request (``ceil(max_model_len / block_size)``).
        hot_slots: D, hot rows per request, a multiple of ``block_size`` and at most 32768.
        block_size: rows per page.
        device: where the tables live (the GPU in production, CPU in tests).
        ops_backend: ``"auto"``, ``"cuda"`` or ``"reference"``.
    """

    def __init__(self, num_state_rows: int, max_pages: int, hot_slots: int, block_size: int,
                 device: torch.device | str = "cpu", *, ops_backend: str = "auto"):
        if hot_slots <= 0 or hot_slots % block_size:
            raise ValueError(f"HotState: hot_slots must be a positive multiple of block_size "
                             f"({block_size}), got {hot_slots}")
        if hot_slots > 32768:
            raise ValueError(f"HotState: hot_slots = {hot_slots} exceeds 32768 (int16 lru)")
        self.num_state_rows = num_state_rows
        self.max_pages = max_pages
        self.hot_slots = hot_slots
        self.block_size = block_size
        self.hot_blocks_per_request = hot_slots // block_size
        self.device = torch.device(device)
        self._ops = ops.select(ops_backend)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.residency = torch.full((num_state_rows, max_pages), -1, **i32)
        self.host_blocks = torch.full((num_state_rows, max_pages), -1, **i32)
        self.hot_blocks = torch.full((num_state_rows, self.hot_blocks_per_request), -1, **i32)
        self.slot_pos = torch.full((num_state_rows, hot_slots), -1, **i32)
        self.lru = torch.arange(hot_slots, dtype=torch.int16,
                                device=self.device).repeat(num_state_rows, 1)
        self.stats = torch.zeros(3, dtype=torch.int64, device=self.device)
        self._buffers: dict[tuple[int, int], ResolveResult] = {}

    # ---------------------------------------------------------------- table updates

    def _ids(self, values: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(values), dtype=torch.int64).to(self.device, non_blocking=True)

    def set_pages(self, rows: Sequence[int], pages: Sequence[int],
                  device_blocks: Sequence[int]) -> None:
        """``residency[rows[i], pages[i]] = device_blocks[i]`` (-1 releases the page)."""
        if len(rows):
            self.residency.index_put_((self._ids(rows), self._ids(pages)),
                                      self._ids(device_blocks).to(torch.int32))

    def set_host_blocks(self, rows: Sequence[int], pages: Sequence[int],
                        host_blocks: Sequence[int]) -> None:
        """``host_blocks[rows[i], pages[i]] = host_blocks[i]``."""
        if len(rows):
            self.host_blocks.index_put_((self._ids(rows), self._ids(pages)),
                                        self._ids(host_blocks).to(torch.int32))

    def lease_hot_region(self, row: int, device_blocks: Sequence[int]) -> None:
        """Give ``row`` a fresh hot region: all slots empty, LRU in slot order."""
        if len(device_blocks) != self.hot_blocks_per_request:
            raise ValueError(f"HotState: a hot region is {self.hot_blocks_per_request} blocks, "
                             f"got {len(device_blocks)} for state row {row}")
        self.hot_blocks[row] = self._ids(device_blocks).to(torch.int32)
        self.slot_pos[row] = -1
        self.lru[row] = torch.arange(self.hot_slots, dtype=torch.int16, device=self.device)

    def release_hot_region(self, row: int) -> None:
        """Drop ``row``'s hot region (its blocks go back to the scheduler's pool)."""
        self.hot_blocks[row] = -1
        self.slot_pos[row] = -1

    def clear_row(self, row: int) -> None:
        """Forget everything about ``row`` (request finished, aborted or preempted)."""
        self.residency[row] = -1
        self.host_blocks[row] = -1
        self.release_hot_region(row)

    # ---------------------------------------------------------------- per step

    def _result_buffers(self, num_tokens: int, k: int) -> ResolveResult:
        key = (num_tokens, k)
        buf = self._buffers.get(key)
        if buf is None:  # allocated once per shape, then reused (graph-friendly)
            i32 = dict(dtype=torch.int32, device=self.device)
            buf = ResolveResult(torch.empty((num_tokens, k), **i32),
                                torch.empty((num_tokens, k), **i32),
                                torch.empty((num_tokens, k), **i32),
                                torch.empty((num_tokens,), **i32))
            self._buffers[key] = buf
        return buf

    def resolve(self, topk: torch.Tensor, token_rows: torch.Tensor) -> ResolveResult:
        """Resolve the step's top-k (int32 ``[T, K]``) of tokens whose state rows are
        ``token_rows`` (int32 ``[T]``); see ``ops.resolve``."""
        res = self._result_buffers(*topk.shape)
        self._ops.resolve(topk, token_rows, self.residency, self.host_blocks, self.hot_blocks,
                          self.slot_pos, self.lru, self.block_size, res.out_rows, res.miss_src,
                          res.miss_dst, res.miss_count, self.stats)
        return res

    def gather(self, result: ResolveResult, host_layers: Sequence[torch.Tensor],
               device_layers: Sequence[torch.Tensor]) -> None:
        """Copy the misses of ``result`` from the host pool into the hot rows, for every layer
        of the index group (leader and followers) in one call."""
        self._ops.gather_rows(host_layers, device_layers, result.miss_src, result.miss_dst,
                              result.miss_count)

    def counters(self) -> tuple[int, int, int]:
        """Distinct (resident, hot hit, miss) selections counted so far (syncs on CUDA)."""
        resident, hit, miss = self.stats.tolist()
        return resident, hit, miss
