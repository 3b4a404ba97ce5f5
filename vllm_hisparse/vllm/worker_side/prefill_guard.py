"""The worker's guard of requirement R1 (docs/worker.md): a host-backed request that
prefills must read its whole context through vLLM's block table, so every page of it must be
resident, and the batch block-table rows must name the blocks the residency tables name
(vLLM's worker table is append-only and misses restores into new blocks).

A part of :class:`~vllm_hisparse.vllm.worker_side.role.WorkerRole`, built once the lanes
exist; it reads their residency tables and never writes them.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME


class PrefillGuard:
    """R1 check and block-table rewrite for tracked requests with prefill tokens.

    Args:
        lanes: the worker's lanes (``lanes.Lane``): the first one's executor tables answer
            the R1 check (a page is resident in every sparse group or in none), every
            lane's layers name the block tables to rewrite.
        max_decode_query_len: a request scheduled more tokens than this is prefilling.
    """

    def __init__(self, lanes: Sequence[Any], max_decode_query_len: int) -> None:
        self._lanes = tuple(lanes)
        self.max_decode_query_len = int(max_decode_query_len)

    def guard(self, step_id: int, request_ids: Sequence[str], batch_rows: Sequence[int],
              step_inputs: dict[str, Any]) -> None:
        """Check and rewrite the step's tracked prefills (``start_load_kv``'s inputs)."""
        prefill = self.tracked_prefills(request_ids, batch_rows, step_inputs.get("scheduler_output"))
        if not prefill:
            return
        self.check_context(step_id, prefill)
        metadata_by_layer = step_inputs.get("attn_metadata")
        if metadata_by_layer is None:
            metadata_by_layer = compat.forward_context_attn_metadata()
        self.rewrite_block_tables(metadata_by_layer, prefill)

    def tracked_prefills(self, request_ids: Sequence[str], batch_rows: Sequence[int],
                         scheduler_output: Any) -> list[tuple[str, int, int]]:
        """``(request id, batch row, state row)`` of tracked requests with prefill tokens.

        Without a scheduler output the token counts are unknown: every tracked request is
        treated as prefilling (checked and rewritten; conservative)."""
        counts = (compat.scheduled_token_counts(scheduler_output)
                  if scheduler_output is not None else None)
        limit = self.max_decode_query_len
        return [(rid, b, row) for b, (rid, row) in enumerate(zip(request_ids, batch_rows))
                if row >= 0 and (counts is None or counts.get(rid, 0) > limit)]

    def check_context(self, step_id: int, prefill: list[tuple[str, int, int]]) -> None:
        """R1: a tracked request with prefill tokens has no host-only page in this step."""
        executor = self._lanes[0].executor
        for rid, _, row in prefill:
            host_only = np.nonzero((executor.host_blocks[row] >= 0)
                                   & (executor.residency[row] < 0))[0]
            if host_only.size:
                pages = host_only.tolist()
                shown = ", ".join(map(str, pages[:8])) + (" ..." if len(pages) > 8 else "")
                raise RuntimeError(
                    f"{CONNECTOR_NAME}: step {step_id} schedules prefill tokens (more than "
                    f"max_decode_query_len={self.max_decode_query_len}) for request "
                    f"{rid!r}, but {len(pages)} of its pages are host-only (pages {shown}). "
                    "vLLM's prefill paths read the whole context through the block table, so "
                    "the residency policy must keep a request with prompt tokens left FULL, "
                    "or make every page resident (restores completed) before its prefill tokens "
                    "are scheduled (requirement R1, docs/worker.md)")

    def rewrite_block_tables(self, metadata_by_layer: Any,
                             prefill: list[tuple[str, int, int]]) -> None:
        """Point the batch block-table rows of tracked prefill requests at the blocks the
        worker's residency tables name, in every sparse group (vLLM's worker table is
        append-only and misses restores into new blocks)."""
        if metadata_by_layer is None:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: a host-backed request ({prefill[0][0]!r}) has prefill "
                "tokens but no attention metadata is reachable from start_load_kv (neither "
                "an attn_metadata argument nor a forward context); its block-table rows "
                "cannot be corrected")
        if not isinstance(metadata_by_layer, dict):
            raise NotImplementedError(
                f"{CONNECTOR_NAME}: micro-batched attention metadata (a list per ubatch) with "
                "a host-backed request that prefills is not supported")
        batch = np.asarray([b for _, b, _ in prefill], dtype=np.int64)
        state_rows = np.asarray([r for _, _, r in prefill], dtype=np.int64)
        for lane in self._lanes:
            seen: set[int] = set()
            for name in lane.layer_names:
                md = metadata_by_layer.get(name)
                table = compat.attention_block_table(md)
                if table is None or id(table) in seen:
                    continue
                seen.add(id(table))
                width = min(table.shape[1], lane.executor.residency.shape[1])
                values = lane.layout.vllm_block_ids(
                    lane.executor.residency[state_rows, :width], compat.NULL_BLOCK_ID)
                rows = torch.as_tensor(batch).to(table.device, non_blocking=True)
                table[rows, :width] = torch.as_tensor(values, dtype=table.dtype).to(
                    table.device, non_blocking=True)
