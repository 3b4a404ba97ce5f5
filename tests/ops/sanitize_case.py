"""A representative run of every CUDA op, small enough for compute-sanitizer.

    compute-sanitizer --tool memcheck  python tests/ops/sanitize_case.py
    compute-sanitizer --tool racecheck python tests/ops/sanitize_case.py

Resolves a batch with spec-decode requests (2 and 6 tokens of K = 2048), hits, misses, duplicates, padding, a fully
resident request and stats, single-token requests at K = 2048, D = 4096 (the fast path) and with eviction classes and a partial
hot region (the general path), then runs gather_rows (pinned host -> device), copy_blocks (both
directions), mirror_rows and a gather from row-strided (position-major) host layers, and checks every result against the reference twins. Also
exercises the error path (one failing request). Exits non-zero on any mismatch.
"""

from __future__ import annotations

import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cuda_harness import (DEV, assert_same, big_case, cap_distinct, distinct_rows,  # noqa: E402
                          layers, random_plan)
from vllm_hisparse.ops import cuda as cuda_ops  # noqa: E402
from vllm_hisparse.ops import reference  # noqa: E402
from vllm_hisparse.ops.errors import ResolveError  # noqa: E402


def resolve_steps(case, steps: int, what: str):
    """`steps` resolves of `case` on the GPU and by the reference, each from the reference's
    state after the previous one; every output compared. Returns the last (ref, gpu) cases."""
    for step in range(steps):
        ref = case.clone()
        gpu = case.clone(DEV)
        reference.resolve(*ref.args())
        cuda_ops.resolve(*gpu.args())
        cuda_ops.check_errors(DEV)
        assert_same(ref.state(), gpu.state(), f"{what} step {step}")
        case = ref
    return ref, gpu


def main() -> int:
    rng = random.Random(5)
    case = big_case(rng, num_requests=5, tokens_per_request=2, k=256, num_slots=1024,
                    block_size=64, num_pages=64, resident_fraction=0.3, hit_fraction=0.5,
                    dup=0.1, padding=0.05)
    case = cap_distinct(case)
    # request 0 fully resident
    r0 = int(case.token_rows[0])
    case.residency[r0] = torch.arange(case.residency.shape[1], dtype=torch.int32) + 10_000
    case, gpu = resolve_steps(case, 2, "resolve")

    # Spec-decode requests of 6 tokens of K = 2048: past one register chunk of selections
    # per thread, the kernel's multi-chunk path (barriers between chunks).
    long_case = cap_distinct(big_case(rng, num_requests=2, tokens_per_request=6, k=2048,
                                      num_slots=8192, block_size=64, num_pages=512,
                                      resident_fraction=0.3, hit_fraction=0.5, dup=0.1))
    resolve_steps(long_case, 1, "resolve, 6-token requests")

    # Single-token requests at the production shape (K = 2048, D = 4096): the fast path; one
    # of them repeats a position (a repeated miss is handed to the general path in the launch).
    fast_case = big_case(rng, num_requests=4, tokens_per_request=1, k=2048, num_slots=4096,
                         block_size=64, num_pages=512, resident_fraction=0.3,
                         hit_fraction=0.7, padding=0.02)
    fast_case = distinct_rows(fast_case)  # distinct selections per row, as the indexer gives
    fast_case.topk[3, 1] = fast_case.topk[3, 0]  # request 3 repeats a position (exact either way)
    resolve_steps(fast_case, 2, "resolve, single-token")

    # Eviction classes and a partial hot region (a quarter of the hot blocks -1, their slots
    # empty) at the production shape: the general path's class scans and victim walk.
    class_case = big_case(rng, num_requests=3, tokens_per_request=1, k=2048, num_slots=4096,
                          block_size=64, num_pages=512, resident_fraction=0.3,
                          hit_fraction=0.5, padding=0.02)
    class_case = distinct_rows(class_case)
    nb = class_case.hot_blocks.shape[1]
    class_case.hot_blocks[:, 3 * nb // 4:] = -1
    class_case.slot_pos[:, 3 * nb // 4 * 64:] = -1
    class_case = cap_distinct(class_case)
    class_case.slot_class = torch.randint(0, 5, tuple(class_case.slot_pos.shape),
                                          dtype=torch.uint8)
    resolve_steps(class_case, 2, "resolve, classes and a partial region")

    # gather the last plan into device rows
    L, row_bytes = 2, 656
    R, P, bs = case.residency.shape[0], case.residency.shape[1], case.block_size
    host = layers(L, R * P * bs, row_bytes, "cpu", pinned=True, seed=1)
    dev_rows = (R * P + case.hot_blocks.numel()) * bs + 20_000 * bs
    dev = layers(L, dev_rows, row_bytes, DEV, seed=2)
    expect = [d.cpu() for d in dev]
    reference.gather_rows(host, expect, gpu.miss_src.cpu(), gpu.miss_dst.cpu(),
                          gpu.miss_count.cpu())
    cuda_ops.gather_rows(host, dev, gpu.miss_src, gpu.miss_dst, gpu.miss_count)
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dev[l].cpu(), expect[l]), "gather"

    ms, md, mc = random_plan(5, 64, 3000, 900, seed=3)
    for rpw in (1, 8):
        src = layers(3, 3000, 1152, "cpu", pinned=True, seed=4)
        dst = layers(3, 900, 1152, DEV, seed=5)
        exp = [d.cpu() for d in dst]
        reference.gather_rows(src, exp, ms, md, mc)
        cuda_ops.gather_rows_tuned(src, dst, ms.to(DEV), md.to(DEV), mc.to(DEV),
                                   rows_per_warp=rpw, ctas_per_sm=2)
        torch.cuda.synchronize()
        for l in range(3):
            assert torch.equal(dst[l].cpu(), exp[l]), f"gather 1152 rpw {rpw}"

    # page copies both ways and mirrors
    dev_pool = layers(2, 16 * 64, 656, DEV, seed=6)
    host_pool = layers(2, 24 * 64, 656, "cpu", pinned=True, seed=7)
    sb = torch.tensor([3, -1, 5, 0], dtype=torch.int32)
    db = torch.tensor([20, 4, -1, 7], dtype=torch.int32)
    exp = [h.clone() for h in host_pool]
    reference.copy_blocks([d.cpu() for d in dev_pool], exp, sb, db, 64)
    cuda_ops.copy_blocks(dev_pool, host_pool, sb.to(DEV), db.to(DEV), 64)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(host_pool, exp)), "spill"
    exp = [d.cpu() for d in dev_pool]
    reference.copy_blocks(host_pool, exp, db, sb, 64)
    cuda_ops.copy_blocks(host_pool, dev_pool, db.to(DEV), sb.to(DEV), 64)
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dev_pool, exp)), "restore"
    sr = torch.tensor([1, 2, -1, 900], dtype=torch.int32)
    dr = torch.tensor([5, -1, 6, 1000], dtype=torch.int32)
    exp = [h.clone() for h in host_pool]
    reference.mirror_rows([d.cpu() for d in dev_pool], exp, sr, dr)
    cuda_ops.mirror_rows(dev_pool, host_pool, sr.to(DEV), dr.to(DEV))
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(host_pool, exp)), "mirror"

    # row-strided (position-major) host layers: gather with all layers of a row per warp
    Ls, rbs = 3, 656
    hbuf = torch.randint(0, 256, (2000, Ls * rbs), dtype=torch.uint8).pin_memory()
    hviews = [hbuf[:, l * rbs:(l + 1) * rbs] for l in range(Ls)]
    dst = layers(Ls, 700, rbs, DEV, seed=8)
    exp = [d.cpu() for d in dst]
    ms, md, mc = random_plan(4, 64, 2000, 700, seed=9)
    reference.gather_rows(hviews, exp, ms, md, mc)
    for rpw, pm in ((16, True), (4, False)):
        out = [d.clone() for d in dst]
        cuda_ops.gather_rows_tuned(hviews, out, ms.to(DEV), md.to(DEV), mc.to(DEV),
                                   rows_per_warp=rpw, ctas_per_sm=2, pair_major=pm)
        torch.cuda.synchronize()
        assert all(torch.equal(a.cpu(), b) for a, b in zip(out, exp)), f"strided gather {rpw}"

    # error path: one failing request among good ones
    bad = case.clone(DEV)
    bad.topk[2, 3] = 10 ** 7
    cuda_ops.resolve(*bad.args())
    try:
        cuda_ops.check_errors(DEV)
    except ResolveError as e:
        print("expected error:", e)
    else:
        raise AssertionError("no error recorded")
    print("sanitize_case: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
