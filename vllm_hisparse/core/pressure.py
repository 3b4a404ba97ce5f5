"""Which requests change residency: the selection rules, as pure functions of row vectors.

**FULL → MIXED under pressure** (:func:`demotion_candidates`): among ACTIVE FULL requests
that are not prefilling (R1.a) and have not changed state in the last
``min_steps_between_transitions`` steps, score each by ``reclaimable / hot_blocks`` where
``reclaimable`` = its clean pinned pages that no other request pins, minus
``ACTIVE_TAIL_PAGES`` (pages whose release frees a block at once; the tail estimate is
conservative), keep only those whose net gain ``reclaimable - hot_blocks`` is at least
``hot_blocks / MIN_GAIN_PER_HOT`` (a demotion must pay for the misses it brings), best score
first. The caller takes them in that order until the summed net gain reaches
``high_watermark - free (+ unmet demand)``: never every request, and never one whose move
would cost blocks.

**Shared pages.** Requests that hit vLLM's prefix cache hold the same device blocks for
their common prefix, each with its own lease. Releasing one lease of such a page frees
nothing while another request pins it, so a request whose context is mostly a shared
prefix gains only its own suffix from a demotion, and a hot region costs more than that
(:func:`exclusive_pinned_pages`). Blocks residency actually spares count each block once
(:func:`blocks_spared`).

**MIXED/NONE → FULL** (:func:`promotion_candidates`): ACTIVE non-FULL requests past their
cooldown, cheapest first (``num_pages - num_pinned`` blocks to re-pin or restore). The
caller takes them while ``free - cost >= high_watermark``.
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.page_table import PageTables, releasable_mask
from vllm_hisparse.core.request_table import RequestStatus, RequestTable
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES

#: A demotion's net gain must be at least ``hot_blocks / MIN_GAIN_PER_HOT`` blocks. A request
#: whose context is about one hot region frees a block or two by moving to the host and then
#: misses on every step while its region warms: the throughput lost costs more than the few
#: requests the blocks admit (docs/core.md, "Transition rules"). With a 4096-row region of
#: 64-token pages (64 blocks) the bound is 16 blocks: 82 clean pages of its own, 5.2K tokens.
MIN_GAIN_PER_HOT = 4


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
    reclaimable = np.maximum(exclusive_pinned_pages(tables, candidates, clean=True) - ACTIVE_TAIL_PAGES, 0)
    hot = requests.hot_blocks[candidates]
    net = reclaimable - hot
    ok = (net > 0) & (net * MIN_GAIN_PER_HOT >= hot)
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


def pin_counts(tables: PageTables) -> np.ndarray:
    """Pinned pages per device block id, over every row (O(rows x pages))."""
    width = int(tables.num_pages.max(initial=0))
    held = tables.device_block[:, :width][tables.pinned[:, :width]]
    return np.bincount(held) if held.shape[0] else np.zeros(1, dtype=np.int64)


def exclusive_pinned_pages(tables: PageTables, rows: np.ndarray, *, clean: bool) -> np.ndarray:
    """Per row of ``rows``: its pinned pages (``clean``: pinned and clean) whose device
    block no other page pins, i.e. whose release frees a block (int64)."""
    counts = pin_counts(tables)
    if counts.max() <= 1:  # no block pinned twice: every pinned page owns its block
        return (tables.num_clean_pinned if clean else tables.num_pinned)[rows].copy()
    width = int(tables.num_pages[rows].max(initial=0))
    mask = tables.pinned[rows, :width]
    if clean:
        mask = mask & tables.host_valid[rows, :width]
    blocks = np.maximum(tables.device_block[rows, :width], 0)
    return np.count_nonzero(mask & (counts[blocks] == 1), axis=1).astype(np.int64)


def blocks_spared(tables: PageTables) -> int:
    """Device blocks the known requests' unpinned pages free: every distinct block of a
    released page that no page still pins (a prefix another request pins frees nothing;
    two requests releasing one shared block free it once), and every distinct host block of
    a page that is only on the host. O(rows) while every page is pinned, else
    O(rows x pages)."""
    if int(tables.num_pages.sum() - tables.num_pinned.sum()) == 0:
        return 0
    counts = pin_counts(tables)
    width = int(tables.num_pages.max(initial=0))
    unpinned = (np.arange(width) < tables.num_pages[:, None]) & ~tables.pinned[:, :width]
    blocks = tables.device_block[:, :width][unpinned]
    released = np.unique(blocks[blocks >= 0])
    pinned_elsewhere = np.count_nonzero(counts[released[released < counts.shape[0]]] > 0)
    host_only = np.unique(tables.host_block[:, :width][unpinned & (tables.device_block[:, :width] < 0)])
    return int(released.shape[0] - pinned_elsewhere + host_only.shape[0])


def blocks_freed_by_release(tables: PageTables, row: int) -> int:
    """Device blocks that releasing every releasable page of ``row`` now would free: clean,
    idle (no transfer or mirror in flight), non-tail pinned pages that no other page pins."""
    limit = int(tables.num_pages[row]) - ACTIVE_TAIL_PAGES
    if limit <= 0:
        return 0
    mask = releasable_mask(tables, row, limit)
    counts = pin_counts(tables)
    return int(np.count_nonzero(mask & (counts[np.maximum(tables.device_block[row, :limit], 0)] == 1)))
