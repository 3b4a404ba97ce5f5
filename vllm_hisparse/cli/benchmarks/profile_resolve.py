"""A few resolve launches of one benchmark case, for Nsight Compute (GPU only).

    ncu --clock-control none --kernel-name regex:resolve_fast --launch-skip 2 \
        --launch-count 1 --set full --import-source yes -o resolve \
        vllm-hisparse bench profile-resolve --batch 64

Builds the case of ``vllm-hisparse bench kernels --only resolve`` (K = 2048, bs = 64,
P = 2048, every selection host-backed, ``--miss`` of them misses), restores the hot state and
flushes L2 before each of ``--launches`` launches, and checks the miss count of the last one.
Launches go through the probe API (:mod:`vllm_hisparse.ops.probe`); ``--general-only``
profiles the general kernel alone.

``--time`` instead prints a short table in the bench's harness (µs per launch, CUDA-graph
replays): the default launch (fast path) cold / warm L2, the general kernel alone cold, and the
launch with eviction classes (``slot_class``, random classes 0..3: the general path) cold, at
``--batches``, plus the cumulative time to each stop point at batch 64 (a quick check inside
a short device lease). ``--resident`` times the same batches with every page resident (FULL
requests: the resolve only maps rows and counts them), with and without the stats counters.
``vllm-hisparse bench ncu-phases`` reads an ncu source export of the profile (instructions and
stall reasons per barrier-delimited phase).
"""

from __future__ import annotations

import argparse
import functools

import torch

from vllm_hisparse.cli.benchmarks.gpu_timing import flush_l2
from vllm_hisparse.cli.benchmarks.kernels import (GENERAL_ONLY, check_resolve, graph_time_resolve,
                                                  make_resolve_sets, reset_hot_state, resolve_args,
                                                  time_all_resident)
from vllm_hisparse.ops import probe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-hisparse bench profile-resolve")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--miss", type=float, default=0.05)
    ap.add_argument("--launches", type=int, default=4)
    ap.add_argument("--general-only", action="store_true",
                    help="launch the general kernel for every request (probe.resolve)")
    ap.add_argument("--time", action="store_true", help="print a timing table instead")
    ap.add_argument("--resident", action="store_true",
                    help="with --time: every page resident, with and without stats")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    a = ap.parse_args(argv)
    if a.time:
        return time_table(a)
    s = make_resolve_sets(a.batch, 2048, a.slots, a.miss, sets=1)[0]
    for _ in range(a.launches):
        reset_hot_state(s)
        flush_l2()
        probe.resolve(*resolve_args(s), general_only=a.general_only)
    torch.cuda.synchronize()
    probe.check_errors()
    got = int(s["miss_count"].sum())
    want = round(2048 * a.miss) * a.batch
    print(f"profile_resolve: batch {a.batch}, D {a.slots}, miss {a.miss}: misses {got} "
          f"(expected {want})")
    return 0 if got == want else 1


def time_table(a) -> int:
    if a.resident:
        print("resolve, every page resident, D 4096, µs per launch: with stats cold / warm, "
              "without stats cold / warm", flush=True)
        for r in time_all_resident(a.batches, iters=24):
            print(f"batch {r['batch']:4d}: {r['us_stats']:5.1f} / {r['us_stats_warm_l2']:5.1f}   "
                  f"without {r['us_no_stats']:5.1f} / {r['us_no_stats_warm_l2']:5.1f}",
                  flush=True)
        return 0
    print(f"resolve, D {a.slots}, miss {a.miss:.0%}, µs per launch: default (fast path) cold / "
          "warm, general kernel alone cold, with eviction classes cold", flush=True)
    for B in a.batches:
        sets = make_resolve_sets(B, 2048, a.slots, a.miss, sets=4)
        cold = graph_time_resolve(sets, flush=True, iters=24)
        warm = graph_time_resolve(sets, flush=False, iters=24)
        general = graph_time_resolve(sets, flush=True, iters=24, launch=GENERAL_ONLY)
        check_resolve(sets, B, a.miss)
        g = torch.Generator(device=sets[0]["lru"].device).manual_seed(B)
        classes = torch.randint(0, 4, tuple(sets[0]["slot_pos"].shape), dtype=torch.uint8,
                                device=sets[0]["lru"].device, generator=g)
        with_classes = graph_time_resolve(
            sets, flush=True, iters=24,
            launch=lambda *args: probe.resolve(*args, slot_class=classes))
        print(f"batch {B:4d}: {cold:5.1f} / {warm:5.1f}   general {general:5.1f}   classes "
              f"{with_classes:5.1f}", flush=True)
        if B == 64:
            stops = {stop: graph_time_resolve(sets, flush=True, iters=24,
                                              launch=functools.partial(probe.resolve, stop=stop))
                     for stop in range(1, probe.NUM_STOPS + 1)}
            print("  default, to stop point (entry, B0, B1, B2, B3), cold: " +
                  ", ".join(f"{v:.1f}" for v in stops.values()) + f", full {cold:.1f}",
                  flush=True)
        del sets
    return 0

