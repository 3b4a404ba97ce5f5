"""``vllm-hisparse replay``: score hot-region replacement policies on a selection trace.

Reads a trace recorded by the connector (``record_trace``) or makes the embedded synthetic one,
replays it for each policy and hot-region size, and prints the miss rates. Bélády's offline
optimum is the floor every online policy is measured against: a second table gives the share of
the LRU (``hisparse``, the kernel's policy) → Bélády gap each online policy closes.

``--adaptive ROWS`` instead compares a fixed hot region of ROWS rows with per-request regions
sized from each request's miss rate (``core.hot_sizing``), on the trace or, by default, on a
synthetic trace of four requests whose selections drift differently: the miss rates, the hot
blocks per request, and what they mean for concurrency.

``--predict ROWS`` instead measures cross-layer prediction (``core.miss_prediction``): with a
hot region of ROWS rows per request in every index group, how many of group L+1's misses a
prefetch named from group L's selections (this step or the last) or from L+1's own last step
would have hidden (recall), how many of the prefetched rows were misses (precision) and the
rows copied for nothing per miss row (extra traffic), overall and per pair of neighbouring
groups. Only a trace recorded with ``record_trace`` on a real model says anything: the
synthetic trace's index groups (``--index-groups``) are independent by construction.

Tables go to stdout; a plot (miss rate against hot-region size) is written only with
``--plot PNG``, the numbers as JSON only with ``--json PATH``.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from vllm_hisparse.cli.args import nonneg_int, output_path, positive_int
from vllm_hisparse.cli.output import write_file, write_json
from vllm_hisparse.cli.plots import replay_plot
from vllm_hisparse.core.capacity import PRESETS, concurrency_report, layout_for_geometry
from vllm_hisparse.core.hot_sizing import compare_sizing
from vllm_hisparse.core.miss_prediction import PREDICTORS, evaluate_prediction
from vllm_hisparse.core.replacement import POLICIES, gap_closed, replay
from vllm_hisparse.core.trace import (PAPER_MISS_RATES, SelectionTrace, mixed_trace,
                                      synthetic_trace)
from vllm_hisparse.core.units import GIB

DEFAULT_CAPACITIES = (2048, 3072, 4096, 6144, 8192)

#: One line per policy of ``core.replacement.POLICIES`` (``--help`` and docs/cli.md).
POLICY_HELP = {
    "hisparse": "this package's kernel: LRU, a step's hits more recent than its misses",
    "lru": "every position used this step becomes most recent",
    "fifo": "the oldest inserted position goes first; hits do not move",
    "random": "a random victim",
    "current": "keep only this step's selections (no reuse across steps: the baseline a "
               "hot region must beat)",
    "belady": "the position used again furthest in the future (offline optimum)",
    "score": "lowest indexer-score class first (needs a trace with score classes)",
    "frequency": "fewest recent selections first, weighed against recency",
}


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="score replacement policies x hot-region sizes on a trace "
                       "(--adaptive: per-request sizes; --predict: cross-layer miss prediction)",
                       description=__doc__, epilog="policies: " + "; ".join(
                           f"{name}: {POLICY_HELP[name]}" for name in POLICIES))
    p.add_argument("--trace", metavar="PATH", help="a .npz selection trace (default: the "
                   "embedded synthetic trace)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                   metavar="POLICY", help=f"from {', '.join(POLICIES)} (default: all; each is "
                   "described below)")
    p.add_argument("--capacities", nargs="+", type=positive_int,
                   default=list(DEFAULT_CAPACITIES), metavar="ROWS",
                   help="hot-region sizes in rows (default: %(default)s)")
    p.add_argument("--requests", type=positive_int, default=2, help="synthetic trace: requests")
    p.add_argument("--steps", type=positive_int, default=300, help="synthetic trace: decode steps")
    p.add_argument("--top-k", type=positive_int, default=2048,
                   help="synthetic trace: selections/step")
    p.add_argument("--context", type=positive_int, default=100_000,
                   help="synthetic trace: context tokens")
    p.add_argument("--seed", type=nonneg_int, default=0)
    p.add_argument("--adaptive", type=positive_int, metavar="ROWS",
                   help="compare a fixed region of ROWS rows with per-request sizing from the "
                        "miss rate (default trace: four requests that drift differently)")
    p.add_argument("--predict", type=positive_int, metavar="ROWS",
                   help="measure how well index group L's selections (this step or the last) "
                        "and L+1's own last step predict L+1's misses with ROWS hot rows per "
                        "request and group: recall, precision, extra link traffic. Needs a "
                        "trace with several index groups; the synthetic one's are independent "
                        "by construction, so only a trace recorded with record_trace on a real "
                        "model gives a figure that means anything")
    p.add_argument("--index-groups", type=positive_int, metavar="N",
                   help="synthetic trace: independent index groups (default: 4 with "
                        "--predict, else 1)")
    p.add_argument("--json", metavar="PATH", type=output_path, help="write the results as JSON")
    p.add_argument("--plot", metavar="PNG", type=output_path,
                   help="plot miss rate vs hot-region size (matplotlib); without it no plot "
                   "is written")


def load_trace(path: str) -> SelectionTrace:
    """``SelectionTrace.load`` with every malformation reported as ``--trace PATH: ...``."""
    try:
        with np.load(path, allow_pickle=False) as data:
            meta_text = str(data["meta"]) if "meta" in data.files else None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--trace {path}: not a vllm-hisparse selection trace ({exc})") from None
    if meta_text is None:
        raise ValueError(f"--trace {path}: not a vllm-hisparse selection trace (no 'meta')")
    try:
        meta = json.loads(meta_text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--trace {path}: malformed 'meta': not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"--trace {path}: malformed 'meta': expected a JSON object, got "
                         f"{type(meta).__name__}")
    for key in ("top_k", "block_size"):
        value = meta.get(key)
        if value is not None and not (isinstance(value, int) and value > 0):
            raise ValueError(f"--trace {path}: malformed 'meta': {key} must be a positive "
                             f"integer, got {value!r}")
    try:
        return SelectionTrace.load(path)
    except (ValueError, IndexError, TypeError) as exc:  # the arrays' shapes and offsets
        text = str(exc)
        raise ValueError(f"--trace {text}" if text.startswith(path)
                         else f"--trace {path}: {text}") from None


#: The deployment the sizing table's concurrency column assumes.
_CONCURRENCY_MODEL, _CONCURRENCY_CONTEXT, _CONCURRENCY_KV_GIB = "deepseek-v3.2", 32768, 60


def run_adaptive(args) -> int:
    if args.trace:
        trace, source = load_trace(args.trace), args.trace
    else:
        trace = mixed_trace(args.steps, args.top_k, args.context, args.seed)
        source = (f"synthetic, 4 requests (very stable, stable, default, drifting) x "
                  f"{args.steps} steps, "
                  f"K = {args.top_k}, {args.context}-token context")
    block_size = int(trace.meta.get("block_size") or 64)
    if args.adaptive % block_size:
        raise ValueError(f"--adaptive {args.adaptive}: not a multiple of the trace's block size "
                         f"{block_size}")
    print(f"trace: {source}, {trace.num_records} records; replaying ...", file=sys.stderr)
    requests = [sets for _, sets in trace.requests()]
    largest = max((s.shape[0] for sets in requests for s in sets), default=0)
    if args.adaptive < largest:
        raise ValueError(f"--adaptive {args.adaptive}: smaller than the largest selection set "
                         f"of the trace ({largest} rows)")
    rows = compare_sizing(requests, args.adaptive, block_size)
    geometry = PRESETS[_CONCURRENCY_MODEL]

    def concurrency(blocks: float) -> int:
        hot_rows = int(round(blocks)) * geometry.block_size
        layout = layout_for_geometry(geometry, device_kv_bytes=_CONCURRENCY_KV_GIB * GIB,
                                     host_pool_bytes=0, device_buffer_size_rows=hot_rows,
                                     admission_window_tokens=_CONCURRENCY_CONTEXT)
        return concurrency_report(layout, _CONCURRENCY_CONTEXT).max_concurrency_steady_device

    print(f"| hot region | target miss rate | miss rate | worst request | hot blocks / request "
          f"| fixed blocks for the same worst request | requests at "
          f"{_CONCURRENCY_CONTEXT // 1024}K ({_CONCURRENCY_MODEL}, {_CONCURRENCY_KV_GIB} GiB KV) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        target = "-" if r.target_miss_rate is None else f"{100 * r.target_miss_rate:.1f} %"
        same = ("-" if r.target_miss_rate is None else "> largest measured"
                if r.fixed_blocks_same_worst is None else
                f"{r.fixed_blocks_same_worst:.1f} (saved "
                f"{100 * (1 - r.mean_blocks / r.fixed_blocks_same_worst):.0f} %)")
        print(f"| {r.label} | {target} | {100 * r.miss_rate:.2f} % | {100 * r.worst_miss_rate:.1f} % "
              f"| {r.mean_blocks:.1f} | {same} | {concurrency(r.mean_blocks)} |")
    if args.json:
        return 0 if write_json("--json", args.json, {"trace": source, "sizing": [
            {"label": r.label, "target_miss_rate": r.target_miss_rate, "miss_rate": r.miss_rate,
             "worst_miss_rate": r.worst_miss_rate, "mean_blocks": r.mean_blocks,
             "fixed_blocks_same_worst": r.fixed_blocks_same_worst,
             "concurrency": concurrency(r.mean_blocks)} for r in rows]},
            command="replay") else 1
    return 0


def _percent(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{digits}f} %"


#: Table labels of the predictors (``core.miss_prediction.PREDICTORS``).
_PREDICTOR_LABELS = {"layer": "previous layer", "step": "previous step (own)",
                     "layer_step": "previous layer, previous step", "union": "union"}
INDEPENDENT_NOTE = ("synthetic index groups are independent by construction: these cross-layer "
                    "figures are chance, not a measurement. The figure that matters comes from "
                    "a trace recorded with record_trace on a real model (docs/core.md, "
                    "\"Cross-layer prediction: how to measure it\").")


def run_predict(args) -> int:
    if args.trace:
        trace, source = load_trace(args.trace), args.trace
    else:
        groups = args.index_groups or 4
        trace = synthetic_trace(args.requests, args.steps, args.top_k, args.context, args.seed,
                                score_class_width=None, index_groups=groups)
        source = (f"synthetic ({args.requests} requests x {args.steps} steps, K = {args.top_k}, "
                  f"{args.context}-token context, {groups} independent index groups)")
    print(f"trace: {source}, {trace.num_records} records; replaying {len(trace.index_groups)} "
          f"index groups ...", file=sys.stderr, flush=True)
    report = evaluate_prediction(trace, args.predict, seed=args.seed)
    independent = bool(trace.meta.get("index_groups_independent"))
    if report.note:
        print(f"{report.note} (the trace holds index group {report.index_groups[0]} only; "
              "record_trace records every index group of the model)")
    else:
        print(f"hot region: {report.capacity_rows} rows per request per index group "
              f"({report.policy}); {len(report.index_groups)} index groups, "
              f"{report.requests} requests")
        print("| predictor | prefetches for group L+1 at step t | miss rows | predicted rows "
              "| covered rows | recall | precision | extra traffic |")
        print("|---|---|---|---|---|---|---|---|")
        for name, c in report.overall.items():
            print(f"| {_PREDICTOR_LABELS[name]} | {PREDICTORS[name]} | {c.miss_rows} "
                  f"| {c.predicted_rows} | {c.covered_rows} | {_percent(c.recall)} "
                  f"| {_percent(c.precision)} | {_percent(c.extra_traffic, 0)} |")
        print("\nper gap (recall / precision / extra traffic):")
        print("| gap | miss rate of L+1 | miss rows | "
              + " | ".join(_PREDICTOR_LABELS[name] for name in PREDICTORS) + " |")
        print("|---" * (3 + len(PREDICTORS)) + "|")
        for gap in report.gaps:
            cells = [f"{_percent(c.recall)} / {_percent(c.precision)} / "
                     f"{_percent(c.extra_traffic, 0)}" for c in gap.counts.values()]
            print(f"| {gap.source_group} -> {gap.target_group} | {_percent(gap.miss_rate, 2)} "
                  f"| {gap.miss_rows} | " + " | ".join(cells) + " |")
        if independent:
            print("\n" + INDEPENDENT_NOTE)
    if args.json:
        return 0 if write_json("--json", args.json, {
            "trace": source, "index_groups_independent": independent, **report.to_dict()},
            command="replay") else 1
    return 0


def run(args) -> int:
    if args.adaptive and args.predict:
        raise ValueError("--adaptive and --predict are separate reports: give one")
    if args.adaptive:
        return run_adaptive(args)
    if args.predict:
        return run_predict(args)
    if args.trace:
        trace = load_trace(args.trace)
        source = args.trace
    else:
        trace = synthetic_trace(args.requests, args.steps, args.top_k, args.context, args.seed,
                                index_groups=args.index_groups or 1)
        source = (f"synthetic ({args.requests} requests x {args.steps} steps, K = {args.top_k}, "
                  f"{args.context}-token context)")
    print(f"trace: {source}, {trace.num_records} records", file=sys.stderr)
    if len(trace.index_groups) > 1:
        print(f"scoring index group {trace.index_groups[0]}, the first of "
              f"{len(trace.index_groups)} (each group has its own hot region); --predict ROWS "
              "measures prediction across them", file=sys.stderr)
    results = []
    for i, capacity in enumerate(sorted(set(args.capacities))):
        print(f"  [{i + 1}/{len(set(args.capacities))}] {capacity} rows ...", file=sys.stderr,
              flush=True)
        results += replay(trace, args.policies, [capacity], seed=args.seed)
    if not results:
        largest = max((s.shape[0] for _, ss in trace.requests() for s in ss), default=0)
        raise ValueError(f"every capacity is smaller than the largest selection set of the "
                         f"trace ({largest} rows): no policy can serve it")
    capacities = sorted({r.capacity for r in results})
    rate = {(r.policy, r.capacity): r.miss_rate for r in results}
    policies = [p for p in args.policies if (p, capacities[0]) in rate]
    skipped = [p for p in args.policies if p not in policies]
    if skipped:
        print(f"skipped {', '.join(skipped)}: the trace has no score classes", file=sys.stderr)
    print("| hot rows | " + " | ".join(policies) + " |")
    print("|---" * (len(policies) + 1) + "|")
    for c in capacities:
        print(f"| {c} | " + " | ".join(f"{100 * rate[(p, c)]:.2f} %" for p in policies) + " |")
    online = [p for p in policies if p not in ("hisparse", "belady")]
    if "hisparse" in policies and "belady" in policies and online:
        print("\nshare of the LRU (hisparse) -> Belady gap closed:")
        print("| hot rows | " + " | ".join(online) + " |")
        print("|---" * (len(online) + 1) + "|")
        for c in capacities:
            print(f"| {c} | " + " | ".join(
                f"{100 * gap_closed(rate[(p, c)], rate[('hisparse', c)], rate[('belady', c)]):.0f} %"
                for p in online) + " |")
    paper = {key: value for key, value in PAPER_MISS_RATES.items() if key in rate}
    if paper and (args.trace or args.top_k == 2048):
        # The synthetic default is calibrated to these; a recorded trace is compared with them.
        print("\nagainst the HiSparse paper's replay (GLM-5.1, LongBenchV2, k = 2048):")
        print("| policy | hot rows | paper | this trace |")
        print("|---|---|---|---|")
        for (policy, rows), value in paper.items():
            print(f"| {policy} | {rows} | {100 * value:.1f} % | {100 * rate[(policy, rows)]:.1f} % |")
    written = True
    if args.json:
        written &= write_json("--json", args.json, {"trace": source, "results": [
            {"policy": r.policy, "capacity_rows": r.capacity, "references": r.references,
             "misses": r.misses, "miss_rate": r.miss_rate} for r in results],
            "paper": [{"policy": p, "capacity_rows": c, "miss_rate": v}
                      for (p, c), v in paper.items()]}, command="replay")
    if args.plot:
        written &= write_file("--plot", args.plot, lambda path: replay_plot(
            path, policies, capacities, rate, source), command="replay")
    return 0 if written else 1
