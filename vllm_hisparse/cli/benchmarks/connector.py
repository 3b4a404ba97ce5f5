"""Decode tokens/s through the connector: vLLM's scheduler, both connector roles and the
attention hook, with and without the connector at one HBM budget, next to the no-IO oracle.

Where ``bench capacity`` times the data-plane ops alone, this benchmark drives the simulator
(``vllm-hisparse simulate``'s engine: vLLM 0.33's real ``Scheduler``, KV planning and
``BlockPool``, ``HiSparseResidencyConnector`` in both roles, the worker role bound to the KV
tensors vLLM allocates, every sparse layer converting its top-k through vLLM's index group and
our hook) and times its decode steps on the GPU. Per geometry (``--geometries``: layers per
indexer; 1 = an indexer in every layer as DeepSeek-V3.2, 4 = GLM-5.2-like IndexShare groups of
4, 0 = one group of every layer) and one HBM budget for the KV pool (``--hbm-gib``, all KV
cache groups of the plan, indexer KV included), two runs:

* **full**: without the connector, as many ``--context``-token requests as the pool holds;
* **hybrid**: with the connector, as many requests as the pool holds at steady state (indexer
  KV of every page, a hot region and the tail pages of MLA rows; planned from the KV plan and
  the connector's hot-region size) and the host pool (``--host-gib``) allows.

Each decode step runs, per sparse layer, the top-k conversion (through the hook with the
connector: ``resolve`` + the miss gathers), a stand-in attention read of the K rows each
token's conversion returned, and a stand-in weight pass (``--weights-gib-per-layer`` read from
HBM, as ``bench capacity``'s default). A step is timed between CUDA events around the
forward: the worker role's ``start_load_kv`` (the residency command, restores) to its
``wait_for_save`` (spills and mirrors launched), synchronised at the end as vLLM's sampler is.
In the hybrid run, every other timed step runs with the miss copies turned off
(``GroupGather`` replaced by a no-op for that step): the **oracle**, the same decode of the
same batch with the transfers free (rows read are then stale: nothing is checked in this
benchmark; ``simulate`` is the exactness check of the same path). Steps with prefill tokens
are not timed and skip attention (the residency state sees no selection from them); each
request's output length is staggered so that all of them finish in the same step, and
``--warmup-steps`` decode-only steps warm the hot regions before ``--timed-steps`` are timed.
The indexers' top-k and the slot mapping are prepared before the timed region, as vLLM's
model runner prepares its inputs.

``host issue ms`` is the host's time from the start event to the end event's record. Close to
the step time, the step is bound by the host (eager Python launches, as vLLM's attention runs
under ``PIECEWISE`` graphs) and transfers can hide behind it; the GPU-bound regime (a step
replayed from a CUDA graph) is what ``bench capacity`` times.

    vllm-hisparse bench connector                       # the GPU defaults (below)
    vllm-hisparse bench connector --geometries 1 --timed-steps 32

Needs vLLM (on the GPU machine: the bundle of ``../shared/tools/gpu-vllm``, run through its
``run_sim.py``); without a CUDA device a CPU smoke run with the reference ops and tiny sizes.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from vllm_hisparse.cli.args import (CliParser, nonneg_float, nonneg_int, output_path,
                                    positive_float, positive_int)
from vllm_hisparse.cli.benchmarks.capacity import WeightPass
from vllm_hisparse.cli.output import write_json
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, GIB, cdiv
from vllm_hisparse.vllm.simulation.probe import StepProbe  # torch only: vLLM is not imported

GPU_DEFAULTS = dict(layers=8, context=32768, hbm_gib=40.0, host_gib=48.0, top_k=2048,
                    block_size=64, weights_gib_per_layer=1.3, timed_steps=16, warmup_steps=6,
                    max_requests=160)
CPU_DEFAULTS = dict(layers=4, context=512, hbm_gib=0.03, host_gib=0.1, top_k=64,
                    block_size=16, weights_gib_per_layer=0.001, timed_steps=4, warmup_steps=2,
                    max_requests=16)
#: Real layer counts of the geometries, for the planned capacity table.
PLANNED_MODELS = ((61, 1, "DeepSeek-V3.2"), (78, 4, "GLM-5.2-like"), (64, 8, "IndexShare 8"))


class NoCopyGather:
    """Stands in for a binding's ``GroupGather`` on an oracle step: no copy, no wait."""

    def launch(self, result) -> None:
        pass

    def wait(self, layer_index: int) -> None:
        pass

    def join(self) -> None:
        pass


@dataclass
class TimedStep:
    kind: str  # "full", "hybrid" or "oracle"
    ms: float
    tokens: int
    host_ms: float = 0.0  # host time to issue the step's work (start event to end event)
    misses: int = 0
    selections: int = 0
    miss_bytes: int = 0


@dataclass
class StepTimer(StepProbe):
    """Times decode steps and adds the stand-in compute (see the module docstring)."""

    weights: WeightPass | None
    warmup_steps: int
    timed_steps: int
    steps: list[TimedStep] = field(default_factory=list)
    _decode_steps: int = 0
    _kind: str | None = None
    _start: object = None
    _host_start: float = 0.0
    _stats_before: list[int] | None = None
    _read_buf: torch.Tensor | None = None
    _run: object = None
    _gathers: list = field(default_factory=list)
    row_bytes: int = 0
    host_pool: dict | None = None

    # -- StepProbe
    def start_run(self, run) -> None:
        self._run = run
        self.row_bytes = run.model.row_bytes
        pool = run.worker_role.host_pool if run.worker_role is not None else None
        self.host_pool = None if pool is None else dict(
            page_mode=pool.page_mode, huge_page_fraction=pool.huge_page_fraction,
            layout=pool.layout, logical_gib=pool.logical_gib)
        self._decode_steps = 0
        self.steps = []
        model = run.model
        max_rows = model.spec.max_num_seqs * model.spec.top_k
        self._read_buf = torch.empty((max_rows, model.row_bytes), dtype=torch.uint8,
                                     device=model.device)

    def wants_attention(self, step) -> bool:
        return step.decode_only

    def _units(self):
        return [(b, b.num_layers) for b in self._run.bindings]

    def _counters(self) -> list[int]:
        units = self._units()
        if not units:
            return [0, 0, 0, 0]
        stats = torch.stack([b.hot_state.stats for b, _ in units]).cpu()
        misses_by_layers = int(sum(int(stats[i, 2]) * n for i, (_, n) in enumerate(units)))
        return [*map(int, stats.sum(0).tolist()), misses_by_layers]

    def before_forward(self, step) -> None:
        self._kind = None
        if not step.decode_only:
            return
        self._decode_steps += 1
        index = self._decode_steps - 1 - self.warmup_steps
        if index < 0 or index >= self.timed_steps:
            return
        if not self._run.with_connector:
            self._kind = "full"
        else:
            self._kind = "hybrid" if index % 2 == 0 else "oracle"
            self._stats_before = self._counters()
            if self._kind == "oracle":
                self._gathers = [b.swap_gather(NoCopyGather()) for b in self._run.bindings]
        if torch.cuda.is_available() and self._run.model.device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()
        self._host_start = time.perf_counter()

    def after_layer(self, step, layer_name, rows, counts) -> None:
        if not step.decode_only:
            return
        _, layer, view, _ = self._run.model.layers[layer_name]
        flat = rows[:step.num_tokens].reshape(-1).clamp_min(0).to(torch.int64)
        torch.index_select(view, 0, flat, out=self._read_buf[:flat.numel()])
        if self.weights is not None:
            self.weights(layer, step.num_tokens)

    def after_forward(self, step) -> None:
        if self._kind is None:
            return
        host_ms = (time.perf_counter() - self._host_start) * 1e3
        if isinstance(self._start, float):
            ms = (time.perf_counter() - self._start) * 1e3
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            ms = self._start.elapsed_time(end)
        timed = TimedStep(self._kind, ms, step.num_tokens, host_ms)
        if self._run.with_connector:
            after = self._counters()
            d = [a - b for a, b in zip(after, self._stats_before)]
            timed.selections, timed.misses = d[0] + d[1] + d[2], d[2]
            timed.miss_bytes = d[3] * self.row_bytes
        if self._kind == "oracle":
            for b, g in zip(self._run.bindings, self._gathers):
                b.swap_gather(g)
            self._gathers = []
        self.steps.append(timed)

    def end_run(self) -> None:
        if self._gathers:  # a failed oracle step: give the bindings their gathers back
            for b, g in zip(self._run.bindings, self._gathers):
                b.swap_gather(g)
            self._gathers = []


def summarize(steps: list[TimedStep], kind: str) -> dict:
    chosen = [s for s in steps if s.kind == kind]
    if not chosen:
        return {}
    ms = sum(s.ms for s in chosen)
    tokens = sum(s.tokens for s in chosen)
    out = dict(timed_steps=len(chosen), mean_batch=tokens / len(chosen),
               step_ms_median=statistics.median(s.ms for s in chosen),
               step_ms_mean=ms / len(chosen), tokens_per_s=tokens / (ms / 1e3),
               host_ms_median=statistics.median(s.host_ms for s in chosen))
    if any(s.selections for s in chosen):
        out.update(miss_rate=sum(s.misses for s in chosen) / max(1, sum(s.selections
                                                                           for s in chosen)),
                   miss_bytes_per_step=sum(s.miss_bytes for s in chosen) / len(chosen))
    return out


def plan_requests(plan: dict, a, pages: int, hot_rows: int) -> dict:
    """Request counts for one geometry: blocks per request with full residency and at
    steady hybrid state, and how many of each the pool (and the host pool) holds."""
    device_blocks = int(a.hbm_gib * GIB) // plan["bytes_per_block"]
    full_blocks = plan["num_groups"] * pages
    hybrid_blocks = (plan["num_indexer_groups"] * pages + plan["num_sparse_groups"]
                     * (cdiv(hot_rows, a.block_size) + ACTIVE_TAIL_PAGES + 1))
    host_requests = int(a.host_gib * GIB) // (plan["host_block_bytes"] * pages) - 1
    usable = device_blocks - 1  # vLLM keeps its null block
    # the last request in is FULL while it prefills (never demoted before its first decode)
    hybrid = 1 + max(0, usable - full_blocks) // hybrid_blocks
    return dict(device_blocks=device_blocks, full_blocks_per_request=full_blocks,
                hybrid_blocks_per_request=hybrid_blocks,
                full_requests=min(a.max_requests, usable // full_blocks),
                hybrid_requests=min(a.max_requests, hybrid, host_requests),
                host_requests=host_requests, planned_capacity_ratio=full_blocks / hybrid_blocks)


def make_spec(a, layers_per_indexer: int, requests: int, decode_steps: int, device: str):
    from vllm_hisparse.vllm.simulation.engine import SimulationSpec

    return SimulationSpec(
        num_layers=a.layers, layers_per_indexer=layers_per_indexer or a.layers,
        block_size=a.block_size, top_k=a.top_k, prefill_top_k=min(16, a.top_k),
        device_blocks=2, host_pool_gib=None, max_num_seqs=max(1, requests),
        max_num_batched_tokens=a.context + max(1, requests), num_requests=max(1, requests),
        prompt_len=a.context, output_len=decode_steps + max(1, requests), device=device,
        ops_backend="cuda" if device == "cuda" else "auto", attention="group", check=False)


def run_geometry(a, layers_per_indexer: int, weights, device: str) -> dict:
    import dataclasses

    from vllm_hisparse.vllm.simulation.engine import SimulationEngine

    decode_steps = a.warmup_steps + a.timed_steps + 2
    probe_spec = make_spec(a, layers_per_indexer, 1, decode_steps, device)
    engine = SimulationEngine(probe_spec)
    plan = engine.device_plan()
    engine.close()
    pages = cdiv(probe_spec.max_model_len, a.block_size)
    hot_rows = 2 * a.top_k  # the connector's default device_buffer_size (one decode token)
    counts = plan_requests(plan, a, pages, hot_rows)
    result = dict(layers_per_indexer=layers_per_indexer or a.layers, plan=plan, **counts)
    for kind, with_connector, n in (("full", False, counts["full_requests"]),
                                    ("hybrid", True, counts["hybrid_requests"])):
        if n <= 0:
            result[kind] = dict(error="the pool holds no request")
            continue
        spec = dataclasses.replace(make_spec(a, layers_per_indexer, n, decode_steps, device),
                                   device_blocks=counts["device_blocks"])
        timer = StepTimer(weights, a.warmup_steps, a.timed_steps)
        engine = SimulationEngine(spec, probe=timer)
        # Request i prefills in about step i + 1: staggered output lengths make every
        # request finish in the same step, so the decode-only steps hold all of them.
        for i, p in enumerate(engine.workload):
            p.output_len = decode_steps + (n - 1 - i)
        t0 = time.perf_counter()
        try:
            r = engine.run(with_connector)
        finally:
            engine.close()
        pool = timer.host_pool
        print(f"  {kind}: {n} requests, {r.steps} steps, peak running {r.peak_running}, "
              f"{r.preemptions} preemptions, {time.perf_counter() - t0:.1f} s"
              + ("" if pool is None else f"; host pool {pool['logical_gib']:.1f} GiB, pages "
                 f"{pool['page_mode']} (2 MiB share {pool['huge_page_fraction']}), "
                 f"{pool['layout']}-major"), flush=True)
        result[kind] = dict(requests=n, peak_running=r.peak_running, preemptions=r.preemptions,
                            host_pool=pool,
                            engine_steps=r.steps, wall_s=r.wall_s, **summarize(timer.steps, kind))
        if with_connector:
            result["oracle"] = summarize(timer.steps, "oracle")
            result["steps"] = [dataclasses.asdict(s) for s in timer.steps]
    full, hyb, ora = (result.get(k, {}).get("tokens_per_s") for k in ("full", "hybrid",
                                                                       "oracle"))
    if hyb and ora:
        result["hybrid_over_oracle"] = hyb / ora
    if hyb and full:
        result["hybrid_over_full"] = hyb / full
    if ora and full:
        result["oracle_over_full"] = ora / full
    return result


def planned_capacity(a) -> list[dict]:
    """Full vs steady hybrid blocks per request at the real layer counts (planning only)."""
    import argparse

    from vllm_hisparse.vllm.simulation.engine import SimulationEngine

    out = []
    for layers, per_indexer, name in PLANNED_MODELS:
        b = argparse.Namespace(**{**vars(a), "layers": layers})
        spec = make_spec(b, per_indexer, 1, 1, "cpu")
        engine = SimulationEngine(spec)
        plan = engine.device_plan()
        engine.close()
        pages = cdiv(spec.max_model_len, a.block_size)
        c = plan_requests(plan, b, pages, 2 * a.top_k)
        out.append(dict(model=name, layers=layers, layers_per_indexer=per_indexer, **plan,
                        full_blocks_per_request=c["full_blocks_per_request"],
                        hybrid_blocks_per_request=c["hybrid_blocks_per_request"],
                        planned_capacity_ratio=c["planned_capacity_ratio"]))
    return out


def main(argv=None) -> int:
    p = CliParser(prog="vllm-hisparse bench connector", description=__doc__.splitlines()[0])
    p.add_argument("--geometries", type=nonneg_int, nargs="+", default=[1, 4, 0],
                   help="layers per indexer, one pair of runs each (1 = an indexer per layer, "
                        "4 = GLM-5.2-like groups of 4, 0 = one group of every layer)")
    p.add_argument("--layers", type=positive_int, help="sparse-MLA layers of the model")
    p.add_argument("--context", type=positive_int, help="prompt tokens per request")
    p.add_argument("--hbm-gib", type=positive_float, help="HBM of the KV pool (all groups)")
    p.add_argument("--host-gib", type=positive_float, help="most host pool to use")
    p.add_argument("--top-k", type=positive_int)
    p.add_argument("--block-size", type=positive_int)
    p.add_argument("--weights-gib-per-layer", type=nonneg_float,
                   help="HBM read per layer standing in for the weight pass (0 = none)")
    p.add_argument("--timed-steps", type=positive_int,
                   help="decode-only steps timed (hybrid: half of them oracle steps)")
    p.add_argument("--warmup-steps", type=nonneg_int, help="decode-only steps before timing")
    p.add_argument("--max-requests", type=positive_int)
    p.add_argument("--json", metavar="PATH", type=output_path)
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name, value in (GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if any(g > a.layers for g in a.geometries):
        p.error(f"--geometries {' '.join(map(str, a.geometries))}: layers per indexer must be "
                f"at most --layers={a.layers} (0 = all of them)")
    if a.top_k % a.block_size and a.top_k > a.block_size:
        p.error(f"--top-k={a.top_k} must be a multiple of --block-size={a.block_size}")
    if device == "cpu":
        print("vllm-hisparse bench connector: no CUDA device: a CPU smoke run with the "
              "reference ops and tiny sizes (the figures mean nothing)", file=sys.stderr)
    per_layer_bytes = int(a.weights_gib_per_layer * GIB)
    weights = WeightPass("sum", a.layers, per_layer_bytes, device) if per_layer_bytes else None
    results = []
    for geometry in a.geometries:
        print(f"geometry: {a.layers} layers, {geometry or a.layers} per indexer, context "
              f"{a.context}, HBM {a.hbm_gib} GiB ...", flush=True)
        r = run_geometry(a, geometry, weights, device)
        results.append(r)
        print(f"  tok/s hybrid / full {r.get('hybrid_over_full', float('nan')):.2f}, "
              f"hybrid / oracle {r.get('hybrid_over_oracle', float('nan')):.2f}", flush=True)
    planned = planned_capacity(a)

    nan = float("nan")
    print(f"\n{a.layers} sparse layers x 656 B rows, K = {a.top_k}, context {a.context}, KV pool "
          f"{a.hbm_gib} GiB of HBM, weight pass {a.weights_gib_per_layer} GiB/layer, "
          f"{a.timed_steps} timed decode steps after {a.warmup_steps}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    print("| layers per indexer | requests full / hybrid | mean batch full / hybrid "
          "| miss rate | miss MB/step | host issue ms full / oracle / hybrid "
          "| step ms full / oracle / hybrid "
          "| tok/s full / oracle / hybrid | hybrid / full | oracle / full | hybrid / oracle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        f, o, h = (r.get(k, {}) for k in ("full", "oracle", "hybrid"))
        print(f"| {r['layers_per_indexer']} | {r['full_requests']} / {r['hybrid_requests']} "
              f"| {f.get('mean_batch', nan):.0f} / {h.get('mean_batch', nan):.0f} "
              f"| {100 * h.get('miss_rate', nan):.1f} % "
              f"| {h.get('miss_bytes_per_step', nan) / 1e6:.1f} "
              f"| {f.get('host_ms_median', nan):.2f} / {o.get('host_ms_median', nan):.2f} / "
              f"{h.get('host_ms_median', nan):.2f} "
              f"| {f.get('step_ms_median', nan):.2f} / {o.get('step_ms_median', nan):.2f} / "
              f"{h.get('step_ms_median', nan):.2f} "
              f"| {f.get('tokens_per_s', nan):.0f} / {o.get('tokens_per_s', nan):.0f} / "
              f"{h.get('tokens_per_s', nan):.0f} "
              f"| {r.get('hybrid_over_full', nan):.2f} | {r.get('oracle_over_full', nan):.2f} "
              f"| **{r.get('hybrid_over_oracle', nan):.2f}** |")
    print(f"\nPlanned capacity at the real layer counts (context {a.context}, KV pool blocks per "
          "request, full / steady hybrid; the indexer KV stays resident):")
    print("| model | layers | per indexer | KV cache groups (sparse + indexer) | full | hybrid "
          "| ratio |")
    print("|---|---|---|---|---|---|---|")
    for c in planned:
        print(f"| {c['model']} | {c['layers']} | {c['layers_per_indexer']} "
              f"| {c['num_sparse_groups']} + {c['num_indexer_groups']} "
              f"| {c['full_blocks_per_request']} | {c['hybrid_blocks_per_request']} "
              f"| {c['planned_capacity_ratio']:.2f} |")
    if a.json and not write_json("--json", a.json, dict(
            args=vars(a), device=device, results=results, planned=planned),
            command="bench connector"):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
