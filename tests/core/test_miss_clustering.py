"""core.miss_clustering: miss sets as the hisparse policy takes them, host pages per layout."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_hisparse.core import miss_clustering as mc
from vllm_hisparse.core.replacement import replay_request
from vllm_hisparse.core.trace import TraceRecorder


def test_miss_positions_agree_with_the_policy_model():
    rng = np.random.default_rng(3)
    sets = [np.unique(rng.integers(0, 400, size=60)) for _ in range(30)]
    missed = mc.miss_positions(sets, 128)
    misses, _ = replay_request("hisparse", sets, 128)
    assert sum(m.shape[0] for m in missed) == misses
    assert missed[0].tolist() == sets[0].tolist()  # an empty region misses everything
    assert missed[1].tolist() == sorted(set(sets[1]) - set(sets[0]))


def test_miss_positions_refuses_an_oversized_step():
    with pytest.raises(ValueError, match="more than the capacity 4"):
        mc.miss_positions([np.arange(5)], 4)


@pytest.mark.parametrize("layout,positions,layers,pages", [
    # position-major, 8 layers x 656 B: a position's row of one layer is 5,248 B from the next
    ("position", [0, 1, 2], 1, 3),
    # ... a gather of all 8 layers of position 0 reads 5,248 contiguous bytes: 2 pages
    ("position", [0], 8, 2),
    # page-major: one layer's rows of a page are contiguous; rows 0..5 fit one page (3,936 B)
    ("page", [0, 1, 2, 3, 4, 5], 1, 1),
    ("page", [0, 1, 2, 3, 4, 5, 6], 1, 2),  # row 6 straddles into the next page
    # ... two layers of the same positions are a page's worth apart (64 x 656 B)
    ("page", [0], 2, 2),
    ("layer", [0, 5], 1, 1),
])
def test_host_pages_per_layout(layout, positions, layers, pages):
    got = mc.host_pages(np.asarray(positions), layout, num_layers=8, gather_layers=layers,
                        block_size=64, row_bytes=656, host_rows=1 << 20)
    assert got == pages


def test_measure_counts_clustered_misses():
    rec = TraceRecorder(top_k=8, block_size=64, source="test")
    # every step selects 8 new adjacent positions: all miss, all in one 64-row page
    for s in range(6):
        rec.add(0, s, np.arange(64 * s, 64 * s + 8))
    c = mc.measure(rec.trace(), 16, num_layers=61, gather_layers=1, skip_steps=1)
    assert (c.steps, c.misses, c.pages_with_misses) == (5, 40, 5)
    assert c.misses_per_page == 8
    # 8 adjacent 656 B rows span 2 pages in page-major / layer-major, 8 pages position-major
    assert c.rows_per_host_page["position"] < 1.0
    assert c.rows_per_host_page["page"] > 3.0
    with pytest.raises(ValueError, match="layout"):
        mc.host_pages(np.arange(2), "row", num_layers=1, gather_layers=1, block_size=64,
                      row_bytes=656, host_rows=10)
