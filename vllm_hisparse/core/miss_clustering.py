"""How a hot region's misses cluster in host memory, per host-pool layout.

A GPU gather of scattered rows from pinned host memory over a multi-GiB pool is limited by
the number of distinct 4 KiB host pages it touches, not by bytes (docs/kernels.md, "Host pool
layout"; its figures in docs/benchmarks.md, "CUDA kernels"). A layout gains when the rows
one gather reads share pages. This module replays a selection trace through a hot region (the
``hisparse`` policy of :mod:`.replacement`, what ``resolve`` does) and counts, per step and
request, the misses and the distinct host pages a gather of them touches in each layout:

| layout | byte offset of (position p, layer l), L layers, bs rows per page, R bytes per row |
|---|---|
| ``position`` (the default pool) | ``(p * L + l) * R`` |
| ``page`` (per-layer rows of a page contiguous) | ``((p // bs) * L + l) * bs * R + (p % bs) * R`` |
| ``layer`` | ``(l * H + p) * R`` for H host rows per layer |

A request's pages are taken to sit in consecutive host blocks (the best case for the last
two layouts). ``gather_layers`` is how many layers one launch reads at the same positions: 1
for a model with an indexer per layer, the IndexShare group's size otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

LAYOUTS = ("position", "page", "layer")
HOST_PAGE_BYTES = 4096


def miss_positions(sets: Sequence[np.ndarray], capacity: int) -> list[np.ndarray]:
    """The positions each step of one request misses in a hot region of ``capacity`` slots
    under the ``hisparse`` policy (victims least recent first; new order = survivors, this
    step's misses, this step's hits), sorted."""
    order = np.full(capacity, -1, dtype=np.int64)
    out = []
    for needed in sets:
        needed = np.unique(np.asarray(needed, dtype=np.int64))
        if needed.shape[0] > capacity:
            raise ValueError(f"a step selects {needed.shape[0]} host-backed positions, more "
                             f"than the capacity {capacity}")
        hit = np.isin(order, needed)
        missing = needed[~np.isin(needed, order)]
        evictable = order[~hit]
        order = np.concatenate([evictable[missing.shape[0]:], missing, order[hit]])
        out.append(missing)
    return out


def host_pages(positions: np.ndarray, layout: str, *, num_layers: int, gather_layers: int,
               block_size: int, row_bytes: int, host_rows: int) -> int:
    """Distinct 4 KiB host pages a gather of ``gather_layers`` layers (0 .. n-1) at
    ``positions`` touches in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    p = np.asarray(positions, dtype=np.int64)[:, None]
    layers = np.arange(gather_layers, dtype=np.int64)[None, :]
    if layout == "position":
        start = (p * num_layers + layers) * row_bytes
    elif layout == "page":
        start = (((p // block_size) * num_layers + layers) * block_size
                 + p % block_size) * row_bytes
    else:
        start = (layers * host_rows + p) * row_bytes
    first = start // HOST_PAGE_BYTES
    last = (start + row_bytes - 1) // HOST_PAGE_BYTES
    return int(np.unique(np.concatenate([first.ravel(), last.ravel()])).shape[0])


@dataclass
class Clustering:
    """Totals over a trace: misses, pages (``block_size`` rows) they fall in, and 4 KiB host
    pages touched per layout; ``rows_per_host_page`` = misses x layers / host pages."""

    steps: int
    misses: int
    pages_with_misses: int
    host_pages: dict
    rows_per_host_page: dict
    misses_per_page: float

    def as_dict(self) -> dict:
        return asdict(self)


def measure(trace, capacity: int, *, num_layers: int, gather_layers: int = 1,
            row_bytes: int = 656, skip_steps: int = 20) -> Clustering:
    """Replay every request of ``trace`` (a :class:`~.trace.SelectionTrace`) through a hot
    region of ``capacity`` slots and count, over its steps after the first ``skip_steps``
    (while the region fills every selection misses), how the misses cluster."""
    bs = int(trace.meta.get("block_size", 64))
    steps = misses = pages = 0
    touched = dict.fromkeys(LAYOUTS, 0)
    for _, sets in trace.requests():
        host_rows = max((int(s.max()) for s in sets if s.shape[0]), default=0) + 1
        for missing in miss_positions(sets, capacity)[skip_steps:]:
            steps += 1
            if not missing.shape[0]:
                continue
            misses += missing.shape[0]
            pages += np.unique(missing // bs).shape[0]
            for layout in LAYOUTS:
                touched[layout] += host_pages(missing, layout, num_layers=num_layers,
                                              gather_layers=gather_layers, block_size=bs,
                                              row_bytes=row_bytes, host_rows=host_rows)
    rows = misses * gather_layers
    return Clustering(steps, misses, pages, touched,
                      {k: rows / v if v else 0.0 for k, v in touched.items()},
                      misses / pages if pages else 0.0)
