"""Selection traces recorded by the connector (``record_trace``): what ``vllm-hisparse
replay`` scores replacement policies on.

Every index group records its own selections at its leader layer (cross-layer prediction
reads them all; ``core.miss_prediction``), only the host-backed positions of tracked
requests, under a per-request trace id. Recording syncs: it is a diagnostic mode.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from vllm_hisparse.core.trace import TraceRecorder
from vllm_hisparse.vllm.worker_side.read_path import host_backed_positions
from vllm_hisparse.vllm.worker_side.tracked import TrackedRequests
from vllm_hisparse.worker import HotState


def _layer_number(name: str) -> float:
    """The first dot-separated integer of a layer name (``model.layers.12.self_attn.attn``
    -> 12), or infinity when it has none."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return float("inf")


class TraceRecording:
    """The worker's trace recorder and the numbering it records under.

    Args:
        top_k, block_size: the model's selection width and page size (trace meta).
        path: where :meth:`save` writes the trace.
        tracked: the worker's tracked requests (names the request of a state row).
    """

    def __init__(self, *, top_k: int, block_size: int, path: str,
                 tracked: TrackedRequests) -> None:
        self.recorder = TraceRecorder(top_k=top_k, block_size=block_size, source="vllm")
        self._path = path
        self._tracked = tracked
        self._step_id = -1
        self._request_ids: dict[str, int] = {}  # request id -> trace id
        # leader layer name -> the trace's index group (model layer order).
        self._groups: dict[str, int] = {}

    def number_groups(self, leaders: Sequence[str]) -> None:
        """Number the index groups in model layer order (the layer number in each leader's
        name; bind order where a name has none) and name their leaders in the trace's meta
        (``index_group_leaders``). ``leaders``: every index unit's leader, in bind order."""
        order = sorted(range(len(leaders)), key=lambda i: (_layer_number(leaders[i]), i))
        self._groups = {leaders[i]: group for group, i in enumerate(order)}
        self.recorder.meta["index_group_leaders"] = [leaders[i] for i in order]

    def callback(self, leader: str, state: HotState
                 ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The record callback of the index group led by ``leader`` (its binding's
        ``record``); numbered by :meth:`number_groups` before the first step."""
        def record(token_rows: torch.Tensor, topk: torch.Tensor) -> None:
            self._record(self._groups[leader], state, token_rows, topk)
        return record

    def begin_step(self, step_id: int) -> None:
        self._step_id = step_id

    def save(self) -> None:
        self.recorder.trace().save(self._path)

    def _record(self, group: int, state: HotState, token_rows: torch.Tensor,
                topk: torch.Tensor) -> None:
        for row, positions in host_backed_positions(state, token_rows, topk).items():
            rid = self._tracked.request_of_row(row)
            if rid is None:
                rid = f"row{row}"
            ident = self._request_ids.setdefault(rid, len(self._request_ids))
            self.recorder.add(ident, self._step_id, positions, group=group)
