"""``vllm-hisparse replay``: score hot-region replacement policies on a selection trace.

Reads a trace recorded by the connector (``record_trace``) or makes the embedded synthetic one,
replays it for each policy and hot-region size, and prints the miss rates. Bélády's offline
optimum is the floor every online policy is measured against.
"""

from __future__ import annotations

import json
import sys

from vllm_hisparse.core.replacement import POLICIES, replay
from vllm_hisparse.core.trace import SelectionTrace, synthetic_trace

DEFAULT_CAPACITIES = (2048, 3072, 4096, 6144, 8192)


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="score replacement policies x hot-region sizes on a trace",
                       description=__doc__)
    p.add_argument("--trace", metavar="PATH", help="a .npz selection trace (default: the "
                   "embedded synthetic trace)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES,
                   metavar="POLICY", help=f"from {', '.join(POLICIES)} (default: all)")
    p.add_argument("--capacities", nargs="+", type=int, default=list(DEFAULT_CAPACITIES),
                   metavar="ROWS", help="hot-region sizes in rows (default: %(default)s)")
    p.add_argument("--requests", type=int, default=4, help="synthetic trace: requests")
    p.add_argument("--steps", type=int, default=100, help="synthetic trace: decode steps")
    p.add_argument("--top-k", type=int, default=2048, help="synthetic trace: selections/step")
    p.add_argument("--context", type=int, default=32768, help="synthetic trace: context tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PNG", help="plot miss rate vs hot-region size (matplotlib)")


def run(args) -> int:
    for name in ("capacities",):
        bad = [c for c in getattr(args, name) if c <= 0]
        if bad:
            raise ValueError(f"--{name} must be positive, got {bad}")
    if args.trace:
        trace = SelectionTrace.load(args.trace)
        source = args.trace
    else:
        for name in ("requests", "steps", "top_k", "context"):
            if getattr(args, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        trace = synthetic_trace(args.requests, args.steps, args.top_k, args.context, args.seed)
        source = (f"synthetic ({args.requests} requests x {args.steps} steps, K = {args.top_k}, "
                  f"{args.context}-token context)")
    print(f"trace: {source}, {trace.num_records} records", file=sys.stderr)
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
    print("| hot rows | " + " | ".join(args.policies) + " |")
    print("|---" * (len(args.policies) + 1) + "|")
    for c in capacities:
        print(f"| {c} | " + " | ".join(f"{100 * rate[(p, c)]:.2f} %" for p in args.policies) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": source, "results": [
                {"policy": r.policy, "capacity_rows": r.capacity, "references": r.references,
                 "misses": r.misses, "miss_rate": r.miss_rate} for r in results]}, f, indent=2)
    if args.plot:
        _plot(args.plot, args.policies, capacities, rate, source)
    return 0


def _plot(path, policies, capacities, rate, source) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from exc
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in policies:
        ax.plot(capacities, [100 * rate[(p, c)] for c in capacities], marker="o", label=p)
    ax.set_xlabel("hot region (rows per request)")
    ax.set_ylabel("miss rate (%)")
    ax.set_title(source if len(source) < 60 else source[:57] + "...", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
