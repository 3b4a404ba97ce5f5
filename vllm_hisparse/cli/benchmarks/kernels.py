"""Kernel benchmarks of the CUDA data plane (GPU only).

    vllm-hisparse bench kernels [--json PATH] [--quick]

* resolve without IO: batch 1/16/64/128/256, K = 2048, D = 4096 and 8192, miss rates
  0/5/15/50 % (of the selections; the rest are hot hits), per-launch time from CUDA-graph
  replays with and without the resolves, L2 flushed before each launch (cold) or not (warm);
  at 5 % also the general kernel alone (the path the fast path hands requests to) and the
  1-token shared-memory plan; the time to each stop point of the default kernel (launch floor,
  row loads, slot table, classify, scan partials) and CTA 0's phase stamps;
* gather_rows GB/s for 2K/16K/128K scattered rows of 656 and 1152 B from a pinned host pool,
  against the contiguous DMA (cudaMemcpyAsync) and contiguous zero-copy ceilings measured in
  the same run, plus a sweep of rows-in-flight per warp and CTAs per SM;
* the torch reference on the GPU as a second baseline (a few points: it is slow);
* page copies (kernel vs one DMA per page) and row mirrors;
* 4 KiB vs 2 MiB host pages for 128K random rows over a 6 GiB host buffer;
* host pool layouts (``--only layout``): one 24 GiB registered host buffer, gathers of 128K random
  positions x all layers (8 and 61 layers, 656 and 1152 B rows) from a layer-major,
  position-major (``[row][layer]``) and page-major (``[block][layer][offset]``) carving of it,
  plus a rows-in-flight x CTAs/SM sweep and the work order (pair-major vs layer-major);
* translation reach (``--only reach``, :mod:`.reach`): one layer's gather of 16K (and 128K)
  random rows drawn from 256 MiB ... 8 GiB of one registered host buffer, 656 and 1152 B rows;
  and one layer's gather of a DeepSeek-V3.2 / GLM-5.1 batch's misses (80 requests x 205, 32K
  contexts in consecutive host rows, request-major) from a layer-major and a position-major
  carving of the buffer, default vs narrower grids, warm vs cold translation caches;
* score classes (``--only score``): the slot classes of score-aware eviction per index group
  and step (batch 64, W 32768, K 2048, D 4096), the two CUDA launches against the torch twin
  (``cli/benchmarks/score_classes.py``).

Prints a table and writes every number as JSON with --json.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import statistics
import sys
import time

import torch

from vllm_hisparse.cli.benchmarks.gpu_timing import DEV, RESULTS, flush_l2, log, spin_clocks
from vllm_hisparse.cli.benchmarks.host_reads import (bench_copies, bench_gather, bench_huge_pages,
                                                    bench_layout)
from vllm_hisparse.cli.benchmarks.reach import bench_reach
from vllm_hisparse.cli.benchmarks.score_classes import bench_score
from vllm_hisparse.ops import probe, reference
from vllm_hisparse.ops.tuning import KernelTuning

#: The general kernel alone for every request (the path the fast path hands over to): the
#: production kernel, launched through the probe API.
GENERAL_ONLY = functools.partial(probe.resolve, general_only=True)
#: Shared memory planned for one token per request.
ONE_TOKEN_PLAN = functools.partial(probe.resolve,
                                   tuning=KernelTuning(max_tokens_per_request=1))


# --------------------------------------------------------------------------------------
# resolve
# --------------------------------------------------------------------------------------


def make_resolve_sets(B, K, D, miss, sets, bs=64, num_pages=2048, all_resident=False):
    """`sets` independent input sets: each request's hot region holds D host-backed positions,
    its K selections are (1 - miss) * K hits and miss * K misses, all distinct.
    `all_resident`: the same selections, but every page of every request is resident and no
    request has a hot region (FULL requests: the resolve touches no hot state)."""
    R = B
    P = num_pages
    npos = P * bs
    out = []
    g = torch.Generator(device=DEV).manual_seed(B * 1000 + D + int(miss * 100))
    for _ in range(sets):
        residency = torch.full((R, P), -1, dtype=torch.int32, device=DEV)
        # the two tail pages of each request are resident (they always are)
        residency[:, -2:] = torch.arange(2 * R, dtype=torch.int32, device=DEV).reshape(R, 2)
        host_blocks = torch.randperm(R * P, device=DEV, generator=g).reshape(R, P).to(torch.int32)
        hot_blocks = (torch.randperm(R * (D // bs), device=DEV, generator=g).reshape(R, -1)
                      .to(torch.int32) + 2 * R)
        keys = torch.rand(R, npos - 2 * bs, device=DEV, generator=g)
        perm = keys.argsort(dim=1).to(torch.int32)  # random distinct host-backed positions
        slot_pos = perm[:, :D].contiguous()
        n_miss = int(round(K * miss))
        n_hit = K - n_miss
        hit_idx = torch.rand(R, D, device=DEV, generator=g).argsort(dim=1)[:, :n_hit]
        hits = torch.gather(slot_pos, 1, hit_idx)
        misses = perm[:, D:D + n_miss]
        topk = torch.cat([hits, misses], dim=1)
        topk = torch.gather(topk, 1, torch.rand(R, K, device=DEV, generator=g).argsort(dim=1))
        lru = torch.rand(R, D, device=DEV, generator=g).argsort(dim=1).to(torch.int16)
        if all_resident:
            residency = torch.randperm(R * P, device=DEV, generator=g).reshape(R, P).to(
                torch.int32)
            hot_blocks.fill_(-1)
            slot_pos.fill_(-1)
        token_rows = torch.arange(R, dtype=torch.int32, device=DEV)
        st = dict(topk=topk.contiguous(), token_rows=token_rows, residency=residency,
                  host_blocks=host_blocks, hot_blocks=hot_blocks, slot_pos=slot_pos,
                  lru=lru, slot_pos0=slot_pos.clone(), lru0=lru.clone(),
                  out_rows=torch.empty((R, K), dtype=torch.int32, device=DEV),
                  miss_src=torch.empty((R, K), dtype=torch.int32, device=DEV),
                  miss_dst=torch.empty((R, K), dtype=torch.int32, device=DEV),
                  miss_count=torch.empty((R,), dtype=torch.int32, device=DEV),
                  stats=torch.zeros(3, dtype=torch.int64, device=DEV))
        out.append(st)
    return out


def resolve_args(s):
    return (s["topk"], s["token_rows"], s["residency"], s["host_blocks"], s["hot_blocks"],
            s["slot_pos"], s["lru"], 64, s["out_rows"], s["miss_src"], s["miss_dst"],
            s["miss_count"], s["stats"])


def graph_time_resolve(sets, flush: bool, iters: int, steady: bool = True,
                       launch=None) -> float:
    """Per-launch µs of resolve inside a CUDA graph: a graph of `iters` x [restore the hot
    state of set i, (flush L2), resolve set i] minus the same graph without the resolves,
    each the median of 7 replays timed with events. `steady`: one untimed replay and a
    ~30 ms spin before each series, so that the GPU clocks are at their working level.
    `launch`: the resolve to time, called with `resolve_args(set)` (default: the production
    kernel; GENERAL_ONLY, ONE_TOKEN_PLAN or a probe.resolve partial with a stop point)."""
    launch = probe.resolve if launch is None else launch

    def build(with_resolve):
        for s in sets:  # warm-up outside capture (module load, smem opt-in)
            if with_resolve:
                launch(*resolve_args(s))
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(iters):
                s = sets[i % len(sets)]
                s["slot_pos"].copy_(s["slot_pos0"])
                s["lru"].copy_(s["lru0"])
                if flush:
                    flush_l2()
                if with_resolve:
                    launch(*resolve_args(s))
        return g

    def replay_us(g):
        ts = []
        if steady:
            g.replay()
            spin_clocks()
        for _ in range(7):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1000.0)
        return statistics.median(ts)

    flush_l2()
    g1 = build(True)
    g0 = build(False)
    t1 = replay_us(g1)
    t0 = replay_us(g0)
    del g1, g0
    probe.check_errors()
    return max(0.0, (t1 - t0) / iters)


def without_stats(*args):
    """The production resolve without the distinct counters (``stats=None``)."""
    probe.resolve(*args[:-1], None)


def time_all_resident(batches, iters: int) -> list[dict]:
    """µs per launch with every page resident (5 % of the selections would miss otherwise),
    with and without the stats counters, cold / warm L2, at each batch (D 4096)."""
    rows = []
    for B in batches:
        sets = make_resolve_sets(B, 2048, 4096, 0.05, sets=4, all_resident=True)
        row = dict(batch=B)
        for name, launch in (("stats", None), ("no_stats", without_stats)):
            row[f"us_{name}"] = graph_time_resolve(sets, flush=True, iters=iters, launch=launch)
            row[f"us_{name}_warm_l2"] = graph_time_resolve(sets, flush=False, iters=iters,
                                                           launch=launch)
        check_resolve(sets, B, 0.0)
        assert int(sets[0]["stats"][0]) > 0  # the distinct resident positions were counted
        rows.append(row)
        del sets
    return rows


def reset_hot_state(s):
    """Restore the set's slot_pos and lru to their state before any launch."""
    s["slot_pos"].copy_(s["slot_pos0"])
    s["lru"].copy_(s["lru0"])


def check_resolve(sets, B, miss):
    """One production launch of set 0: exact miss count."""
    s = sets[0]
    reset_hot_state(s)
    probe.resolve(*resolve_args(s))
    torch.cuda.synchronize()
    probe.check_errors()
    got = int(s["miss_count"].sum())
    assert got == round(2048 * miss) * B, (got, miss, B)


def resolve_phase_stamps(B: int, reps: int = 9, steady: bool = True) -> dict:
    """Median %globaltimer intervals of CTA 0 (µs), cold L2, D 4096, miss 5 %, and the SM
    clock of that CTA (clock64 cycles over globaltimer ns between stamps 0 and 6)."""
    names = ["row loads", "slot table", "classify", "scan partials", "LRU order+victims",
             "misses+writes"]
    sets = make_resolve_sets(B, 2048, 4096, 0.05, sets=1)
    s = sets[0]
    dt = torch.zeros(probe.NUM_TIMES, dtype=torch.int64, device=DEV)
    acc = []
    for _ in range(reps):
        reset_hot_state(s)
        if steady:
            spin_clocks(10.0)
        flush_l2()
        probe.resolve(*resolve_args(s), times=dt)
        torch.cuda.synchronize()
        v = dt.tolist()
        acc.append([(v[i + 1] - v[i]) / 1000.0 for i in range(6)] + [(v[6] - v[0]) / 1000.0]
                   + [(v[8] - v[7]) / max(1, v[6] - v[0]) * 1000.0])
    med = [statistics.median(a[i] for a in acc) for i in range(8)]
    return dict(zip(names + ["total", "sm_mhz"], med))


def bench_resolve(quick: bool):
    log("\n== resolve without IO (K = 2048, bs = 64, P = 2048, median µs per launch) ==")
    iters = 12 if quick else 24
    rows = []
    batches = [1, 16, 64, 128, 256] if not quick else [1, 64, 256]
    misses = (0.0, 0.05, 0.15, 0.5)
    for D in (4096, 8192):
        for B in batches:
            for miss in misses:
                sets = make_resolve_sets(B, 2048, D, miss, sets=4)
                row = dict(D=D, batch=B, miss=miss,
                           us=graph_time_resolve(sets, flush=True, iters=iters),
                           us_warm_l2=graph_time_resolve(sets, flush=False, iters=iters))
                if miss == 0.05 and B == 64:
                    # the bench's earlier method: no untimed replay, no spin (idle clocks)
                    row["us_idle_clocks"] = graph_time_resolve(sets, flush=True, iters=iters,
                                                               steady=False)
                    row["us_general_idle_clocks"] = graph_time_resolve(
                        sets, flush=True, iters=iters, steady=False, launch=GENERAL_ONLY)
                if miss == 0.05:
                    # shared memory planned for 1 token per request, and the general kernel
                    row["us_1tok"] = graph_time_resolve(sets, flush=True, iters=iters,
                                                        launch=ONE_TOKEN_PLAN)
                    row["us_general"] = graph_time_resolve(sets, flush=True, iters=iters,
                                                           launch=GENERAL_ONLY)
                    row["us_general_warm_l2"] = graph_time_resolve(sets, flush=False,
                                                                   iters=iters,
                                                                   launch=GENERAL_ONLY)
                rows.append(row)
                check_resolve(sets, B, miss)
                del sets
    RESULTS["resolve"] = rows
    log("cold = L2 flushed before each launch; warm = not flushed; max_tokens_per_request 4 "
        "(default); per-launch time from CUDA-graph replays with and without the resolves, "
        "after a 30 ms spin (working clocks)")
    r = next(r for r in rows if r["D"] == 4096 and r["batch"] == 64 and r["miss"] == 0.05)
    log(f"batch 64, D 4096, miss 5 %, cold, without the spin (earlier method): default "
        f"{r['us_idle_clocks']:.1f} µs, general kernel alone {r['us_general_idle_clocks']:.1f} µs")
    log(f"{'D':>6} {'batch':>6} | " + " | ".join(f"miss {int(m * 100):>2}% cold/warm"
                                                 for m in misses)
        + " | 5%: general kernel alone cold/warm, 1-token plan cold")
    for D in (4096, 8192):
        for B in batches:
            cells = []
            r5 = None
            for m in misses:
                r = next(r for r in rows if r["D"] == D and r["batch"] == B and r["miss"] == m)
                cells.append(f"{r['us']:6.1f} / {r['us_warm_l2']:5.1f}")
                if m == 0.05:
                    r5 = r
            log(f"{D:>6} {B:>6} | " + " | ".join(cells) +
                f" | {r5['us_general']:6.1f} / {r5['us_general_warm_l2']:5.1f}, "
                f"{r5['us_1tok']:5.1f}")

    resident = time_all_resident(batches, iters)
    RESULTS["resolve_all_resident"] = resident
    for r in resident:
        log(f"every page resident, batch {r['batch']}, D 4096: with stats "
            f"{r['us_stats']:.1f} / {r['us_stats_warm_l2']:.1f} µs, without "
            f"{r['us_no_stats']:.1f} / {r['us_no_stats_warm_l2']:.1f} (cold / warm)")

    # Cumulative time to each stop point (every CTA returns there), same harness, cold L2.
    stops = ["entry (launch floor)", "row loads + B0", "slot table + B1", "classify + B2",
             "scan partials + B3", "full"]
    cum = {}
    for B in (1, 64, 256):
        sets = make_resolve_sets(B, 2048, 4096, 0.05, sets=4)
        vals = {}
        for stop in (1, 2, 3, 4, 5, 0):
            vals[stops[stop - 1]] = graph_time_resolve(
                sets, flush=True, iters=iters, launch=functools.partial(probe.resolve, stop=stop))
        cum[f"batch{B}"] = vals
        check_resolve(sets, B, 0.05)
        del sets
        log(f"resolve to stop point, batch {B}, D 4096, miss 5%, cold (µs, cumulative): " +
            ", ".join(f"{k} {v:.1f}" for k, v in vals.items()))
    RESULTS["resolve_stops"] = cum

    # where the time goes inside CTA 0 (%globaltimer stamps, cold L2)
    phases = {}
    for B, steady in ((1, True), (64, True), (64, False)):
        key = f"batch{B}" + ("" if steady else "_idle_clocks")
        phases[key] = resolve_phase_stamps(B, steady=steady)
        log(f"resolve phases, batch {B}, D 4096, miss 5%, CTA 0, "
            f"{'after a spin' if steady else 'no spin'} (µs; SM MHz): " +
            ", ".join(f"{k} {v:.2f}" for k, v in phases[key].items()))
    RESULTS["resolve_phases"] = phases
    info = {str(tok): probe.launch_info(64, 2048, 4096, 64, 2048,
                                        tuning=KernelTuning(max_tokens_per_request=tok))
            for tok in (1, 4)}
    RESULTS["resolve_launch_info_D4096"] = info
    log("launch info (T=64, K=2048, D=4096, P=2048):", info)

    # torch reference on the GPU, a few points
    ref_rows = []
    for B, miss in ((1, 0.05), (16, 0.05)):
        sets = make_resolve_sets(B, 2048, 4096, miss, sets=1)
        s = sets[0]
        t0 = time.perf_counter()
        n = 3
        for _ in range(n):
            reset_hot_state(s)
            reference.resolve(*resolve_args(s))
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / n * 1e6
        ref_rows.append(dict(D=4096, batch=B, miss=miss, us=us))
        log(f"torch reference on GPU: batch {B}, D 4096, miss {miss:.0%}: {us:,.0f} µs")
    RESULTS["resolve_reference_gpu"] = ref_rows


def profile_resolve(B: int, launches: int = 4) -> None:
    """A few resolve launches of one batch (for `ncu -k regex:resolve_`)."""
    sets = make_resolve_sets(B, 2048, 4096, 0.05, sets=1)
    s = sets[0]
    for _ in range(launches):
        reset_hot_state(s)
        probe.resolve(*resolve_args(s))
    torch.cuda.synchronize()
    probe.check_errors()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write all results to this path")
    ap.add_argument("--quick", action="store_true", help="fewer points and repetitions")
    ap.add_argument("--only", default="resolve,gather,copies,huge,layout,reach",
                    help="comma-separated subset of resolve,gather,copies,huge,layout,reach,"
                         "score (score is run only when named)")
    ap.add_argument("--profile-resolve", type=int, metavar="BATCH",
                    help="only run 4 resolve launches of this batch (D 4096, miss 5 %%) for a "
                         "profiler, e.g. ncu -k regex:resolve_ --launch-skip 3")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not probe.available():
        print("bench_kernels: needs a CUDA device and the compiled extension", file=sys.stderr)
        return 2
    if args.profile_resolve:
        profile_resolve(args.profile_resolve)
        return 0
    props = torch.cuda.get_device_properties(DEV)
    RESULTS["device"] = dict(name=props.name, sms=props.multi_processor_count,
                             torch=torch.__version__, cuda=torch.version.cuda,
                             date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                             command=" ".join(sys.argv))
    log(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    only = set(args.only.split(","))
    steps = [("resolve", bench_resolve), ("layout", bench_layout), ("gather", bench_gather),
             ("copies", bench_copies), ("huge", bench_huge_pages), ("reach", bench_reach),
             ("score", bench_score)]
    for name, fn in steps:
        if name in only:
            try:
                fn(args.quick)
            except Exception as exc:  # keep the other sections' numbers
                log(f"{name}: FAILED: {exc!r}")
                RESULTS[f"{name}_error"] = repr(exc)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(RESULTS, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
