"""HostBlockPool keeps the blocks in use low (issue [16]): a layer-major host pool's gather spans
the host blocks in use, so freed blocks are reused before untouched ones and a fresh pool hands
out the lowest ids first (the free list is a stack)."""

import random

from vllm_hisparse.core.host_blocks import HostBlockPool


def test_fresh_pool_hands_out_lowest_ids_first():
    pool = HostBlockPool(100)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
    assert pool.allocate(2) == [5, 6]


def test_blocks_in_use_stay_below_the_peak_of_blocks_in_use():
    rng = random.Random(5)
    pool = HostBlockPool(10_000)
    held: list[list[int]] = []
    peak = in_use = highest = 0
    for _ in range(3000):
        if held and (rng.random() < 0.5 or in_use > 2000):
            ids = held.pop(rng.randrange(len(held)))
            pool.free(ids)
            in_use -= len(ids)
        else:
            ids = pool.allocate(rng.randint(1, 64))
            held.append(ids)
            in_use += len(ids)
            peak = max(peak, in_use)
            highest = max(highest, max(ids))
    assert highest < peak < 2100
