"""Pure-torch twins of the score ops (score-aware eviction, docs/core.md "Beyond LRU").

``resolve`` evicts hot slots in (class, LRU) order when given ``slot_class`` (uint8 ``[R, D]``,
0 evicted first). A slot's class says how close its position's indexer score came, this step,
to the selection threshold: a position that just missed the cut is the likeliest to be
selected again soon, one far below it the least. Two ops compute the classes from the
indexer's decode logits, one launch each on CUDA:

* :func:`score_threshold` (at the indexer, while its top-k is still in the logits' row
  layout): per logits row the threshold ``thr`` (lowest finite selected score) and the width
  ``w`` (``SCORE_CLASS_WIDTH`` times the mean finite selected score's distance above ``thr``);
* :func:`slot_classes` (at the leader's conversion, before resolve): a slot holding position
  ``p`` with score ``s`` gets ``[s >= thr - w] + [s >= thr - 2 w] + [s >= thr - 3 w]``.

The contract is exact: every value is the result of a fixed sequence of IEEE operations, so
the CUDA kernels and these twins agree bit for bit, and ``core.trace.score_classes`` (the
numpy twin the trace replay uses) gives the same classes. The one choice of order is the
float64 sum of the selected scores, made in :func:`core.trace.lane_tree_sum`'s order over
the top-k columns (a sum in another order, e.g. ``torch.sum``, rounds differently when the
scores span more than ~2^18 in magnitude).

Row layout (vLLM's decode indexer): logits row ``i`` belongs to decode request ``i // next_n``
(decode requests are the first batch rows; ``next_n`` rows per request, 1 without speculative
decoding), and a request's slot class is the highest over its rows.
"""

from __future__ import annotations

import torch

from vllm_hisparse.core.trace import NUM_SCORE_CLASSES, SCORE_CLASS_WIDTH, SCORE_SUM_LANES
from vllm_hisparse.ops import _checks

__all__ = ["score_threshold", "slot_classes"]

#: Floor of the class width (the smallest normal float32): a width of 0 would put every slot
#: at the threshold's score in all three classes at once and the rest in none.
MIN_SCORE_WIDTH = torch.finfo(torch.float32).tiny


def score_threshold(logits: torch.Tensor, topk: torch.Tensor, threshold: torch.Tensor,
                    width: torch.Tensor) -> None:
    """Per logits row: the selection threshold and the class width.

    Args (``rows`` logits rows, ``W`` columns, ``K`` selections):
        logits: float32 or bfloat16 ``[rows, W]`` indexer scores; contiguous or row-strided
            (``stride(1) == 1``, ``stride(0) >= W``, as vLLM's aligned logits).
        topk: int32 ``[rows, K]`` the selected columns, contiguous or row-strided; an entry
            outside ``[0, W)`` (``-1``) is padding.
        threshold: float32 ``[rows]`` OUT: ``thr``, the lowest finite selected score (as
            float32); ``+inf`` for a row with none.
        width: float32 ``[rows]`` OUT: ``w = float32((mean - thr) * SCORE_CLASS_WIDTH)`` in
            float64, where ``mean = sum / max(count, 1)``, ``count`` the row's finite selected
            scores and ``sum`` their float64 sum in ``core.trace.lane_tree_sum``'s order over
            the K columns (padding and non-finite entries add ``0.0``); a ``w`` that is not
            finite or not above ``MIN_SCORE_WIDTH`` becomes ``MIN_SCORE_WIDTH``.

    Device ops only (no host sync): capturable in a CUDA graph.
    """
    _checks.check_score_threshold_args(logits, topk, threshold, width)
    _score_threshold_unchecked(logits, topk, threshold, width)


def _lane_tree_sum(values: torch.Tensor) -> torch.Tensor:
    """float64 ``[rows]`` sums of float64 ``[rows, K]`` in ``core.trace.lane_tree_sum``'s order."""
    rows, cols = values.shape
    lanes = SCORE_SUM_LANES
    padded = -(-cols // lanes) * lanes
    if padded != cols:
        values = torch.cat([values, values.new_zeros((rows, padded - cols))], dim=1)
    rounds = values.view(rows, padded // lanes, lanes)
    acc = values.new_zeros((rows, lanes))
    for r in range(rounds.shape[1]):
        acc = acc + rounds[:, r]
    while acc.shape[1] > 1:
        half = acc.shape[1] // 2
        acc = acc[:, :half] + acc[:, half:]
    return acc[:, 0]


def _score_threshold_unchecked(logits, topk, threshold, width) -> None:
    rows, cols = logits.shape
    if rows == 0:
        return
    index = topk.to(torch.int64)
    inside = (index >= 0) & (index < cols)
    if cols:
        scores = logits.gather(1, index.clamp(0, cols - 1)).float()
    else:
        scores = torch.zeros(index.shape, dtype=torch.float32, device=logits.device)
    valid = inside & torch.isfinite(scores)
    inf = torch.full_like(scores, float("inf"))
    lowest = torch.where(valid, scores, inf).amin(dim=1) if topk.shape[1] else \
        torch.full((rows,), float("inf"), device=logits.device)
    total = _lane_tree_sum(torch.where(valid, scores, torch.zeros_like(scores)).double())
    count = valid.sum(dim=1).clamp(min=1).double()
    w = (((total / count) - lowest.double()) * SCORE_CLASS_WIDTH).float()
    w = torch.where(torch.isfinite(w) & (w > MIN_SCORE_WIDTH), w,
                    torch.full_like(w, MIN_SCORE_WIDTH))
    threshold.copy_(lowest)
    width.copy_(w)


def slot_classes(logits: torch.Tensor, threshold: torch.Tensor, width: torch.Tensor,
                 next_n: int, batch_state_rows: torch.Tensor, slot_pos: torch.Tensor,
                 slot_class: torch.Tensor) -> None:
    """Write the decode requests' slot classes into ``slot_class``.

    Args (``rows = B * next_n`` logits rows, R state rows, D hot slots):
        logits: float32 or bfloat16 ``[rows, W]`` (row layout: module docstring), contiguous
            or row-strided as in :func:`score_threshold`.
        threshold, width: float32 ``[rows]`` from :func:`score_threshold`.
        next_n: logits rows per decode request (a positive int dividing ``rows``).
        batch_state_rows: int32 ``[>= B]`` state row of each batch row; ``-1`` = none (the
            request is skipped). The state rows of one call are distinct.
        slot_pos: int32 ``[R, D]`` position held by each hot slot; ``-1`` = empty.
        slot_class: uint8 ``[R, D]`` OUT: row ``r`` of each decode request's state row
            receives, for slot ``d`` holding ``p = slot_pos[r, d]``, the highest over the
            request's logits rows ``i`` of ``[s >= e1] + [s >= e2] + [s >= e3]`` with
            ``s = float32(logits[i, p])`` and float32 edges ``e_c = thr[i] - float32(c * w[i])``;
            0 for an empty slot, a position outside ``[0, W)`` and a row whose ``thr`` is not
            finite (no finite selection). Rows of no decode request are left as they are.

    Device ops only (no host sync) in :func:`_slot_classes_unchecked`; the value checks here
    read ``batch_state_rows`` back.

    Raises:
        ValueError: ``rows`` not a multiple of ``next_n``; more requests than
            ``batch_state_rows``; a state row outside ``[-1, R)`` or two requests on one.
    """
    _checks.check_slot_classes_args(logits, threshold, width, next_n, batch_state_rows,
                                    slot_pos, slot_class)
    _checks.check_slot_classes_values(logits, threshold, width, next_n, batch_state_rows,
                                      slot_pos, slot_class)
    _slot_classes_unchecked(logits, threshold, width, next_n, batch_state_rows, slot_pos,
                            slot_class)


def _slot_classes_unchecked(logits, threshold, width, next_n, batch_state_rows, slot_pos,
                            slot_class) -> None:
    rows, cols = logits.shape
    num_rows, num_slots = slot_pos.shape
    num_requests = rows // next_n
    if num_requests == 0 or num_rows == 0 or num_slots == 0:
        return
    state = batch_state_rows[:num_requests].to(torch.int64)
    tracked = (state >= 0) & (state < num_rows)
    row_of = state.clamp(0, num_rows - 1)
    positions = slot_pos.index_select(0, row_of).to(torch.int64).repeat_interleave(next_n, 0)
    inside = (positions >= 0) & (positions < cols)                      # [rows, D]
    if cols:
        scores = logits.gather(1, positions.clamp(0, cols - 1)).float()
    else:
        scores = torch.zeros(positions.shape, dtype=torch.float32, device=logits.device)
    thr, w = threshold[:, None], width[:, None]
    classes = torch.zeros_like(scores, dtype=torch.uint8)
    for c in range(1, NUM_SCORE_CLASSES):
        classes += (scores >= thr - c * w).to(torch.uint8)
    classes = torch.where(inside & torch.isfinite(thr), classes, torch.zeros_like(classes))
    classes = classes.view(num_requests, next_n, num_slots).amax(dim=1)
    # Written as old + (new - old) (uint8, wrapping) added to each request's row: a request
    # without a state row adds 0 to row 0, so nothing syncs to drop it and nothing races.
    old = slot_class.index_select(0, row_of)
    delta = torch.where(tracked[:, None], classes - old, torch.zeros_like(old))
    slot_class.index_add_(0, row_of, delta)
