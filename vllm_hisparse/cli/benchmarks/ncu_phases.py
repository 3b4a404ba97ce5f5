"""Instructions and stall reasons per barrier-delimited phase of one profiled kernel (no GPU).

Reads the per-instruction source export of an Nsight Compute report and sums, for each stretch
of SASS between two CTA barriers (``BAR.SYNC`` / ``BAR.RED``), the executed warp instructions
(per warp of the launch) and the warp-stall samples by reason. This is how the resolve fast
path was tuned (docs/kernels.md): a phase whose executed count is several times its static
count shows warps split into groups by divergent loops.

    ncu --clock-control none --kernel-name regex:resolve_fast --launch-skip 2 --launch-count 1 \\
        --set full --import-source yes -o r64 vllm-hisparse bench profile-resolve --batch 64
    ncu -i r64.ncu-rep --page source --csv --print-source sass > r64.csv
    vllm-hisparse bench ncu-phases r64.csv --warps 2048      # 64 CTAs x 32 warps
"""

from __future__ import annotations

import argparse
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def phases(path: str) -> list[dict]:
    """One dict per phase: static instructions, executed warp instructions, stall samples
    (total and by reason)."""
    with open(path, errors="replace", newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    header = rows[header_at]
    col = {c: i for i, c in enumerate(header)}
    reasons = [c for c in header if c.startswith("stall_") and "Not Issued" not in c]
    out: list[dict] = []
    cur = None
    for r in rows[header_at + 1:]:
        if len(r) != len(header):
            continue
        if cur is None:
            cur = {"static": 0, "executed": 0.0, "samples": 0.0, "reasons": dict.fromkeys(reasons, 0.0)}
            out.append(cur)
        src = r[col["Source"]]
        cur["static"] += 1
        cur["executed"] += float(r[col[EXECUTED]] or 0)
        cur["samples"] += float(r[col[SAMPLES]] or 0)
        for c in reasons:
            cur["reasons"][c] += float(r[col[c]] or 0)
        if "BAR.SYNC" in src or "BAR.RED" in src:
            cur = None  # the barrier closes its phase
    return [p for p in out if p["executed"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-hisparse bench ncu-phases", description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu --page source --csv --print-source sass export")
    ap.add_argument("--warps", type=float, default=2048.0,
                    help="warps in the profiled launch (CTAs x warps per CTA)")
    a = ap.parse_args(argv)
    ps = phases(a.csv)
    total = sum(p["executed"] for p in ps)
    print(f"executed warp instructions per warp: {total / a.warps:.0f}")
    for i, p in enumerate(ps):
        top = sorted(((v, k[6:]) for k, v in p["reasons"].items() if v), reverse=True)[:4]
        print(f"phase {i}: static {p['static']:5d}  executed/warp {p['executed'] / a.warps:6.0f}  "
              f"samples {p['samples']:5.0f}  " + ", ".join(f"{k} {v:.0f}" for v, k in top))
    return 0

