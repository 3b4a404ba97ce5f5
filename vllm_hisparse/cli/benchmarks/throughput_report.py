"""``bench throughput``'s results read back: tokens/s per GPU of the real model at each
concurrency point (:func:`curve`), the headline ratios at the peak (:func:`headline`), the
all-FULL overhead (:func:`all_full_overhead`), and the printed table and plot of a case.

Each works on a case as :mod:`.throughput` stores it in ``--json`` (so ``bench
throughput-table`` reads saved runs with the same functions).
"""

from __future__ import annotations

from vllm_hisparse.cli.benchmarks.model_layer import GEOMETRIES
from vllm_hisparse.cli.benchmarks.throughput_fit import real_step


def _points(runs: dict) -> tuple[dict, dict]:
    """(full, hybrid) points of one set of runs, int keys (str once read back from --json)."""
    return tuple({int(k): v for k, v in runs.get(kind, {}).get("points", {}).items()}
                 for kind in ("full", "hybrid"))


def _systems(full: dict, hyb: dict, c: int, n_full: int) -> dict[str, dict]:
    """Each system's summary at concurrency ``c`` (full: its own batch past it)."""
    f = full.get(c, {}).get("full") or full.get(n_full, {}).get("full", {})
    at = hyb.get(c, {})
    return dict(full=f, hybrid=at.get("hybrid", {}), oracle=at.get("oracle", {}),
                dbo_ceiling=at.get("dbo_ceiling", {}))


def curve(case: dict) -> list[dict]:
    """Tokens/s per GPU (real layer count) of each system at each concurrency: the real step
    from the simulated one (:func:`.throughput_fit.real_step`: GPU time scaled by
    ``num_layers / sim_layers``, or with a second layer count, ``fit``, the line through both;
    host time scaled by the lanes; the larger of the two)."""
    runs, scale = case.get("runs", {}), case.get("scale", 1.0)
    full, hyb = _points(runs)
    fit = case.get("fit")
    fit_full, fit_hyb = _points(fit["runs"]) if fit else ({}, {})
    n_full = max(full, default=case["full_requests"])  # the batch the full run reached
    rows = []
    for c in sorted(set(full) | set(hyb), reverse=True):
        row = dict(concurrency=c, full_saturated=c > n_full)
        second = _systems(fit_full, fit_hyb, c, n_full)  # full: the same batch, or no fit
        for name, s in _systems(full, hyb, c, n_full).items():
            if not s:
                continue
            batch = n_full if name == "full" and c > n_full else c
            scaled = dict(scale=scale, host_scale=case.get("host_scale", 1.0))
            fitted = (dict(second=second[name], num_layers=case["shape"]["num_layers"],
                           layers=(case["sim_layers"], fit["sim_layers"]))
                      if fit and second.get(name) else {})
            try:
                real, fit_error = real_step(s, batch, **scaled, **fitted), None
            except ValueError as exc:  # noise larger than the layers' time: said, scaled
                real, fit_error = real_step(s, batch, **scaled), str(exc)
            row[name] = dict(tokens_per_s=real["tokens_per_s"], range=real["tokens_per_s_range"],
                             real_step_ms=real["step_ms"], real_gpu_ms=real["gpu_ms"],
                             real_host_ms=real["host_ms"], step_ms=s["step_ms_median"],
                             gpu_ms=s["gpu_ms_median"], host_ms=s["host_ms_median"],
                             miss_rate=s.get("miss_rate"))
            for k in ("per_step_ms", "per_layer_ms", "host_per_layer_ms"):
                if k in real:
                    row[name][k] = real[k]
            if fit_error:
                row[name]["fit_error"] = fit_error
        if "full" in row and "hybrid" in row:
            row["hybrid_over_full"] = row["hybrid"]["tokens_per_s"] / row["full"]["tokens_per_s"]
        if "oracle" in row and "hybrid" in row:
            row["hybrid_over_oracle"] = (row["hybrid"]["tokens_per_s"]
                                         / row["oracle"]["tokens_per_s"])
        if "dbo_ceiling" in row and "hybrid" in row:
            row["dbo_ceiling_over_hybrid"] = (row["dbo_ceiling"]["tokens_per_s"]
                                              / row["hybrid"]["tokens_per_s"])
        rows.append(row)
    return rows


def headline(case: dict) -> dict:
    """Hybrid at its batch against full at its batch, against the oracle, and the
    two-micro-batch ceiling against hybrid (where measured)."""
    rows = curve(case)
    if not rows:
        return {}
    top = rows[0]
    out = dict(concurrency=top["concurrency"])
    for k in ("hybrid_over_full", "hybrid_over_oracle", "dbo_ceiling_over_hybrid"):
        if k in top:
            out[k] = top[k]
    return out


def all_full_overhead(case: dict) -> dict:
    """Where no request was tracked (no hybrid step counted a selection: every request FULL),
    the connector's real step against full residency's at the same batch, the largest that
    both ran (full saturated past its own batch is another batch); ``{}`` otherwise. The
    issue's "zero cost when nothing is under pressure" is this ratio."""
    rows = curve(case)
    hybrid = [r["hybrid"] for r in rows if "hybrid" in r]
    if not hybrid or any(h.get("miss_rate") is not None for h in hybrid):
        return {}
    same = [r for r in rows if "full" in r and "hybrid" in r and not r["full_saturated"]]

    def fitted(r, name):
        return "per_layer_ms" in r[name]

    # both systems fitted through the two layer counts, else both scaled (never one of each)
    both = ([r for r in same if fitted(r, "full") and fitted(r, "hybrid")]
            or [r for r in same if not fitted(r, "full") and not fitted(r, "hybrid")])
    if not both:
        return {}
    top = both[0]
    f, h = top["full"]["real_gpu_ms"], top["hybrid"]["real_gpu_ms"]
    return dict(concurrency=top["concurrency"], full_gpu_ms=f, hybrid_gpu_ms=h,
                overhead=h / f - 1, fitted=fitted(top, "hybrid"))


def print_case(case: dict) -> None:
    nan = float("nan")
    print(f"\n{case['shape']['name']}, context {case['context']}: full {case['full_requests']} "
          f"/ hybrid {case['hybrid_requests']} requests per GPU; tokens/s per GPU of the "
          f"{case['shape']['num_layers']}-layer model (median [range]; a step takes the "
          f"larger of its GPU and host time), ms per step of the {case.get('sim_layers', '')} "
          f"simulated layers")
    rows = curve(case)
    dbo = any("dbo_ceiling" in r for r in rows)  # --dbo-ceiling: its own columns
    names = ("full", "hybrid", "oracle") + (("dbo_ceiling",) if dbo else ())
    systems = " / ".join("dbo ceiling" if n == "dbo_ceiling" else n for n in names)
    print("| concurrency | full tok/s | hybrid tok/s | oracle tok/s "
          + ("| dbo ceiling tok/s " if dbo else "") + "| hybrid / full | hybrid / oracle "
          + ("| dbo ceiling / hybrid " if dbo else "")
          + f"| miss rate | GPU ms {systems} | host ms {systems} |")
    print("|---" * (9 + 2 * dbo) + "|")
    for r in rows:
        def cell(name):
            s = r.get(name)
            if not s:
                return "–"
            star = "*" if name == "full" and r["full_saturated"] else ""
            return f"{s['tokens_per_s']:.0f}{star} [{s['range'][0]:.0f}-{s['range'][1]:.0f}]"

        def ms(name, key):
            s = r.get(name)
            return f"{s[key]:.2f}" if s else "–"

        miss = r.get("hybrid", {}).get("miss_rate")
        print(f"| {r['concurrency']} | {cell('full')} | {cell('hybrid')} | {cell('oracle')} "
              + (f"| {cell('dbo_ceiling')} " if dbo else "")
              + f"| {r.get('hybrid_over_full', nan):.2f} | {r.get('hybrid_over_oracle', nan):.2f} "
              + (f"| {r.get('dbo_ceiling_over_hybrid', nan):.2f} " if dbo else "")
              + f"| {'–' if miss is None else f'{100 * miss:.1f} %'} "
              f"| {' / '.join(ms(n, 'gpu_ms') for n in names)} "
              f"| {' / '.join(ms(n, 'host_ms') for n in names)} |")
    fit = case.get("fit")
    if fit and rows:
        top = rows[0]
        parts = "; ".join(f"{n} {top[n]['per_step_ms']:.3f} + {top[n]['per_layer_ms']:.3f} x L "
                          f"(host {top[n]['host_per_layer_ms']:+.3f} x L)"
                          for n in names if "per_layer_ms" in top.get(n, {}))
        print(f"  fit through {case['sim_layers']} and {fit['sim_layers']} simulated layers at "
              f"{top['concurrency']} requests (GPU ms per step = per step + per layer x L): "
              f"{parts}; the real step at L = {case['shape']['num_layers']} (GPU / host ms): "
              + ", ".join(f"{n} {top[n]['real_gpu_ms']:.2f} / {top[n]['real_host_ms']:.2f}"
                          for n in names if n in top))
        for n in names:
            if "fit_error" in top.get(n, {}):
                print(f"  {n}: no fit ({top[n]['fit_error']}); its step is scaled")
    idle = all_full_overhead(case)
    if idle:
        how = "fitted through both layer counts" if idle["fitted"] else "scaled"
        print(f"  all FULL at {idle['concurrency']} requests (the same batch; {how}): the real "
              f"step's GPU time {idle['full_gpu_ms']:.2f} ms without the connector, "
              f"{idle['hybrid_gpu_ms']:.2f} ms with it ({100 * idle['overhead']:+.2f} %)")
    for kind, run in case.get("runs", {}).items():
        split = run.get("split") or {}
        if split.get("alone_ms"):
            alone = ", ".join(f"{k} {v:.2f}" for k, v in sorted(split["alone_ms"].items()))
            print(f"  {kind} at {run['requests']}: stand-ins alone (ms per simulated step): "
                  f"{alone}")
        if split.get("kernel_ms"):
            ker = ", ".join(f"{k} {v:.2f}" for k, v in sorted(split["kernel_ms"].items(),
                                                             key=lambda kv: -kv[1]))
            print(f"  {kind} at {split['profiled_batch']}: profiled kernel ms: {ker}")
        if split.get("side_ms"):
            side = ", ".join(f"{k} {v:.2f} ({split['side_exposed_ms'][k]:.2f})"
                             for k, v in sorted(split["side_ms"].items(), key=lambda kv: -kv[1]))
            print(f"  {kind} at {split['profiled_batch']}: beside the compute stream, ms (of "
                  f"which the compute stream ran nothing): {side}")
        if split.get("span_ms"):
            gaps = ", ".join(f"{g['name'][:48]} {g['ms']:.2f} ({g['gaps']})"
                             for g in split.get("idle_before", [])[:5])
            print(f"  {kind} at {split['profiled_batch']}: profiled span {split['span_ms']:.2f} "
                  f"ms, GPU idle {split['idle_ms']:.2f} ms; idle before: {gaps}")
    mla = case.get("launches", {}).get("sparse MLA", {})
    if mla:
        print("  sparse MLA launches by batch: " + ", ".join(
            f"{b}: {c['BLOCK_H']}x{c['BLOCK_N']}/{c['num_warps']}w/{c['num_stages']}s"
            f"/{c['splits']} splits" for b, c in sorted(mla.items(), key=lambda kv: -int(kv[0]))))


def plot(path: str, cases: list[dict]) -> None:
    from vllm_hisparse.cli.plots import _pyplot

    plt = _pyplot()
    cases = [c for c in cases if c.get("runs") and not c.get("realism")]
    cols = max(1, len({c["context"] for c in cases}))
    rows = max(1, len({c["geometry"] for c in cases}))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    geos = sorted({c["geometry"] for c in cases}, key=list(GEOMETRIES).index)
    ctxs = sorted({c["context"] for c in cases})
    for c in cases:
        ax = axes[geos.index(c["geometry"])][ctxs.index(c["context"])]
        pts = curve(c)
        for name, style in (("full", dict(color="tab:gray", marker="s")),
                            ("hybrid", dict(color="tab:blue", marker="o")),
                            ("oracle", dict(color="tab:green", marker="^", linestyle=":"))):
            xs = [p["concurrency"] for p in pts if name in p]
            ys = [p[name]["tokens_per_s"] for p in pts if name in p]
            if xs:
                ax.plot(xs, ys, label=name, **style)
        ax.set_title(f"{c['shape']['name']}, {c['context'] // 1024}K", fontsize=9)
        ax.set_xlabel("concurrent requests per GPU", fontsize=8)
        ax.set_ylabel("decode tokens/s per GPU", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
