"""Eviction classes of the hot slots from the indexer's decode scores (score-aware eviction).

``resolve`` evicts hot slots in (class, LRU) order when given ``slot_class`` (uint8 ``[R, D]``,
0 evicted first). A slot's class says how close its position's indexer score came, this step,
to the selection threshold (the lowest selected score): a position that just missed the cut is
the likeliest to be selected again soon, one far below it the least (docs/core.md, "Beyond LRU:
score-aware eviction"). With ``thr`` the threshold and ``w`` the width (see
:func:`threshold_and_width`), a slot holding position ``p`` with score ``s`` has class

    ``[s >= thr - w] + [s >= thr - 2 w] + [s >= thr - 3 w]``   (0 to ``NUM_SCORE_CLASSES - 1``)

and an empty slot class 0. The numpy twin is ``core.trace.score_classes``. Both are written
as comparisons against edges computed elementwise, and the width's sum in float64, so the
classes are the same on CPU and CUDA for the same logits.

Row layout (vLLM's decode indexer): logits row ``i`` belongs to decode request ``i // next_n``
(decode requests are the first batch rows; ``next_n`` rows per request, 1 without speculative
decoding), and a request's slot class is the highest over its rows.
"""

from __future__ import annotations

import torch

from vllm_hisparse.core.trace import NUM_SCORE_CLASSES, SCORE_CLASS_WIDTH


def threshold_and_width(logits: torch.Tensor, topk: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per logits row: the selection threshold and the class width.

    Args:
        logits: float ``[rows, W]`` indexer scores (fp32 or bf16).
        topk: int32 ``[rows, K]`` the selected columns; ``-1`` (or any column outside the
            logits) = padding.

    Returns:
        float32 ``threshold [rows]`` (the lowest finite selected score; ``+inf`` for a row
        with none, whose slots are then all class 0) and float32 ``width [rows]``
        (``SCORE_CLASS_WIDTH`` times the mean selected score's distance above the threshold,
        at least the smallest normal float32). Device ops only (CUDA-graph capturable).
    """
    valid = (topk >= 0) & (topk < logits.shape[1])
    scores = logits.gather(1, topk.clamp(0, logits.shape[1] - 1).long()).float()
    valid &= torch.isfinite(scores)
    inf = torch.full_like(scores, float("inf"))
    threshold = torch.where(valid, scores, inf).amin(dim=1)
    count = valid.sum(dim=1).clamp(min=1).double()
    mean = torch.where(valid, scores, torch.zeros_like(scores)).double().sum(dim=1) / count
    width = ((mean - threshold.double()) * SCORE_CLASS_WIDTH).float()
    tiny = torch.finfo(torch.float32).tiny
    width = torch.where(torch.isfinite(width) & (width > tiny), width,
                        torch.full_like(width, tiny))
    return threshold, width


def slot_classes_into(out: torch.Tensor, logits: torch.Tensor, threshold: torch.Tensor,
                      width: torch.Tensor, next_n: int, batch_state_rows: torch.Tensor,
                      slot_pos: torch.Tensor) -> None:
    """Write the decode requests' slot classes into ``out``.

    Args:
        out: uint8 ``[R + 1, D]``: row ``r < R`` receives the classes of state row ``r``'s
            slots when a decode request of the batch has that state row; row ``R`` is scratch
            (batch rows without a state row write there). Other rows are left as they are.
        logits: float ``[rows, W]``, ``rows = B * next_n`` (row layout: module docstring).
        threshold, width: float32 ``[rows]`` from :func:`threshold_and_width`.
        next_n: logits rows per decode request.
        batch_state_rows: int32 ``[>= B]`` state row of each batch row, ``-1`` = none.
        slot_pos: int32 ``[R, D]`` position held by each hot slot, ``-1`` = empty.

    Device ops only, no host sync (CUDA-graph capturable).
    """
    rows, width_cols = logits.shape
    num_state_rows, num_slots = slot_pos.shape
    if out.shape != (num_state_rows + 1, num_slots) or out.dtype != torch.uint8:
        raise ValueError(f"slot_classes_into: out must be uint8 [{num_state_rows + 1}, "
                         f"{num_slots}], got {out.dtype} {tuple(out.shape)}")
    if next_n <= 0 or rows % next_n:
        raise ValueError(f"slot_classes_into: {rows} logits rows are not a whole number of "
                         f"requests of next_n = {next_n}")
    num_requests = rows // next_n
    if num_requests == 0:
        return
    if num_requests > batch_state_rows.shape[0]:
        raise ValueError(f"slot_classes_into: {num_requests} decode requests but "
                         f"{batch_state_rows.shape[0]} batch rows")
    state = batch_state_rows[:num_requests].long()
    tracked = state >= 0
    positions = slot_pos[state.clamp(min=0)]                      # [B, D]
    positions = positions.repeat_interleave(next_n, dim=0)        # [rows, D]
    scores = logits.gather(1, positions.clamp(0, width_cols - 1).long()).float()
    thr, w = threshold[:, None], width[:, None]
    classes = torch.zeros_like(scores, dtype=torch.uint8)
    for c in range(1, NUM_SCORE_CLASSES):
        classes += (scores >= thr - c * w).to(torch.uint8)
    classes = torch.where(positions >= 0, classes, torch.zeros_like(classes))
    classes = classes.view(num_requests, next_n, num_slots).amax(dim=1)
    target = torch.where(tracked, state, torch.full_like(state, num_state_rows))
    out.index_copy_(0, target, classes)
