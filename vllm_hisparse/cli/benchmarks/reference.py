"""CPU timing of the reference ``resolve``: the baseline the CUDA kernels are compared with.

Default shape: T = 64 single-token requests, K = 2048, D = 4096 hot slots, 32K-token contexts
in 64-token pages, with a realistic mix of selections (resident / hot hit / miss fractions are
arguments). Prints a table; ``--json PATH`` writes the numbers.

    vllm-hisparse bench reference
    vllm-hisparse bench reference --requests 16 --resident 0.2 --miss 0.15 --json out.json
"""

from __future__ import annotations

import platform
import statistics
import time

import torch

from vllm_hisparse.cli.args import CliParser, fraction, output_path, positive_int
from vllm_hisparse.cli.output import write_json
from vllm_hisparse.ops import reference


def build_case(num_requests: int, k: int, num_slots: int, context_tokens: int, block_size: int,
               resident_frac: float, miss_frac: float, seed: int):
    """Per request: a quarter of the pages resident (plus the 2-page tail), the hot region
    full of host-backed positions, and top-k drawn so that about ``resident_frac`` of the
    selections are resident, ``miss_frac`` miss and the rest hit."""
    g = torch.Generator().manual_seed(seed)
    num_pages = context_tokens // block_size
    residency = torch.full((num_requests, num_pages), -1, dtype=torch.int32)
    host_blocks = torch.arange(num_requests * num_pages, dtype=torch.int32).view(num_requests,
                                                                                 num_pages)
    hot_blocks = torch.arange(num_requests * (num_slots // block_size),
                              dtype=torch.int32).view(num_requests, -1) + 1_000_000
    slot_pos = torch.empty((num_requests, num_slots), dtype=torch.int32)
    lru = torch.empty((num_requests, num_slots), dtype=torch.int16)
    topk = torch.empty((num_requests, k), dtype=torch.int32)
    n_res = int(k * resident_frac)
    n_miss = int(k * miss_frac)
    n_hit = k - n_res - n_miss
    for r in range(num_requests):
        resident_pages = torch.randperm(num_pages, generator=g)[: num_pages // 4].tolist()
        resident_pages += [num_pages - 2, num_pages - 1]
        residency[r, resident_pages] = torch.arange(len(resident_pages), dtype=torch.int32) + r * num_pages
        is_res = residency[r] >= 0
        positions = torch.arange(num_pages * block_size)
        res_pos = positions[is_res.repeat_interleave(block_size)]
        host_pos = positions[~is_res.repeat_interleave(block_size)]
        host_pos = host_pos[torch.randperm(host_pos.numel(), generator=g)]
        held = host_pos[:num_slots]
        fresh = host_pos[num_slots:]
        slot_pos[r] = held.to(torch.int32)
        lru[r] = torch.randperm(num_slots, generator=g).to(torch.int16)
        sel = torch.cat([
            res_pos[torch.randperm(res_pos.numel(), generator=g)[:n_res]],
            held[torch.randperm(num_slots, generator=g)[:n_hit]],
            fresh[:n_miss],
        ])
        topk[r] = sel[torch.randperm(k, generator=g)].to(torch.int32)
    token_rows = torch.arange(num_requests, dtype=torch.int32)
    outs = [torch.empty((num_requests, k), dtype=torch.int32) for _ in range(3)]
    return [topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru, block_size,
            outs[0], outs[1], outs[2], torch.empty(num_requests, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int64)]


def main(argv=None) -> int:
    p = CliParser(prog="vllm-hisparse bench reference", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=positive_int, default=64)
    p.add_argument("--topk", type=positive_int, default=2048)
    p.add_argument("--hot-slots", type=positive_int, default=4096)
    p.add_argument("--context", type=positive_int, default=32768)
    p.add_argument("--block-size", type=positive_int, default=64)
    p.add_argument("--resident", type=fraction, default=0.3,
                   help="fraction of selections resident")
    p.add_argument("--miss", type=fraction, default=0.05,
                   help="fraction of selections that miss")
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--json", metavar="PATH", type=output_path)
    a = p.parse_args(argv)
    _check(p, a)

    times_ms = []
    stats = None
    for rep in range(a.repeats + 1):
        args = build_case(a.requests, a.topk, a.hot_slots, a.context, a.block_size, a.resident,
                          a.miss, seed=rep)
        start = time.perf_counter()
        reference.resolve(*args)
        elapsed = (time.perf_counter() - start) * 1e3
        if rep:  # the first call warms up allocators and caches
            times_ms.append(elapsed)
            stats = args[-1].tolist()
        print(f"  repeat {rep}/{a.repeats}: {elapsed:.1f} ms", flush=True)
    median_ms = statistics.median(times_ms)
    result = {
        "op": "reference.resolve", "device": "cpu", "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(), "requests": a.requests, "topk": a.topk,
        "hot_slots": a.hot_slots, "context_tokens": a.context, "block_size": a.block_size,
        "distinct_resident_hit_miss": stats, "median_ms": median_ms,
        "us_per_request": median_ms * 1e3 / a.requests,
    }
    print()
    print("| op | T | K | D | resident/hit/miss (distinct) | median ms | µs per request |")
    print("|---|---|---|---|---|---|---|")
    print(f"| reference.resolve (CPU, {result['torch_threads']} threads) | {a.requests} | {a.topk} "
          f"| {a.hot_slots} | {'/'.join(map(str, stats))} | {median_ms:.1f} "
          f"| {result['us_per_request']:.0f} |")
    if a.json and not write_json("--json", a.json, result, command="bench reference"):
        return 1
    return 0


def _check(p, a) -> None:
    """The shape constraints ``build_case`` relies on, as flag errors."""
    pages = a.context // a.block_size
    if a.context % a.block_size or pages < 4:
        p.error(f"--context {a.context} must be a multiple of --block-size {a.block_size} "
                f"and hold at least 4 pages")
    if a.resident + a.miss > 1:
        p.error(f"--resident {a.resident:g} + --miss {a.miss:g} must be at most 1")
    if a.hot_slots % a.block_size:
        p.error(f"--hot-slots {a.hot_slots} must be a multiple of --block-size {a.block_size}")
    if a.hot_slots > 32768:
        p.error(f"--hot-slots {a.hot_slots}: at most 32768 (int16 LRU)")
    host_rows = (pages - pages // 4 - 2) * a.block_size
    if a.hot_slots + int(a.topk * a.miss) > host_rows:
        p.error(f"--hot-slots {a.hot_slots} + the misses of --topk {a.topk} need more "
                f"host-backed positions than --context {a.context} has ({host_rows})")
    if int(a.topk * a.resident) > max(pages // 4, 2) * a.block_size or \
            a.topk - int(a.topk * a.resident) - int(a.topk * a.miss) > a.hot_slots:
        p.error(f"--topk {a.topk} does not fit the case: more resident or hit selections "
                f"than --context / --hot-slots hold")


if __name__ == "__main__":
    raise SystemExit(main())
