"""Timing of the score ops (``bench kernels --only score``): the slot classes of one index
group and step, as the connector computes them with ``hot_region_eviction: score``
(``ops.score_threshold`` at the indexer + ``ops.slot_classes`` before resolve), the CUDA
kernels (2 launches) against the torch twin (the ~30 small torch kernels that computed them
before the fusion, in their current, exact-order form).

Shape: batch 64 decode requests (next_n 1), W = 32768 logits columns (32K contexts), K 2048,
D 4096 hot slots, every request tracked. Per-step µs from CUDA-graph replays: a graph of
``iters`` steps (optionally each after an L2 flush) minus the same graph without the ops,
median of 7 replays; plus the eager per-call time (CUDA events, median), which for the torch
twin includes its Python dispatch."""

from __future__ import annotations

import statistics

import torch

from vllm_hisparse import ops
from vllm_hisparse.cli.benchmarks.gpu_timing import DEV, RESULTS, flush_l2, log, spin_clocks
from vllm_hisparse.ops import reference_scores

#: The acceptance bound of the fused computation per index group and step (issue 16).
TARGET_US = 20.0


def _inputs(batch: int, cols: int, k: int, slots: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    logits = torch.randn((batch, cols), generator=g, device=DEV).to(dtype)
    topk = logits.float().topk(k, dim=1).indices.to(torch.int32)
    num_rows = batch + 8
    slot_pos = torch.randint(0, cols, (num_rows, slots), generator=g, device=DEV,
                             dtype=torch.int32)
    state_rows = torch.randperm(num_rows, generator=g, device=DEV)[:batch].to(torch.int32)
    return dict(logits=logits, topk=topk, slot_pos=slot_pos, state_rows=state_rows,
                threshold=torch.empty(batch, device=DEV), width=torch.empty(batch, device=DEV),
                slot_class=torch.zeros((num_rows, slots), dtype=torch.uint8, device=DEV))


#: The kernels (a clear error at the first call where they are missing).
_CUDA = ops.select("cuda")


def _cuda_step(x) -> None:
    backend = _CUDA
    backend.score_threshold(x["logits"], x["topk"], x["threshold"], x["width"])
    backend.slot_classes(x["logits"], x["threshold"], x["width"], 1, x["state_rows"],
                         x["slot_pos"], x["slot_class"])


def _torch_step(x) -> None:
    """The torch twin without its value checks (those read back to the host): capturable."""
    reference_scores._score_threshold_unchecked(x["logits"], x["topk"], x["threshold"],
                                                x["width"])
    reference_scores._slot_classes_unchecked(x["logits"], x["threshold"], x["width"], 1,
                                             x["state_rows"], x["slot_pos"], x["slot_class"])


def _graph_us(step, x, iters: int, flush: bool) -> float:
    def build(with_step: bool) -> torch.cuda.CUDAGraph:
        if with_step:
            step(x)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                if flush:
                    flush_l2()
                if with_step:
                    step(x)
        return graph

    def replay_us(graph) -> float:
        graph.replay()
        spin_clocks()
        times = []
        for _ in range(7):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0)
        return statistics.median(times)

    with_ops, without = build(True), build(False)
    return max(0.0, (replay_us(with_ops) - replay_us(without)) / iters)


def _eager_us(step, x, reps: int) -> float:
    step(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        step(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def bench_score(quick: bool) -> None:
    iters, reps = (10, 11) if quick else (40, 41)
    shapes = [(64, 32768, 2048, 4096)] if quick else \
        [(1, 32768, 2048, 4096), (64, 32768, 2048, 4096), (256, 32768, 2048, 4096),
         (64, 163840, 2048, 4096)]
    dtypes = [torch.float32] if quick else [torch.float32, torch.bfloat16]
    rows = []
    log(f"score classes per index group and step (2 CUDA launches vs the torch twin), "
        f"µs, graph replays (median of 7, {iters} steps per graph) and eager calls:")
    log(f"{'batch':>5} {'W':>7} {'K':>5} {'D':>5} {'dtype':>8} | {'cuda warm':>9} "
        f"{'cuda cold':>9} {'cuda eager':>10} | {'torch warm':>10} {'torch eager':>11} | "
        f"{'speed-up':>8}")
    for batch, cols, k, slots in shapes:
        for dtype in dtypes:
            x = _inputs(batch, cols, k, slots, dtype)
            _torch_step(x)
            want = (x["threshold"].clone(), x["width"].clone(), x["slot_class"].clone())
            x["slot_class"].zero_()
            _cuda_step(x)
            torch.cuda.synchronize()
            exact = all(torch.equal(a, b) for a, b in
                        zip(want, (x["threshold"], x["width"], x["slot_class"])))
            r = dict(batch=batch, cols=cols, k=k, slots=slots, dtype=str(dtype),
                     cuda_warm_us=_graph_us(_cuda_step, x, iters, flush=False),
                     cuda_cold_us=_graph_us(_cuda_step, x, iters, flush=True),
                     cuda_eager_us=_eager_us(_cuda_step, x, reps),
                     torch_warm_us=_graph_us(_torch_step, x, iters, flush=False),
                     torch_eager_us=_eager_us(_torch_step, x, reps), exact=exact)
            r["speedup"] = r["torch_warm_us"] / max(r["cuda_warm_us"], 1e-3)
            r["within_target"] = max(r["cuda_warm_us"], r["cuda_cold_us"]) <= TARGET_US
            rows.append(r)
            log(f"{batch:>5} {cols:>7} {k:>5} {slots:>5} {str(dtype)[6:]:>8} | "
                f"{r['cuda_warm_us']:>9.1f} {r['cuda_cold_us']:>9.1f} "
                f"{r['cuda_eager_us']:>10.1f} | {r['torch_warm_us']:>10.1f} "
                f"{r['torch_eager_us']:>11.1f} | {r['speedup']:>7.1f}x"
                f"{'' if exact else '  MISMATCH vs the twin'}")
            del x
    RESULTS["score"] = dict(target_us=TARGET_US, rows=rows)
