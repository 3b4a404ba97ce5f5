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
  plus a rows-in-flight x CTAs/SM sweep and the work order (pair-major vs layer-major).

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

from vllm_hisparse.ops import probe, reference
from vllm_hisparse.ops.tuning import KernelTuning

DEV = torch.device("cuda")
RESULTS: dict = {}
#: The general kernel alone for every request (the path the fast path hands over to): the
#: production kernel, launched through the probe API.
GENERAL_ONLY = functools.partial(probe.resolve, general_only=True)
#: Shared memory planned for one token per request.
ONE_TOKEN_PLAN = functools.partial(probe.resolve,
                                   tuning=KernelTuning(max_tokens_per_request=1))


def log(*a):
    print(*a, flush=True)


# --------------------------------------------------------------------------------------
# timing helpers
# --------------------------------------------------------------------------------------

_flush_buf = None


def flush_l2():
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    _flush_buf.fill_(1)  # 128 MiB > 60 MB of L2


def time_events(fn, reps: int, before=None, flush=True) -> float:
    """Median µs of fn() between two events; `before(i)` and an L2 flush run outside."""
    times = []
    for i in range(reps):
        if before is not None:
            before(i)
        if flush:
            flush_l2()
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0)
    return statistics.median(times)


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


def spin_clocks(ms: float = 30.0) -> None:
    """Keep the GPU busy for about `ms` so that its clocks leave the idle state before a
    timing (the SM clock is read back in resolve_phase_stamps)."""
    torch.cuda._sleep(int(ms * 1e-3 * 1.98e9))


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


# --------------------------------------------------------------------------------------
# gather and ceilings
# --------------------------------------------------------------------------------------


def plan_for(n_rows, K, src_rows, dst_rows, g, contiguous=False):
    T = (n_rows + K - 1) // K
    if contiguous:
        src = torch.arange(T * K, dtype=torch.int32, device=DEV).reshape(T, K)
        dst = torch.arange(T * K, dtype=torch.int32, device=DEV).reshape(T, K)
    else:
        src = torch.randint(0, src_rows, (T, K), dtype=torch.int32, device=DEV, generator=g)
        dst = torch.randperm(dst_rows, device=DEV, generator=g)[:T * K].reshape(T, K).to(torch.int32)
    count = torch.full((T,), K, dtype=torch.int32, device=DEV)
    count[-1] = n_rows - (T - 1) * K
    return src, dst, count


def gather_gbps(src_layers, dst_layers, n_rows, row_bytes, reps, rpw=None, cps=None,
                contiguous=False, plans=4, span_rows=None):
    g = torch.Generator(device=DEV).manual_seed(n_rows + row_bytes)
    src_rows = src_layers[0].shape[0] if span_rows is None else span_rows
    dst_rows = dst_layers[0].shape[0]
    ps = [plan_for(n_rows, 2048, src_rows, dst_rows, g, contiguous) for _ in range(plans)]
    tuning = KernelTuning(copy_rows_per_warp=rpw or 0, copy_ctas_per_sm=cps or 0)

    def fn(i):
        s, d, c = ps[i % len(ps)]
        probe.gather_rows(src_layers, dst_layers, s, d, c, tuning=tuning)

    fn(0)
    us = time_events(fn, reps, flush=True)
    nbytes = n_rows * row_bytes * len(src_layers)
    return nbytes / (us * 1e-6) / 1e9, us


def dma_ceiling(nbytes=512 << 20):
    h = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    d = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    h.fill_(3)
    d.copy_(h, non_blocking=True)
    h2d = time_events(lambda i: d.copy_(h, non_blocking=True), 10, flush=False)
    d2h = time_events(lambda i: h.copy_(d, non_blocking=True), 10, flush=False)
    del h, d
    return nbytes / (h2d * 1e-6) / 1e9, nbytes / (d2h * 1e-6) / 1e9


def bench_gather(quick: bool):
    log("\n== gather_rows from pinned host (GB/s) ==")
    h2d, d2h = dma_ceiling()
    log(f"contiguous DMA ceiling: H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    RESULTS["dma_ceiling"] = dict(h2d=h2d, d2h=d2h)
    host_bytes = 4 << 30
    out = {}
    for row_bytes in (656, 1152):
        src_rows = host_bytes // row_bytes
        host = torch.empty((src_rows, row_bytes), dtype=torch.uint8).pin_memory()
        host.view(-1)[:: 1 << 20].fill_(7)
        dev = torch.empty((300_000, row_bytes), dtype=torch.uint8, device=DEV)
        # contiguous zero-copy ceiling (sequential rows), best of a small sweep
        zc = max(gather_gbps([host], [dev], 131072, row_bytes, 10, rpw, 4, contiguous=True)[0]
                 for rpw in (2, 4, 8))
        log(f"{row_bytes} B: contiguous zero-copy ceiling {zc:.1f} GB/s")
        sweep = []
        for rpw in (1, 2, 4, 8):
            for cps in (2, 4, 8):
                gb, _ = gather_gbps([host], [dev], 16384, row_bytes, 15 if not quick else 6,
                                    rpw, cps)
                sweep.append(dict(rows_per_warp=rpw, ctas_per_sm=cps, gbps=gb))
        best = max(sweep, key=lambda r: r["gbps"])
        log(f"{row_bytes} B sweep at 16K rows: " + ", ".join(
            f"{r['rows_per_warp']}r/{r['ctas_per_sm']}c {r['gbps']:.1f}" for r in sweep))
        table = []
        for n in (2048, 8192, 16384, 131072):
            gb_def, us_def = gather_gbps([host], [dev], n, row_bytes, 20 if not quick else 8)
            gb_best, _ = gather_gbps([host], [dev], n, row_bytes, 20 if not quick else 8,
                                     best["rows_per_warp"], best["ctas_per_sm"])
            gb_one, _ = gather_gbps([host], [dev], n, row_bytes, 20 if not quick else 8, 1, 8)
            table.append(dict(rows=n, default_gbps=gb_def, default_us=us_def,
                              best_gbps=gb_best, one_row_per_warp_gbps=gb_one))
        # an index group of 4 layers in one launch, 2K rows each
        hosts4 = [host[i * (src_rows // 4):(i + 1) * (src_rows // 4)] for i in range(4)]
        devs4 = [dev[i * 70_000:(i + 1) * 70_000] for i in range(4)]
        gb4, us4 = gather_gbps(hosts4, devs4, 2048, row_bytes, 20 if not quick else 8)
        # torch reference on the GPU (index_select on pinned host + copy), one point
        g = torch.Generator(device=DEV).manual_seed(1)
        s, d, c = plan_for(16384, 2048, src_rows, dev.shape[0], g)
        t0 = time.perf_counter()
        reference.gather_rows([host], [dev], s, d, c)
        torch.cuda.synchronize()
        ref_us = (time.perf_counter() - t0) * 1e6
        ref_gb = 16384 * row_bytes / (ref_us * 1e-6) / 1e9
        spans = {}
        for span_mb in (16, 128, 1024, 4096):
            span_rows = min(src_rows, (span_mb << 20) // row_bytes)
            spans[span_mb] = gather_gbps([host], [dev], 16384, row_bytes, 10,
                                         span_rows=span_rows)[0]
        log(f"{row_bytes} B, 16K random rows within a span of the pinned pool: " + ", ".join(
            f"{k} MiB {v:.1f}" for k, v in spans.items()) + " GB/s")
        out[row_bytes] = dict(zero_copy_ceiling=zc, span_16k=spans, sweep=sweep, best=best, table=table,
                              four_layers_2k=dict(gbps=gb4, us=us4),
                              reference_16k=dict(gbps=ref_gb, us=ref_us))
        log(f"{row_bytes} B: {'rows':>7} {'default':>8} {'best':>8} {'1 row/warp':>10} (GB/s)")
        for r in table:
            log(f"{'':>8} {r['rows']:>7} {r['default_gbps']:8.1f} {r['best_gbps']:8.1f} "
                f"{r['one_row_per_warp_gbps']:10.1f}   ({r['default_us']:.1f} µs)")
        log(f"{row_bytes} B: 4 layers x 2K rows in one launch: {gb4:.1f} GB/s ({us4:.1f} µs); "
            f"torch reference 16K rows: {ref_gb:.2f} GB/s")
        del host, dev, hosts4, devs4
    RESULTS["gather"] = out


def bench_copies(quick: bool):
    log("\n== page copies and mirrors ==")
    bs, row_bytes, L = 64, 656, 4
    dev = [torch.empty((4096 * bs, row_bytes), dtype=torch.uint8, device=DEV) for _ in range(L)]
    host = [torch.empty((4096 * bs, row_bytes), dtype=torch.uint8).pin_memory() for _ in range(L)]
    res = {}
    for n in (16, 256):
        sb = torch.randperm(4096, device=DEV)[:n].to(torch.int32)
        db = torch.randperm(4096, device=DEV)[:n].to(torch.int32)
        nbytes = n * bs * row_bytes * L
        spill = time_events(lambda i: probe.copy_blocks(dev, host, sb, db, bs), 10)
        restore = time_events(lambda i: probe.copy_blocks(host, dev, db, sb, bs), 10)
        sbl, dbl = sb.tolist(), db.tolist()

        def dma(i, src=dev, dst=host, a=sbl, b=dbl):
            for l in range(L):
                for x, y in zip(a, b):
                    dst[l][y * bs:(y + 1) * bs].copy_(src[l][x * bs:(x + 1) * bs],
                                                      non_blocking=True)

        dma_spill = time_events(dma, 3)
        dma_restore = time_events(lambda i: dma(i, host, dev, dbl, sbl), 3)
        res[n] = dict(bytes=nbytes, kernel_spill_gbps=nbytes / spill / 1e3,
                      kernel_restore_gbps=nbytes / restore / 1e3,
                      dma_spill_gbps=nbytes / dma_spill / 1e3,
                      dma_restore_gbps=nbytes / dma_restore / 1e3)
        log(f"{n} pages x {L} layers ({nbytes / 1e6:.1f} MB): kernel spill "
            f"{res[n]['kernel_spill_gbps']:.1f} / restore {res[n]['kernel_restore_gbps']:.1f} "
            f"GB/s; one DMA per page: spill {res[n]['dma_spill_gbps']:.1f} / restore "
            f"{res[n]['dma_restore_gbps']:.1f} GB/s (GPU time only)")
    # mirrors: 256 new rows x 61 layers device -> host
    Lm = 61
    devm = [torch.empty((8192, row_bytes), dtype=torch.uint8, device=DEV) for _ in range(Lm)]
    hostm = [torch.empty((8192, row_bytes), dtype=torch.uint8).pin_memory() for _ in range(Lm)]
    sr = torch.randperm(8192, device=DEV)[:256].to(torch.int32)
    dr = torch.randperm(8192, device=DEV)[:256].to(torch.int32)
    us = time_events(lambda i: probe.mirror_rows(devm, hostm, sr, dr), 10)
    res["mirror_256x61"] = dict(us=us, gbps=256 * Lm * row_bytes / us / 1e3)
    log(f"mirror 256 rows x 61 layers: {us:.1f} µs ({res['mirror_256x61']['gbps']:.1f} GB/s)")
    RESULTS["copies"] = res


# --------------------------------------------------------------------------------------
# huge pages
# --------------------------------------------------------------------------------------


def anon_huge_kib(ptr: int) -> int | None:
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0] if line.strip() else ""
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def bench_huge_pages(quick: bool):
    log("\n== 4 KiB vs 2 MiB host pages: 128K random 656 B rows over a 6 GiB buffer ==")
    import ctypes

    import numpy as np
    nbytes = 6 << 30
    row_bytes = 656
    rows = nbytes // row_bytes
    dev = torch.empty((300_000, row_bytes), dtype=torch.uint8, device=DEV)
    res = {}
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = "unknown"
    try:
        nr = open("/proc/sys/vm/nr_hugepages").read().strip()
    except OSError:
        nr = "unknown"
    res["thp_setting"] = thp
    res["nr_hugepages"] = nr
    log(f"transparent_hugepage: {thp}; nr_hugepages: {nr}")
    for mode in ("4k", "thp", "hugetlb"):
        t0 = time.perf_counter()
        a = probe.host_alloc_registered(nbytes, mode)
        alloc_s = time.perf_counter() - t0
        if not a["ptr"]:
            res[mode] = dict(ok=False, message=a["message"])
            log(f"{mode}: not available ({a['message']})")
            continue
        huge_kib = anon_huge_kib(a["ptr"])
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * a["bytes"]).from_address(a["ptr"]))
        host = torch.from_numpy(arr)[: rows * row_bytes].view(rows, row_bytes)
        gbs = {}
        for n in (16384, 131072):
            gbs[n] = gather_gbps([host], [dev], n, row_bytes, 10 if not quick else 5)[0]
        spans = {}
        for span_mb in (16, 128, 1024):
            spans[span_mb] = gather_gbps([host], [dev], 16384, row_bytes, 8,
                                         span_rows=(span_mb << 20) // row_bytes)[0]
        res[mode] = dict(ok=True, alloc_register_s=alloc_s, anon_huge_kib=huge_kib,
                         huge_requested_ok=a["huge_requested_ok"],
                         gbps_16k=gbs[16384], gbps_128k=gbs[131072], span_16k=spans,
                         message=a["message"])
        log(f"{mode}: AnonHugePages {huge_kib} KiB, alloc+register {alloc_s:.1f} s; "
            f"16K rows {gbs[16384]:.1f} GB/s, 128K rows {gbs[131072]:.1f} GB/s; 16K rows within "
            + ", ".join(f"{k} MiB {v:.1f}" for k, v in spans.items()))
        del host, arr
        probe.host_free_registered(a["ptr"], a["bytes"])
    RESULTS["huge_pages"] = res


# --------------------------------------------------------------------------------------
# host pool layouts at scale
# --------------------------------------------------------------------------------------


def layout_views(buf: torch.Tensor, layout: str, L: int, H: int, row_bytes: int, bs: int):
    """L uint8 layer views of ``buf`` for H host rows per layer, and a function that maps host
    rows (positions) to the row ids the views are indexed with."""
    if layout == "layer":
        views = [buf[l * H * row_bytes:(l + 1) * H * row_bytes].view(H, row_bytes)
                 for l in range(L)]
        return views, lambda p: p
    if layout == "position":
        rows = buf[:H * L * row_bytes].view(H, L, row_bytes)
        return [rows[:, l, :] for l in range(L)], lambda p: p
    # page-major [host_block][layer][offset]: layer l of block b starts at (b * L + l) * bs rows
    # of a dense row view. Expressed with dense views that start l * bs rows in, indexed by
    # (p // bs) * L * bs + p % bs, so the kernel reads exactly the page-major addresses.
    flat = buf[:H * L * row_bytes].view(H * L, row_bytes)
    n = H * L - (L - 1) * bs
    views = [flat[l * bs:l * bs + n] for l in range(L)]
    return views, lambda p: (p // bs) * (L * bs) + p % bs


def bench_layout(quick: bool):
    log("\n== host pool layout: 128K random positions x all layers from one 24 GiB registered "
        "buffer (GB/s of payload) ==")
    bs = 64
    pool_bytes = 24 << 30
    t0 = time.perf_counter()
    a = probe.host_alloc_registered(pool_bytes, "thp")
    if not a["ptr"]:
        a = probe.host_alloc_registered(pool_bytes, "4k")
    if not a["ptr"]:
        raise RuntimeError(f"could not register 24 GiB: {a['message']}")
    import ctypes

    import numpy as np
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * a["bytes"]).from_address(a["ptr"]))
    buf = torch.from_numpy(arr)
    chunk = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device=DEV)
    for off in range(0, pool_bytes, 1 << 30):  # never time on zeros
        n = min(1 << 30, pool_bytes - off)
        buf[off:off + n].copy_(chunk[:n], non_blocking=True)
    torch.cuda.synchronize()
    del chunk
    log(f"24 GiB host buffer ({'thp' if a['huge_requested_ok'] else '4k'}) allocated, "
        f"registered and filled in {time.perf_counter() - t0:.1f} s")
    res = dict(mode=a["mode"], huge_requested_ok=a["huge_requested_ok"], runs=[], sweep=[])
    N = 131072
    K = 2048
    reps = 3 if quick else 5
    try:
        for L in (8, 61):
            for row_bytes in (656, 1152):
                H = pool_bytes // (L * row_bytes)
                H -= H % bs
                dst = [torch.empty((N, row_bytes), dtype=torch.uint8, device=DEV)
                       for _ in range(L)]
                g = torch.Generator(device=DEV).manual_seed(L * 10_000 + row_bytes)
                plans = []
                for _ in range(2):
                    pos = torch.randint(0, H, (N,), device=DEV, generator=g, dtype=torch.int64)
                    d = torch.randperm(N, device=DEV, generator=g).to(torch.int32)
                    plans.append((pos, d.view(N // K, K)))
                count = torch.full((N // K,), K, dtype=torch.int32, device=DEV)
                nbytes = N * L * row_bytes
                variants = [("layer", True), ("layer", False), ("position", True),
                            ("position", False), ("page", True)]
                for layout, pair_major in variants:
                    views, ids = layout_views(buf, layout, L, H, row_bytes, bs)
                    ps = [(ids(p).to(torch.int32).view(N // K, K), d) for p, d in plans]

                    def fn(i, views=views, ps=ps,
                           tuning=KernelTuning(copy_pair_major=pair_major)):
                        s, d = ps[i % len(ps)]
                        probe.gather_rows(views, dst, s, d, count, tuning=tuning)

                    fn(0)
                    us = time_events(fn, reps, flush=False)
                    gb = nbytes / (us * 1e-6) / 1e9
                    row = dict(layers=L, row_bytes=row_bytes, layout=layout,
                               order="pair-major" if pair_major else "layer-major",
                               positions=N, us=us, gbps=gb,
                               mrows_per_s=N * L / us, mpos_per_s=N / us)
                    res["runs"].append(row)
                    log(f"L {L:>2}, {row_bytes:>4} B, {layout:>8}-major, {row['order']:>11} "
                        f"order: {gb:5.1f} GB/s, {row['mrows_per_s']:6.1f} M rows/s, "
                        f"{us / 1000:7.2f} ms")
                    if layout == "position" and row_bytes == 656 and L in (8, 61):
                        for rpw in (2, 4, 8, 16):
                            for cps in (1, 2, 4):
                                us2 = time_events(lambda i: fn(i, rpw=rpw, cps=cps),
                                                  2 if quick else 3, flush=False)
                                res["sweep"].append(dict(layers=L, row_bytes=row_bytes,
                                                         order=row["order"],
                                                         rows_per_warp=rpw, ctas_per_sm=cps,
                                                         gbps=nbytes / (us2 * 1e-6) / 1e9))
                        log(f"  position-major, {row['order']} order, sweep (rows/warp x "
                            f"CTAs/SM): " + ", ".join(
                                f"{r['rows_per_warp']}r/{r['ctas_per_sm']}c {r['gbps']:.1f}"
                                for r in res["sweep"]
                                if r["layers"] == L and r["order"] == row["order"]))
                del dst, plans
                torch.cuda.empty_cache()
    finally:
        RESULTS["layout"] = res
        del buf, arr
        probe.host_free_registered(a["ptr"], a["bytes"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write all results to this path")
    ap.add_argument("--quick", action="store_true", help="fewer points and repetitions")
    ap.add_argument("--only", default="resolve,gather,copies,huge,layout",
                    help="comma-separated subset of resolve,gather,copies,huge,layout")
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
             ("copies", bench_copies), ("huge", bench_huge_pages)]
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
