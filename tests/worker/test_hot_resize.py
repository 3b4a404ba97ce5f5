"""Hot regions resized in place (adaptive hot regions), on the reference ops: a random walk
of grows and shrinks between resolves, the blocks a shrink gives back overwritten at once
(another request reuses them), and every selection read back from the device rows
``resolve`` names must be the ground truth. Plus the per-row miss counts."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_hisparse.core.commands import HotLease, StepCommand
from vllm_hisparse.ops import reference as ref
from vllm_hisparse.worker.hot_counts import RowHotCounts
from vllm_hisparse.worker.hot_state import HotState
from vllm_hisparse.worker.step_executor import StepExecutor
from vllm_hisparse.worker.transfer import TransferEngine

BS, PAGES, MAX_BLOCKS, K = 4, 16, 4, 3
GARBAGE = 0x5A


#: Bytes per KV row: the CUDA row copies move 16-byte vectors (ops.cuda refuses narrower rows).
ROW_BYTES = 16


def host_row(row: int, pos: int) -> torch.Tensor:
    """The ground-truth KV row (``ROW_BYTES``) of ``pos`` of state row ``row``: its id, then
    its bitwise complement (a torn or shifted copy shows in either half)."""
    value = row * 10_000 + pos + 1
    return torch.tensor([value, ~value], dtype=torch.int64).view(torch.uint8)


BACKENDS = [pytest.param("reference", id="reference"),
            pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(4))
def test_resized_regions_read_ground_truth(seed, backend):
    rng = random.Random(seed)
    rows = 2
    device = "cuda" if backend == "cuda" else "cpu"
    dev = torch.full((64 * BS, ROW_BYTES), GARBAGE, dtype=torch.uint8, device=device)
    host = torch.zeros((rows * PAGES * BS, ROW_BYTES), dtype=torch.uint8)
    for r in range(rows):
        for p in range(PAGES * BS):
            host[(r * PAGES + p // BS) * BS + p % BS] = host_row(r, p)
    if backend == "cuda":
        host = host.pin_memory()  # the gather kernels read pinned host memory directly
    state = HotState(rows, PAGES, MAX_BLOCKS * BS, BS, device=device, ops_backend=backend)
    state.row_counts = RowHotCounts(rows, device=device)
    executor = StepExecutor([state], TransferEngine([dev], [host], BS, ops_backend=backend),
                            rows, PAGES, BS)
    free = list(range(64))
    rng.shuffle(free)
    leases = {r: [free.pop() for _ in range(2)] for r in range(rows)}
    cmd = StepCommand(0, page_rows=[r for r in range(rows) for _ in range(PAGES)],
                      page_indices=list(range(PAGES)) * rows,
                      page_device_blocks=[-1] * (rows * PAGES),
                      page_host_blocks=[r * PAGES + p for r in range(rows) for p in range(PAGES)],
                      hot_leases=[HotLease(r, list(b)) for r, b in leases.items()])
    executor.apply_tables(cmd)
    hot = {r: set() for r in range(rows)}  # a small working set, so slots get hit again
    misses = references = 0
    for step in range(1, 80):
        resizes = []
        for r in range(rows):
            old = leases[r]
            n = rng.randint(1, MAX_BLOCKS)
            if n < len(old):
                for b in old[n:]:  # given back and reused by someone else at once
                    dev[b * BS:(b + 1) * BS] = GARBAGE
                    free.append(b)
                leases[r] = old[:n]
            elif n > len(old):
                leases[r] = old + [free.pop(rng.randrange(len(free))) for _ in range(n - len(old))]
            if leases[r] != old:
                resizes.append(HotLease(r, list(leases[r]), resize=True))
        executor.apply_tables(StepCommand(step, hot_leases=resizes))
        topk = []
        for r in range(rows):
            if not hot[r] or rng.random() < 0.4:
                hot[r].add(rng.randrange(PAGES * BS))
            picks = rng.sample(sorted(hot[r]), min(K, len(hot[r])))
            picks += [rng.randrange(PAGES * BS) for _ in range(K - len(picks))]
            picks = list(dict.fromkeys(picks))
            topk.append(picks + [-1] * (K - len(picks)))
        topk_t = torch.tensor(topk, dtype=torch.int32, device=device)
        res = state.resolve(topk_t, torch.arange(rows, dtype=torch.int32, device=device))
        state.gather(res, [host], [dev])
        out_rows = res.out_rows.cpu()
        for r in range(rows):
            for k, pos in enumerate(topk[r]):
                if pos < 0:
                    continue
                got = dev[int(out_rows[r, k])].cpu()
                assert torch.equal(got, host_row(r, pos)), (seed, step, r, pos)
                references += 1
        misses += int(res.miss_count.sum())
    m, n = state.row_counts.counts.sum(dim=0).cpu().tolist()
    assert (m, n) == (misses, references) and int(state.stats[2]) == misses


def test_region_larger_than_the_table_is_refused():
    state = HotState(1, 4, 2 * BS, BS, ops_backend="reference")
    with pytest.raises(ValueError, match="1 to 2 blocks"):
        state.lease_hot_region(0, [1, 2, 3])
    with pytest.raises(ValueError, match="1 to 2 blocks"):
        state.resize_hot_region(0, [])


def test_counts_skip_padding_and_resident_selections():
    counts = RowHotCounts(3)
    residency = torch.tensor([[5, -1], [-1, -1], [-1, 7]], dtype=torch.int32)
    topk = torch.tensor([[0, 4, -1], [1, 6, 2], [9, 9, 9]], dtype=torch.int32)
    rows = torch.tensor([0, 2, -1], dtype=torch.int32)
    counts.add(topk, rows, residency, torch.tensor([1, 2, 3], dtype=torch.int32), block_size=4)
    # row 0: position 0 resident, 4 host-backed; row 2: 1 and 2 host-backed, 6 resident.
    assert counts.poll(sync=True) == {0: (1, 1), 2: (2, 2)}
    assert counts.poll(sync=True) == {}
