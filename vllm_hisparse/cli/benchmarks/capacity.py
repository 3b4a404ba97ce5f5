"""Decode capacity with a fixed HBM budget for KV: full residency vs hybrid residency (GPU).

For each context length the benchmark sizes two decode batches for the same HBM given to
the sparse-MLA KV:

* **full**: every request keeps its whole KV on the GPU (what vLLM does);
* **hybrid**: a request keeps a hot region of ``--hot-rows`` rows plus its 2-page tail on the
  GPU and its whole KV in the pinned host pool (which then bounds the batch too).

It then times a decode step of each batch on the GPU: top-k → device rows (vLLM's block-table
arithmetic for full; ``resolve`` + ``gather_rows`` for hybrid) and a stand-in sparse attention
read of K rows per request per layer (an index_select of the rows, which is what a sparse MLA
kernel reads). Selections come from :class:`TopkGenerator` (drifting locality), precomputed.
There is no model here, so the KV-dependent step time is reported twice: alone ("KV only"),
and plus a stand-in for the model's weight pass, a read of ``--weights-gib-per-layer`` x layers
from HBM timed in the same run (DeepSeek-V3.2 on 8 GPUs reads roughly 1.3 GiB of weights per layer
per GPU per decode step; this term does not grow with the batch, which is why a larger batch pays).

    vllm-hisparse bench capacity                # defaults: 8 layers, 656 B rows
    vllm-hisparse bench capacity --json out.json
    vllm-hisparse bench capacity --layout layer      # the layer-major host pool

``--layout`` picks the host pool layout (position-major by default: the rows of all layers of a
position are adjacent, docs/kernels.md); ``--rows-per-warp`` / ``--ctas-per-sm`` set the gather
kernel's tuning (0 = its defaults).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch

from vllm_hisparse.worker.host_pool import HostPool
from vllm_hisparse.worker.hot_state import HotState
from vllm_hisparse.worker.synthetic import TopkGenerator

TAIL_PAGES = 2


def plan_batches(context: int, a) -> dict:
    bs = a.block_size
    pages = math.ceil(context / bs)
    row_layer_bytes = a.layers * a.row_bytes
    full_request_bytes = pages * bs * row_layer_bytes
    hbm = int(a.hbm_gib * 2**30)
    host = int(a.host_gib * 2**30)
    full = min(a.max_batch, hbm // full_request_bytes)
    if pages * bs <= a.hot_rows + TAIL_PAGES * bs:
        hybrid, hybrid_device_rows = full, pages * bs  # short requests stay fully resident
    else:
        hybrid_device_rows = a.hot_rows + TAIL_PAGES * bs
        hybrid = min(a.max_batch, hbm // (hybrid_device_rows * row_layer_bytes),
                     host // full_request_bytes)
    return dict(context=context, pages=pages, full_batch=int(full), hybrid_batch=int(hybrid),
                hybrid_device_rows=hybrid_device_rows)


def time_steps(fn, steps: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``steps`` calls after ``warmup`` calls (CUDA events on a GPU)."""
    cuda = torch.cuda.is_available()
    for i in range(warmup):
        fn(i)
    if cuda:
        torch.cuda.synchronize()
    times = []
    for i in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(warmup + i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(warmup + i)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_context(plan: dict, device_kv, host_pool: HostPool, a) -> dict:
    bs, k, ctx = a.block_size, a.topk, plan["context"]
    pages = plan["pages"]
    total_steps = a.steps + a.warmup
    dev = device_kv[0].device
    result = dict(plan)

    def topk_for(batch: int) -> torch.Tensor:
        gens = [TopkGenerator(k, seed=r) for r in range(batch)]
        sel = torch.stack([torch.stack([g.select(ctx) for g in gens]) for _ in range(total_steps)])
        return sel.to(dev)  # [steps, batch, K]

    read_buf = torch.empty((max(plan["full_batch"], plan["hybrid_batch"]) * k, a.row_bytes),
                           dtype=torch.uint8, device=dev)

    def attention_read(rows: torch.Tensor) -> None:
        flat = rows.reshape(-1).clamp_min(0).to(torch.int64)
        for layer in device_kv:
            torch.index_select(layer, 0, flat, out=read_buf[:flat.numel()])

    # -- full residency: request r owns pages [r * pages, (r + 1) * pages) of the device pool
    b = plan["full_batch"]
    if b > 0:
        sel = topk_for(b)
        block_table = torch.arange(b * pages, dtype=torch.int64, device=dev).view(b, pages)

        def full_step(i):
            s = sel[i].to(torch.int64)
            rows = torch.where(s >= 0, block_table.gather(1, (s.clamp_min(0) // bs)) * bs + s % bs,
                               torch.full_like(s, -1))
            attention_read(rows)

        t = time_steps(full_step, a.steps, a.warmup)
        result["full_step_ms"] = statistics.median(t)
        result["full_tokens_per_s"] = b / (result["full_step_ms"] / 1e3)
        del sel

    # -- hybrid: tail pages resident, the rest host-backed, hot region leased per request
    b = plan["hybrid_batch"]
    if b > 0:
        sel = topk_for(b)
        tokens_all_resident = plan["hybrid_device_rows"] >= pages * bs
        hot_rows = a.hot_rows
        state = HotState(b, pages, hot_rows, bs, dev, ops_backend=a.ops_backend)
        hot_blocks_per_req = hot_rows // bs
        next_block = 0
        rows_idx, pages_idx, blocks, hosts = [], [], [], []
        for r in range(b):
            if tokens_all_resident:
                resident = range(pages)
            else:
                resident = range(pages - TAIL_PAGES, pages)
                state.lease_hot_region(r, list(range(next_block, next_block + hot_blocks_per_req)))
                next_block += hot_blocks_per_req
            for p in resident:
                rows_idx.append(r)
                pages_idx.append(p)
                blocks.append(next_block)
                next_block += 1
        state.set_pages(rows_idx, pages_idx, blocks)
        all_rows = [r for r in range(b) for _ in range(pages)]
        all_pages = [p for _ in range(b) for p in range(pages)]
        state.set_host_blocks(all_rows, all_pages, [r * pages + p for r, p in zip(all_rows, all_pages)])
        token_rows = torch.arange(b, dtype=torch.int32, device=dev)
        host_layers = [l[:b * pages * bs] for l in host_pool.layers]

        def hybrid_step(i):
            res = state.resolve(sel[i], token_rows)
            state.gather(res, host_layers, device_kv)
            attention_read(res.out_rows)

        stats_before = None

        def measured(i):
            nonlocal stats_before
            if i == a.warmup and stats_before is None:
                stats_before = state.stats.clone()
            hybrid_step(i)

        t = time_steps(measured, a.steps, a.warmup)
        resident, hits, misses = (state.stats - stats_before).tolist()
        result["hybrid_step_ms"] = statistics.median(t)
        result["hybrid_tokens_per_s"] = b / (result["hybrid_step_ms"] / 1e3)
        result["miss_rate"] = misses / max(1, resident + hits + misses)
        result["hot_hit_rate"] = hits / max(1, hits + misses)
        # The resolve + gather part alone, to see what the hybrid path adds.
        t2 = time_steps(lambda i: state.gather(state.resolve(sel[i % total_steps], token_rows),
                                               host_layers, device_kv), a.steps, 0)
        result["hybrid_resolve_gather_ms"] = statistics.median(t2)
        del sel, state
    if result.get("full_tokens_per_s") and result.get("hybrid_tokens_per_s"):
        result["tokens_per_s_ratio"] = result["hybrid_tokens_per_s"] / result["full_tokens_per_s"]
        result["batch_ratio"] = result["hybrid_batch"] / result["full_batch"]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    p.add_argument("--hbm-gib", type=float, default=4.0, help="HBM given to the MLA KV")
    p.add_argument("--host-gib", type=float, default=24.0, help="pinned host pool")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--row-bytes", type=int, default=656)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--hot-rows", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--weights-gib-per-layer", type=float, default=1.3,
                   help="HBM read per layer standing in for the weight pass (0 = none)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ops-backend", default="auto")
    p.add_argument("--layout", choices=["position", "layer"], default=None,
                   help="host pool layout (default: HostPool's default, position-major)")
    p.add_argument("--rows-per-warp", type=int, default=0, help="gather tuning (0 = default)")
    p.add_argument("--ctas-per-sm", type=int, default=0, help="gather tuning (0 = default)")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("bench_decode_capacity: no CUDA device, running on the CPU with the reference ops "
              "(a smoke run: the figures mean nothing)", file=sys.stderr)

    rows_per_layer = int(a.hbm_gib * 2**30) // (a.layers * a.row_bytes)
    rows_per_layer -= rows_per_layer % a.block_size
    device_kv = [torch.randint(0, 256, (rows_per_layer, a.row_bytes), dtype=torch.uint8,
                               device=device) for _ in range(a.layers)]
    host_blocks = int(a.host_gib * 2**30) // (a.layers * a.block_size * a.row_bytes)
    if device == "cuda" and (a.rows_per_warp or a.ctas_per_sm):
        from vllm_hisparse.ops import cuda as cuda_ops
        cuda_ops.set_copy_tuning(a.rows_per_warp, a.ctas_per_sm)
    t0 = time.perf_counter()
    pool_kwargs = {} if a.layout is None else dict(layout=a.layout)
    host_pool = HostPool(a.layers, host_blocks, a.block_size, a.row_bytes, **pool_kwargs)
    flat = host_pool.buffer  # never time on zeros: fill in large contiguous copies
    chunk = device_kv[0].view(-1)
    for start in range(0, flat.numel(), chunk.numel()):
        n = min(chunk.numel(), flat.numel() - start)
        flat[start:start + n].copy_(chunk[:n], non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"host pool {host_pool.logical_gib:.1f} GiB ({host_pool.page_mode}, "
          f"{host_pool.layout}-major) ready in {time.perf_counter() - t0:.1f} s", flush=True)

    weights = torch.empty(int(a.weights_gib_per_layer * a.layers * 2**30) // 4,
                          dtype=torch.float32, device=device).uniform_()
    weight_ms = statistics.median(time_steps(lambda i: weights.sum(), 10, 3)) if weights.numel() else 0.0
    del weights

    results = []
    for context in a.contexts:
        plan = plan_batches(context, a)
        print(f"context {context}: full batch {plan['full_batch']}, hybrid batch "
              f"{plan['hybrid_batch']} ...", flush=True)
        r = run_context(plan, device_kv, host_pool, a)
        r["weight_pass_ms"] = weight_ms
        if r.get("full_step_ms") and r.get("hybrid_step_ms"):
            full = r["full_batch"] / (r["full_step_ms"] + weight_ms)
            hybrid = r["hybrid_batch"] / (r["hybrid_step_ms"] + weight_ms)
            r["tokens_per_s_ratio_with_weights"] = hybrid / full
        results.append(r)
    host_layout = host_pool.layout
    host_pool.close()

    print()
    print(f"{a.layers} layers x {a.row_bytes} B rows, K = {a.topk}, hot rows {a.hot_rows}, "
          f"HBM for KV {a.hbm_gib} GiB, host pool {a.host_gib} GiB ({host_layout}-major), "
          f"gather tuning {a.rows_per_warp or 'default'} rows/warp, "
          f"{a.ctas_per_sm or 'default'} CTAs/SM, weight pass {weight_ms:.2f} ms, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    nan = float("nan")
    print("| context | full batch | hybrid batch | full KV ms | hybrid KV ms | of which resolve+gather "
          "ms | miss rate | tok/s ratio, KV only | tok/s ratio, with weight pass |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['context']} | {r['full_batch']} | {r['hybrid_batch']} "
              f"| {r.get('full_step_ms', nan):.3f} | {r.get('hybrid_step_ms', nan):.3f} "
              f"| {r.get('hybrid_resolve_gather_ms', nan):.3f} | {100 * r.get('miss_rate', 0):.1f} % "
              f"| {r.get('tokens_per_s_ratio', nan):.2f} "
              f"| {r.get('tokens_per_s_ratio_with_weights', nan):.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), device=device, host_layout=host_layout,
                           results=results), f,
                      indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
