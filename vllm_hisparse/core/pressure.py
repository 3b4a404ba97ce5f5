"""Which requests change residency: the selection rules, as pure functions of row vectors.

**FULL → MIXED under pressure** (:func:`demotion_candidates`): among ACTIVE FULL requests
that are not prefilling (R1.a) and have not changed state in the last
``min_steps_between_transitions`` steps, score each by ``reclaimable / hot_blocks`` where
``reclaimable = num_clean_pinned - ACTIVE_TAIL_PAGES`` (clean pages that could be released
at once; the tail estimate is conservative), keep only those with ``reclaimable >
hot_blocks`` (a net gain), best score first. The caller takes them in that order until the
summed net gain reaches ``high_watermark - free (+ unmet demand)``: never every request,
and never one whose move would cost blocks.

**MIXED/NONE → FULL** (:func:`promotion_candidates`): ACTIVE non-FULL requests past their
cooldown, cheapest first (``num_pages - num_pinned`` blocks to re-pin or restore). The
caller takes them while ``free - cost >= high_watermark``.
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.page_table import PageTables
from vllm_hisparse.core.request_table import RequestStatus, RequestTable
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES


def demotion_candidates(requests: RequestTable, tables: PageTables, step_id: int,
                        min_steps_between_transitions: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, net_gain_blocks)`` of the requests worth demoting, best first (int64)."""
    cooled = step_id - requests.last_transition > min_steps_between_transitions
    candidates = np.nonzero(
        (requests.status == RequestStatus.ACTIVE)
        & (requests.residency == Residency.FULL)
        & cooled
        & ~requests.prefilling
    )[0]
    if candidates.shape[0] == 0:
        return candidates, candidates
    reclaimable = np.maximum(tables.num_clean_pinned[candidates] - ACTIVE_TAIL_PAGES, 0)
    hot = requests.hot_blocks[candidates]
    net = reclaimable - hot
    ok = net > 0
    if not np.any(ok):
        return candidates[:0], net[:0]
    candidates, reclaimable, hot, net = candidates[ok], reclaimable[ok], hot[ok], net[ok]
    order = np.argsort(-(reclaimable / hot), kind="stable")
    return candidates[order], net[order]


def promotion_candidates(requests: RequestTable, tables: PageTables, step_id: int,
                         min_steps_between_transitions: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, cost_blocks)`` of the requests that may be promoted, cheapest first (int64)."""
    non_full = requests.non_full_rows
    rows = np.fromiter(non_full, dtype=np.int64, count=len(non_full))
    cooled = step_id - requests.last_transition[rows] > min_steps_between_transitions
    rows = rows[(requests.status[rows] == RequestStatus.ACTIVE) & cooled]
    cost = tables.num_pages[rows] - tables.num_pinned[rows]
    order = np.argsort(cost, kind="stable")
    return rows[order], cost[order]
