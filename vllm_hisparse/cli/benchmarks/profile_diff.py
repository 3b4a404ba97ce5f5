"""The profiled kernels of two systems of one ``bench throughput`` case, side by side.

    vllm-hisparse bench profile-diff out/throughput.json --geometry glm51 --context 4096 \
        --systems full hybrid

Reads the ``kernels`` table of each run's profiled step (``cli/benchmarks/step_profile.py``:
GPU ms and launches per event name) and prints, per name, the ms and launches of both systems
and their difference, largest difference first; then the span and idle time of each. What a
residency-managed step adds over the plain step is the top of the list.
"""

from __future__ import annotations

import argparse
import json


def load_split(path: str, geometry: str, context: int, system: str) -> dict:
    with open(path) as f:
        cases = json.load(f)["cases"]
    for case in cases:
        if case["geometry"] == geometry and case["context"] == context:
            return case["runs"][system]["split"]
    raise SystemExit(f"profile_diff: no case {geometry} at {context} tokens in {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hisparse bench profile-diff", description=__doc__.splitlines()[0])
    parser.add_argument("json")
    parser.add_argument("--geometry", required=True)
    parser.add_argument("--context", type=int, required=True)
    parser.add_argument("--systems", nargs=2, default=["full", "hybrid"])
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args(argv)
    a_name, b_name = args.systems
    a, b = (load_split(args.json, args.geometry, args.context, s) for s in args.systems)
    if "kernels" not in a or "kernels" not in b:
        raise SystemExit("profile_diff: the JSON's splits have no per-kernel table "
                         "(written by bench throughput since 2026-12-04)")
    names = {k["name"] for k in a["kernels"]} | {k["name"] for k in b["kernels"]}
    of = lambda split, n: next(((k["ms"], k["launches"]) for k in split["kernels"]
                                if k["name"] == n), (0.0, 0))
    rows = sorted(((of(b, n)[0] - of(a, n)[0], n) for n in names), reverse=True)
    print(f"| kernel | {a_name} ms (launches) | {b_name} ms (launches) | difference ms |")
    print("|---|---|---|---|")
    for diff, n in rows[:args.rows]:
        (ams, al), (bms, bl) = of(a, n), of(b, n)
        print(f"| {n[:70]} | {ams:.3f} ({al}) | {bms:.3f} ({bl}) | {diff:+.3f} |")
    for name, split in ((a_name, a), (b_name, b)):
        print(f"{name}: span {split['span_ms']:.3f} ms, idle {split['idle_ms']:.3f} ms")
    return 0
