"""Decode tokens/s against concurrency on one GPU of an 8-GPU expert-parallel deployment:
full residency, hybrid residency and the no-IO oracle, through the real path under full CUDA
graphs (the HiSparse paper's throughput figure).

    vllm-hisparse bench throughput                                  # every geometry, 4K/32K/128K
    vllm-hisparse bench throughput --geometries dsv32 --contexts 32768 --json t.json --plot t.png

Per geometry (:data:`.model_layer.GEOMETRIES`: DeepSeek-V3.2, GLM-5.1, GLM-5.2 IndexShare) and
context, the batch each system holds is planned at the model's real layer count from vLLM's
KV planning for the geometry's KV budget per GPU (``kv_gib``: what fp8 weights leave on an
H200 of an EP-8 node) and ``--host-gib`` of pinned host memory per GPU: **full** as many
requests as the pool holds with every page resident, **hybrid** as many as it holds with a
hot region and the tail per request (the indexer KV stays resident) and the host pool backs.

Each system then runs through vLLM 0.33's ``Scheduler``, KV planning and ``BlockPool`` and the
connector's two roles (the simulator's engine) on ``--sim-layers`` layers of the geometry, its
pool sized to hold exactly that batch: ``N`` requests prefill, then decode while cohorts leave
so that the batch steps down through the concurrency points (``N``, then powers of two down
to 8). At each point the decode step is captured as a CUDA graph and replayed (vLLM's
``FULL_AND_PIECEWISE`` decode); ``--timed-steps`` steps are timed after ``--warmup-steps``,
hybrid and oracle steps alternating (:mod:`.throughput_probe`). Around each layer's top-k
conversion the step runs the layer's model-shaped work (:mod:`.model_layer`, every stand-in
printed with the run). A layer's work does not depend on the number of layers, so the real
model's GPU time is ``num_layers / sim_layers`` times the simulated one; its host time (the
connector's issue around the replayed graph) follows the KV cache groups, not the layers;
its step is the larger of the two (:mod:`.throughput_fit`). Tokens/s are given per GPU for
the real model. The GPU scale multiplies what runs once per step too (page-table writes,
launches of the mirror and the spills): ``--sim-layers N M`` runs every case at both counts
and fits the GPU time as ``per_step + num_layers × per_layer`` instead (printed with both
parts).

``--dbo-ceiling`` adds a third system to the connector run, the **two-micro-batch ceiling**
(issue [16]): the oracle step with each layer's model-shaped work run once per half of the
batch (weights read twice, each half's experts at its own router token count, the EP wait
twice; the conversion once over the batch). No dual-batch overlap of this step can be faster,
so a ceiling below hybrid's tokens/s says two micro-batches cannot win here. It is timed in the
same rotation (hybrid, oracle, ceiling), with ``3 * ceil(--timed-steps / 2)`` timed steps per
point so that hybrid and the oracle keep their count.

Printed per geometry and context: tokens/s per GPU of each system at each concurrency (the
full system saturates at its batch: more concurrent requests queue), the ratios, the miss
rate, host issue time against step time (GPU-bound when well below), each stand-in's time
alone and a profiler split of one hybrid step. Needs vLLM (on the GPU machine: the bundle of
``../shared/tools/gpu-vllm``, through its ``run_sim.py``); without CUDA a smoke run of the
plumbing with tiny shapes, eager.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import torch

from vllm_hisparse.cli.args import (CliParser, nonneg_float, nonneg_int, output_path,
                                    positive_float, positive_int)
from vllm_hisparse.cli.benchmarks import host_link
from vllm_hisparse.cli.benchmarks.connector import plan_requests
from vllm_hisparse.cli.benchmarks.model_layer import (ATTENTION_STAND_INS, GEOMETRIES,
                                                      LayerShape, ModelLayerWork,
                                                      layer_flops_and_bytes, log_points)
from vllm_hisparse.cli.benchmarks.throughput_report import curve, headline, plot, print_case
from vllm_hisparse.cli.benchmarks.throughput_probe import (GraphStepProbe, disagreeing_steps,
                                                           summarize)
from vllm_hisparse.cli.output import write_json
from vllm_hisparse.core.units import cdiv

GPU_DEFAULTS = dict(geometries=["dsv32", "glm51", "glm52"], contexts=[4096, 32768, 131072],
                    sim_layers=[8], host_gib=200.0, top_k=2048, block_size=64, warmup_steps=2,
                    timed_steps=6, max_requests=256, min_point=8)
CPU_DEFAULTS = dict(geometries=["dsv32", "glm52"], contexts=[512], sim_layers=[4],
                    host_gib=200.0, top_k=64, block_size=16, warmup_steps=1, timed_steps=2,
                    max_requests=16, min_point=2)
#: A CPU smoke run's layer dimensions (the real ones would take minutes per step there).
TINY = dict(hidden=256, heads=4, q_lora_rank=64, kv_lora_rank=64, rope_dim=16, qk_nope_dim=16,
            v_head_dim=16, experts=16, moe_intermediate=64, index_heads=4, index_head_dim=16,
            kv_gib=0.15)
#: vLLM's KV-cache admission watermark (``KVCacheManager``'s default, a fraction of the pool).
WATERMARK = 0.01
#: Public full-residency decode figure the realism check compares with.
REALISM = dict(geometry="dsv32", batch=12, context=2048, public_tpot_ms=39.0,
               source="DeepSeek-V3.2 on 8 x H200, DP 8 attention + EP 8, ~12 requests per GPU, "
                      "short context (issue [15]'s public figure)")


def residency_options(a) -> dict:
    """SimulationSpec fields of --host-layout, --gather-ctas-per-sm, --inline-conversion,
    --hot-region-eviction and --adaptive-hot-region: the connector's
    extra-config keys (as ``simulate`` passes them), and with an eviction given the scored
    top-k drift (vLLM's indexer top-k over synthetic scores, which ``score`` needs) for lru
    and score alike, so that the two compare on the same selections."""
    extra = {"host_layout": a.host_layout}
    if a.gather_ctas_per_sm is not None:
        extra["gather_ctas_per_sm"] = a.gather_ctas_per_sm
    if a.inline_conversion:
        extra["overlap_conversion"] = False
    if a.adaptive_hot_region:
        extra["adaptive_hot_region"] = True
    if a.hot_region_eviction is None:
        return {"connector_extra": extra}
    from vllm_hisparse.vllm.simulation.spec import SCORED_DRIFT
    extra["hot_region_eviction"] = a.hot_region_eviction
    return {"connector_extra": extra, "topk_drift": SCORED_DRIFT}


def sim_spec(a, shape: LayerShape, num_layers: int, context: int, requests: int,
             output_len: int, device: str, device_blocks: int = 2):
    from vllm_hisparse.vllm.simulation.engine import SimulationSpec

    per_indexer = min(shape.layers_per_indexer, num_layers)
    return SimulationSpec(
        num_layers=num_layers, layers_per_indexer=per_indexer, mla_row_bytes=shape.mla_row_bytes,
        block_size=a.block_size, top_k=a.top_k, prefill_top_k=min(16, a.top_k),
        device_blocks=device_blocks, host_pool_gib=None, max_num_seqs=max(1, requests),
        max_num_batched_tokens=context + max(1, requests), num_requests=max(1, requests),
        prompt_len=context, output_len=output_len, device=device,
        ops_backend="cuda" if device == "cuda" else "auto", attention="group", check=False,
        count_request_misses=False, **residency_options(a))


def device_plan(spec) -> dict:
    from vllm_hisparse.vllm.simulation.engine import SimulationEngine

    engine = SimulationEngine(spec)
    try:
        return engine.device_plan()
    finally:
        engine.close()


def pool_blocks(needed: int) -> int:
    """A pool that admits ``needed`` blocks of requests: vLLM admits a waiting request only
    above its watermark (1 % of the pool)."""
    return math.ceil(needed / (1 - WATERMARK)) + 1


def plan_batches(a, shape: LayerShape, context: int, output_len: int, device: str,
                 sim_layers: int) -> dict:
    """Requests per GPU of each system at the real layer count, and the pools of
    ``sim_layers`` simulated layers that hold exactly those batches."""
    ns = argparse.Namespace(hbm_gib=shape.kv_gib, host_gib=a.host_gib, block_size=a.block_size,
                            max_requests=a.max_requests)
    real_spec = sim_spec(a, shape, shape.num_layers, context, 1, output_len, device)
    pages = cdiv(real_spec.max_model_len, a.block_size)
    real_device = device_plan(real_spec)
    real = plan_requests(real_device, ns, pages, 2 * a.top_k)
    n_full = real["full_requests"]
    n_hybrid = max(real["hybrid_requests"], n_full)  # no gain: the connector never demotes
    sim = device_plan(sim_spec(a, shape, sim_layers, context, 1, output_len, device))
    full_blocks = sim["num_groups"] * pages
    hybrid_blocks = (sim["num_indexer_groups"] * pages + sim["num_sparse_groups"]
                     * (cdiv(2 * a.top_k, a.block_size) + 3))
    pools = {k: pool_blocks(v) for k, v in dict(
        full=1 + n_full * full_blocks,
        hybrid=max(1 + n_full * full_blocks,
                   1 + full_blocks + (n_hybrid - 1) * hybrid_blocks)).items()}
    return dict(real_plan=real, full_requests=n_full, hybrid_requests=n_hybrid,
                sim_blocks=pools, sim_full_blocks_per_request=full_blocks,
                sim_hybrid_blocks_per_request=hybrid_blocks, pages=pages,
                sim_groups=sim["num_groups"],
                # the host's issue time follows the lanes (sparse groups), not the layers
                host_scale=real_device["num_sparse_groups"] / sim["num_sparse_groups"])


def timed_steps(a, kind: str) -> int:
    """Timed steps per point of one run: ``--timed-steps``, or with ``--dbo-ceiling`` on a
    connector run enough for the three-kind rotation to give hybrid and the oracle as many
    as without it."""
    if kind == "full" or not getattr(a, "dbo_ceiling", False):
        return a.timed_steps
    return 3 * cdiv(a.timed_steps, 2)


def run_system(a, shape, context, kind, n, blocks, work, device, sim_layers,
               groups: int) -> dict:
    from vllm_hisparse.vllm.simulation.engine import SimulationEngine

    timed = timed_steps(a, kind)
    window = a.warmup_steps + timed + 2
    # long enough that no request leaves before the probe sets the departures at the first
    # decode-only step (every request admitted, however long admission took)
    output_len = 4 * n + 64 + window * (2 + len(log_points(n, min(a.min_point, n))))
    # vLLM starts only if one request of the run's longest length fits the pool (the plan
    # counts 64 output tokens: a pool of one or two requests can be a few pages short)
    blocks = max(blocks, pool_blocks(1 + groups * cdiv(context + output_len, a.block_size)))
    spec = sim_spec(a, shape, sim_layers, context, n, output_len, device, blocks)
    layers = "" if sim_layers == a.sim_layers[0] else f"-{sim_layers}layers"
    trace = (None if a.trace_dir is None else os.path.join(
        a.trace_dir, f"{shape.name.replace(' ', '_')}-{context}-{kind}{layers}.json"))
    with_connector = kind != "full"
    probe = GraphStepProbe(work, a.warmup_steps, timed, min_point=a.min_point,
                           trace_path=trace,
                           dbo_ceiling=with_connector and getattr(a, "dbo_ceiling", False))
    engine = SimulationEngine(spec, probe=probe)
    t0 = time.perf_counter()
    try:
        r = engine.run(with_connector)
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    points = probe.points
    by_point = {}
    for p in points:
        kinds = probe.connector_kinds if with_connector else ("full",)
        by_point[p] = {k: summarize(probe.steps, k, p) for k in kinds}
    print(f"    {kind} ({sim_layers} layers): {n} requests, peak running {r.peak_running}, "
          f"{r.preemptions} preemptions, {r.steps} steps, {probe.graphs_captured} graphs, "
          f"{wall:.0f} s", flush=True)
    disagree = disagreeing_steps(probe.steps)
    if disagree:
        first = disagree[0]
        print(f"    WARNING: the index groups counted different misses in {len(disagree)} of "
              f"{len(probe.steps)} timed steps, though each converts the same top-k here "
              f"(first: a {first.kind} step at batch {first.batch}, "
              f"{list(first.misses_per_unit)}); the rows are not what the indexer chose",
              flush=True)
    return dict(kind=kind, requests=n, device_blocks=blocks, peak_running=r.peak_running,
                preemptions=r.preemptions, engine_steps=r.steps, wall_s=wall,
                points=by_point, split=probe.split, index_groups_disagree=len(disagree))


def run_case(a, key: str, context: int, device: str, *, batch: int | None = None,
             systems: tuple[str, ...] = ("full", "hybrid")) -> dict:
    shape = LayerShape.named(key, **(TINY if device == "cpu" else {}),
                             **({} if a.ep_comm_us is None else {"ep_comm_us": a.ep_comm_us}))
    output_len = 64
    plans = [plan_batches(a, shape, context, output_len, device, layers)
             for layers in a.sim_layers]
    if batch is not None:  # the realism check: a fixed full batch
        for plan in plans:
            plan.update(full_requests=batch, hybrid_requests=batch, sim_blocks=dict(
                full=1 + batch * plan["sim_full_blocks_per_request"]))
    plan = plans[0]
    n_full, n_hybrid = plan["full_requests"], plan["hybrid_requests"]
    print(f"  {shape.name} at {context} tokens: full {n_full}, hybrid {n_hybrid} requests per "
          f"GPU ({shape.kv_gib} GiB KV, {a.host_gib} GiB host)", flush=True)
    case = dict(geometry=key, shape=dataclasses.asdict(shape), context=context, **plan)
    if n_full <= 0:
        case["error"] = "the KV budget holds no full request"
        return case
    top = max(n_full, n_hybrid if "hybrid" in systems else 0)
    work = ModelLayerWork(shape, max_batch=top, context=context, top_k=a.top_k, kv_rows=[],
                          attention=a.attention_stand_in,
                          device=torch.device(device))
    case["runs"] = {}
    for i, (layers, p) in enumerate(zip(a.sim_layers, plans)):
        runs = {}
        for kind in systems:
            n = n_full if kind == "full" else n_hybrid
            runs[kind] = run_system(a, shape, context, kind, n, p["sim_blocks"][kind], work,
                                    device, layers, p["sim_groups"])
        if i == 0:
            case["runs"] = runs
        else:  # the second layer count: the real step is fitted through both (curve)
            case["fit"] = dict(sim_layers=layers, sim_blocks=p["sim_blocks"], runs=runs)
    case["scale"] = shape.num_layers / a.sim_layers[0]
    case["sim_layers"] = a.sim_layers[0]
    case["flops_bytes_top"] = layer_flops_and_bytes(shape, top, context, a.top_k)
    case["launches"] = work.launches()  # the fused stand-ins' chosen block sizes and splits
    ceiling = [dict(concurrency=r["concurrency"], **r["dbo_ceiling"],
                    dbo_ceiling_over_hybrid=r.get("dbo_ceiling_over_hybrid"))
               for r in curve(case) if "dbo_ceiling" in r]
    if ceiling:  # the real model's figures per point (the raw steps: runs.hybrid.points)
        case["dbo_ceiling"] = ceiling
    del work
    if device == "cuda":
        torch.cuda.empty_cache()
    return case


def main(argv=None) -> int:
    p = CliParser(prog="vllm-hisparse bench throughput", description=__doc__.splitlines()[0])
    p.add_argument("--geometries", nargs="+", choices=list(GEOMETRIES))
    p.add_argument("--contexts", nargs="+", type=positive_int, help="prompt tokens per request")
    p.add_argument("--sim-layers", type=positive_int, nargs="+", metavar="N",
                   help="layers the engine runs (a whole number of index groups); two counts "
                   "N < M: every case runs at both and the real model's step is the line "
                   "through them (per step + per layer), not N layers scaled")
    p.add_argument("--host-gib", type=positive_float, help="pinned host memory per GPU")
    p.add_argument("--top-k", type=positive_int)
    p.add_argument("--block-size", type=positive_int)
    p.add_argument("--warmup-steps", type=positive_int)
    p.add_argument("--timed-steps", type=positive_int,
                   help="timed steps per concurrency point (hybrid: half of them oracle; "
                   "with --dbo-ceiling 3 x ceil(N / 2), a third each)")
    p.add_argument("--max-requests", type=positive_int)
    p.add_argument("--min-point", type=positive_int, help="smallest concurrency point")
    p.add_argument("--ep-comm-us", type=nonneg_float,
                   help="EP dispatch + combine per layer, µs (0 drops the stand-in)")
    p.add_argument("--no-realism", action="store_true",
                   help="skip the full-residency step at the public figure's batch")
    p.add_argument("--host-layout", choices=("auto", "position", "layer"), default="auto",
                   help="the connector's host_layout (default: %(default)s)")
    p.add_argument("--hot-region-eviction", choices=("lru", "score"), default=None,
                   help="the connector's hot_region_eviction (given: both with the scored "
                   "top-k drift; default: the connector's lru, uniform drift)")
    p.add_argument("--adaptive-hot-region", action="store_true",
                   help="the connector's adaptive_hot_region (default: fixed regions)")
    p.add_argument("--gather-ctas-per-sm", type=nonneg_int, default=None,
                   help="the connector's gather_ctas_per_sm (default: the connector's)")
    p.add_argument("--inline-conversion", action="store_true",
                   help="the connector's overlap_conversion false: each leader converts on "
                   "the compute stream (default: on its index group's side stream, as vLLM)")
    p.add_argument("--attention-stand-in", choices=ATTENTION_STAND_INS, default="matmul",
                   help="sparse MLA as cuBLAS products over the gathered rows (matmul, the "
                   "closer to FlashMLA's time) or one fused Triton kernel reading each row "
                   "once (fused, FlashMLA's bytes); docs/benchmarks.md, \"Throughput\"")
    p.add_argument("--dbo-ceiling", action="store_true",
                   help="also time the two-micro-batch ceiling (issue [16]): the oracle step "
                   "with each layer's stand-ins run once per half of the batch")
    p.add_argument("--trace-dir", metavar="DIR",
                   help="keep each profiled step's chrome trace there "
                   "(MODEL-CONTEXT-SYSTEM.json)")
    p.add_argument("--json", metavar="PATH", type=output_path)
    p.add_argument("--plot", metavar="PNG", type=output_path)
    a = p.parse_args(argv)
    if a.trace_dir is not None:
        os.makedirs(a.trace_dir, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in (GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS).items():
        if getattr(a, name, None) is None:
            setattr(a, name, value)
    if len(a.sim_layers) > 2 or sorted(set(a.sim_layers)) != a.sim_layers:
        p.error(f"--sim-layers takes one count or two increasing ones, got "
                f"{' '.join(map(str, a.sim_layers))}")
    for key in a.geometries:
        per = GEOMETRIES[key]["layers_per_indexer"]
        for layers in a.sim_layers:
            if layers % per:
                p.error(f"--sim-layers={layers} must be a whole number of {key}'s index "
                        f"groups ({per} layers)")
    if device == "cpu":
        print("vllm-hisparse bench throughput: no CUDA device: a CPU smoke run with tiny shapes "
              "and eager steps (the figures mean nothing)", file=sys.stderr)
    print("stand-ins per layer (docs/benchmarks.md, \"Throughput\"):", flush=True)
    for key in a.geometries:
        print("  " + LayerShape.named(key, **({} if a.ep_comm_us is None else
                                              {"ep_comm_us": a.ep_comm_us})).describe())
    # the hybrid figures carry this start's host link with them: measured, printed, kept
    link = host_link.measure([GEOMETRIES[k]["mla_row_bytes"] for k in a.geometries],
                             torch.device(device))
    if link:
        print(host_link.describe(link), flush=True)
    cases = []
    for key in a.geometries:
        for context in a.contexts:
            cases.append(run_case(a, key, context, device))
            if a.json:  # what is done so far survives a time-out
                write_json("--json", a.json, dict(args=vars(a), device=device, host_link=link,
                                                  cases=cases, partial=True),
                           command="bench throughput")
    if not a.no_realism and REALISM["geometry"] in a.geometries and device == "cuda":
        r = run_case(a, REALISM["geometry"], REALISM["context"], device,
                     batch=REALISM["batch"], systems=("full",))
        r["realism"] = REALISM
        cases.append(r)
    for c in cases:
        if c.get("runs") and not c.get("realism"):
            print_case(c)
    dbo = any(c.get("dbo_ceiling") for c in cases)
    print("\n| geometry | context | full / hybrid requests | **hybrid / full** at peak "
          "| **hybrid / oracle** at peak |" + (" dbo ceiling / hybrid at peak |" if dbo else ""))
    print("|---" * (5 + dbo) + "|")
    nan = float("nan")
    for c in cases:
        if c.get("realism") or not c.get("runs"):
            continue
        h = headline(c)
        print(f"| {c['shape']['name']} | {c['context']} | {c['full_requests']} / "
              f"{c['hybrid_requests']} | {h.get('hybrid_over_full', nan):.2f} "
              f"| {h.get('hybrid_over_oracle', nan):.2f} |"
              + (f" {h.get('dbo_ceiling_over_hybrid', nan):.2f} |" if dbo else ""))
    for c in cases:
        if c.get("realism") and c.get("runs"):
            row = next((r for r in curve(c) if r["concurrency"] == REALISM["batch"]), {})
            if "full" in row:
                ms = row["full"]["real_step_ms"]
                print(f"\nrealism: full residency, {REALISM['batch']} requests x "
                      f"{REALISM['context']} tokens: {ms:.1f} ms per step of the "
                      f"{c['shape']['num_layers']}-layer model here, against "
                      f"{REALISM['public_tpot_ms']:.0f} ms TPOT ({REALISM['source']})")
    if a.plot:
        plot(a.plot, cases)
        print(f"plot: {a.plot}")
    if a.json and not write_json("--json", a.json, dict(args=vars(a), device=device,
                                                        host_link=link, cases=cases),
                                 command="bench throughput"):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
