"""The headline table of docs/benchmarks.md from one or more ``bench throughput`` JSONs.

    vllm-hisparse bench throughput-table A.json B.json

One row per (geometry, context) case of the first JSON, each cell ``start A / start B /
...`` in the order given (``–`` where a start did not run the case): requests per GPU,
tokens/s per GPU of the real model at each system's largest batch (median [range over the
timed steps]), hybrid / full and hybrid / oracle, the miss rate and the hybrid step's GPU /
host ms (first JSON). Then the largest relative gap between the starts' headline ratios,
which the docs quote, and each start's host link where its JSON recorded one
(:mod:`.host_link`).
"""

from __future__ import annotations

import argparse
import json

from vllm_hisparse.cli.benchmarks import host_link
from vllm_hisparse.cli.benchmarks.throughput_report import curve


def _load(path: str) -> tuple[dict[tuple[str, int], dict], dict]:
    """A JSON's cases by (geometry, context), and its start's host link (``{}`` before the
    link was recorded)."""
    with open(path) as f:
        doc = json.load(f)
    cases = {(c["geometry"], c["context"]): c for c in doc["cases"]
             if c.get("runs") and not c.get("realism")}
    return cases, doc.get("host_link") or {}


def _k(context: int) -> str:
    return f"{context // 1024}K"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hisparse bench throughput-table", description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="bench throughput --json outputs, one per start")
    args = parser.parse_args(argv)
    loaded = [_load(p) for p in args.json]
    starts = [cases for cases, _ in loaded]
    print("| model | context | requests full / hybrid | full tok/s | hybrid tok/s | oracle tok/s "
          "| **hybrid / full** | **hybrid / oracle** | miss rate | hybrid GPU / host ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    worst = (0.0, "")
    for key, first in starts[0].items():
        # one entry per start, in order; "–" where a start did not run the case
        tops = [curve(s[key])[0] if key in s else {} for s in starts]
        def cells(name):
            return " / ".join(f"{t[name]['tokens_per_s']:.0f} [{t[name]['range'][0]:.0f}-"
                              f"{t[name]['range'][1]:.0f}]" if name in t else "–" for t in tops)
        def ratios(name):
            return [t[name] for t in tops if name in t]
        for name in ("hybrid_over_full", "hybrid_over_oracle"):
            r = ratios(name)
            if len(r) > 1 and (max(r) - min(r)) / min(r) > worst[0]:
                worst = ((max(r) - min(r)) / min(r), f"{first['shape']['name']} {_k(key[1])} {name}")
        hyb = tops[0].get("hybrid", {})
        miss = hyb.get("miss_rate")
        def ratio_cells(name):
            return " / ".join(f"{t[name]:.2f}" if name in t else "–" for t in tops)
        over_full, over_oracle = ratio_cells("hybrid_over_full"), ratio_cells("hybrid_over_oracle")
        print(f"| {first['shape']['name']} | {_k(key[1])} | {first['full_requests']} / "
              f"{first['hybrid_requests']} | {cells('full')} | {cells('hybrid')} "
              f"| {cells('oracle')} | **{over_full}** | {over_oracle} "
              f"| {'–' if miss is None else f'{100 * miss:.1f} %'} "
              f"| {hyb.get('gpu_ms', float('nan')):.2f} / {hyb.get('host_ms', float('nan')):.2f} |")
    if len(starts) > 1:
        print(f"\nlargest gap between the starts' ratios: {100 * worst[0]:.1f} % ({worst[1]})")
    for path, (_, link) in zip(args.json, loaded):
        if link:
            print(f"{path}: {host_link.describe(link)}")
    return 0
