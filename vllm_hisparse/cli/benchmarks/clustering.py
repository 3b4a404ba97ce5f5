"""How a hot region's misses cluster in host memory, per host-pool layout (CPU, seconds).

Replays the calibrated selection trace (``core.trace.synthetic_trace``, the default of
``vllm-hisparse replay``) and the simulator's drifting top-k (``worker.synthetic.
TopkGenerator``, what ``simulate`` and ``bench capacity`` / ``bench connector`` use) through a
hot region and counts the distinct 4 KiB host pages a gather of each step's misses touches,
for the position-major pool (the default), a page-major one (the per-layer rows of a page
contiguous) and a layer-major one (``core.miss_clustering``). The gather kernel's rate over a
multi-GiB pool is bounded by host pages touched, so ``rows per host page`` is what a layout
can gain: ~1 means none.

    vllm-hisparse bench clustering
    vllm-hisparse bench clustering --layers 61 --group-layers 1 --hot-rows 4096 8192
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.cli.args import CliParser, output_path, positive_int
from vllm_hisparse.cli.output import write_json
from vllm_hisparse.core import miss_clustering
from vllm_hisparse.core.trace import TraceRecorder, synthetic_trace


def drifting_trace(num_requests: int, num_steps: int, top_k: int, context: int,
                   tail_tokens: int = 128):
    """The simulator's selections as a trace (host-backed part: all but the resident tail)."""
    from vllm_hisparse.worker.synthetic import TopkGenerator

    rec = TraceRecorder(top_k=top_k, block_size=64, source="TopkGenerator")
    for r in range(num_requests):
        gen = TopkGenerator(top_k, seed=r)
        for s in range(num_steps):
            ctx = context + s
            sel = gen.select(ctx).numpy()
            rec.add(r, s, np.sort(sel[(sel >= 0) & (sel < ctx - tail_tokens)]))
    return rec.trace()


def main(argv=None) -> int:
    p = CliParser(prog="vllm-hisparse bench clustering", description=__doc__.splitlines()[0])
    p.add_argument("--hot-rows", type=positive_int, nargs="+", default=[4096])
    p.add_argument("--layers", type=positive_int, default=61,
                   help="sparse layers in the host pool (the position-major row stride)")
    p.add_argument("--group-layers", type=positive_int, nargs="+", default=[1, 4, 8],
                   help="layers one gather reads at the same positions (1 = an indexer per "
                        "layer; 4, 8 = IndexShare groups)")
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--requests", type=positive_int, default=2)
    p.add_argument("--json", metavar="PATH", type=output_path)
    a = p.parse_args(argv)
    traces = {"calibrated (synthetic_trace)": synthetic_trace(num_requests=a.requests,
                                                              num_steps=a.steps),
              "drifting (TopkGenerator, 32K)": drifting_trace(a.requests, a.steps, 2048, 32768)}
    rows = []
    for name, trace in traces.items():
        for hot in a.hot_rows:
            for n in a.group_layers:
                c = miss_clustering.measure(trace, hot, num_layers=a.layers, gather_layers=n)
                rows.append(dict(trace=name, hot_rows=hot, gather_layers=n, **c.as_dict()))
    print(f"{a.layers} layers x 656 B rows in the host pool, 4 KiB host pages; misses of every "
          f"step after the first 20 (the region filling), {a.requests} requests x {a.steps} steps")
    print("| trace | hot rows | layers per gather | misses per step | misses per 64-row page "
          "| rows per host page: position-major | page-major | layer-major |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        per = r["rows_per_host_page"]
        print(f"| {r['trace']} | {r['hot_rows']} | {r['gather_layers']} "
              f"| {r['misses'] / max(1, r['steps']):.0f} | {r['misses_per_page']:.2f} "
              f"| {per['position']:.2f} | {per['page']:.2f} | {per['layer']:.2f} |")
    if a.json and not write_json("--json", a.json, dict(args=vars(a), results=rows),
                                 command="bench clustering"):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
