"""Per-request hot-region sizing (core/hot_sizing.py): the rule, and its replay model against
the resolve reference twin with partial hot regions."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_hisparse.core.hot_sizing import (HotSizer, HotSizingConfig, compare_sizing,
                                           replay_adaptive)
from vllm_hisparse.core.replacement import replay_request
from vllm_hisparse.ops import reference


def config(**over) -> HotSizingConfig:
    args = dict(block_size=4, min_blocks=2, max_blocks=6, target_miss_rate=0.1, window_steps=2,
                hysteresis=0.2, grow_blocks=2, shrink_blocks=1)
    args.update(over)
    return HotSizingConfig(**args)


def test_sizer_grows_above_the_band_shrinks_below_and_stays_within_bounds():
    sizer = HotSizer(config(), initial_blocks=3)
    assert sizer.observe(5, 10) == 3  # mid-window: no decision
    assert sizer.observe(5, 10) == 5  # 50 % > 12 %: +2
    sizer.observe(3, 10)
    assert sizer.observe(3, 10) == 6  # capped at max_blocks
    sizer.observe(1, 10)
    assert sizer.observe(1, 10) == 6  # 10 %: inside the band [8 %, 12 %]
    for expected in (5, 4, 3, 2, 2):  # 0 %: -1 per window, floored at min_blocks
        sizer.observe(0, 10)
        assert sizer.observe(0, 10) == expected


def test_sizer_under_pressure_never_grows_and_shrinks_at_the_target():
    sizer = HotSizer(config(), initial_blocks=4)
    sizer.observe(9, 10, under_pressure=True)
    assert sizer.observe(9, 10, under_pressure=True) == 4
    sizer.observe(1, 10, under_pressure=True)  # exactly the target
    assert sizer.observe(1, 10, under_pressure=True) == 3


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="min_blocks <= max_blocks"):
        config(min_blocks=7)
    with pytest.raises(ValueError, match="target_miss_rate"):
        config(target_miss_rate=1.5)
    with pytest.raises(ValueError, match="window_steps"):
        config(window_steps=0)


def test_a_fixed_size_replays_exactly_like_the_kernels_policy():
    rng = random.Random(3)
    sets = [np.array(sorted(rng.sample(range(200), rng.randint(1, 8)))) for _ in range(80)]
    fixed = config(min_blocks=3, max_blocks=3)
    result = replay_adaptive(sets, fixed)
    assert (result.misses, result.references) == replay_request("hisparse", sets, 12)
    assert result.mean_blocks == 3


class ScriptedSizer:
    """A sizer whose sizes follow a script (one entry per step)."""

    def __init__(self, sizes):
        self.sizes = list(sizes)
        self.blocks = self.sizes.pop(0)

    def observe(self, misses, references):
        self.blocks = self.sizes.pop(0) if self.sizes else self.blocks
        return self.blocks


@pytest.mark.parametrize("seed", range(10))
def test_resized_region_counts_the_misses_of_the_reference_resolve(seed):
    """The model's partial regions are resolve's: blocks past the size are -1 and their slots
    empty; the miss count of every step matches ops.reference.resolve."""
    rng = random.Random(seed)
    bs, max_blocks, num_pages = 4, 6, 40
    sizes = [rng.randint(2, max_blocks) for _ in range(31)]
    sets = [np.array(sorted(rng.sample(range(num_pages * bs), rng.randint(1, 2 * bs))))
            for _ in range(30)]
    cfg = config(block_size=bs, max_blocks=max_blocks)
    model = replay_adaptive(sets, cfg, sizer=ScriptedSizer(sizes))
    num_slots = max_blocks * bs
    slot_pos = torch.full((1, num_slots), -1, dtype=torch.int32)
    lru = torch.arange(num_slots, dtype=torch.int16).reshape(1, -1)
    stats = torch.zeros(3, dtype=torch.int64)
    blocks = torch.arange(max_blocks, dtype=torch.int32).reshape(1, -1) + 100
    for step, s in enumerate(sets):
        hot = blocks.clone()
        hot[0, sizes[step]:] = -1
        k = len(s)
        reference.resolve(
            torch.tensor([s.tolist()], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.full((1, num_pages), -1, dtype=torch.int32),
            torch.arange(num_pages, dtype=torch.int32).reshape(1, -1), hot, slot_pos, lru, bs,
            torch.empty((1, k), dtype=torch.int32), torch.empty((1, k), dtype=torch.int32),
            torch.empty((1, k), dtype=torch.int32), torch.empty(1, dtype=torch.int32), stats)
        slot_pos[0, sizes[step + 1] * bs:] = -1  # the shrink empties the released blocks
    assert stats[2].item() == model.misses
    assert model.block_steps == sum(sizes[:30])


def test_compare_sizing_reports_fixed_sizes_and_the_adaptive_rule():
    rng = random.Random(1)
    requests = [[np.array(sorted(rng.sample(range(300), 6))) for _ in range(40)]
                for _ in range(3)]
    rows = compare_sizing(requests, fixed_rows=16, block_size=4, target_scales=(1.0,),
                          fixed_scales=(1.0, 2.0))
    assert [r.label for r in rows] == ["fixed 16 rows", "fixed 32 rows", "adaptive, target 1 x"]
    assert rows[0].miss_rate >= rows[1].miss_rate
    assert rows[2].target_miss_rate == pytest.approx(rows[0].miss_rate)
    assert 2 <= rows[2].mean_blocks <= 8
