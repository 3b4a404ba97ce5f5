"""Scheduler cost of HiSparseResidencyConnector on vLLM's real Scheduler (CPU), against the
systems an operator would run instead.

``--requests`` requests of ``--context`` prompt tokens are prefilled, then ``--steps``
decode steps are timed. A step is ``schedule()`` + ``update_from_output()``; the fake
forward (one sampled token per request) and the fake workers' acks are built outside the
timed region. The HBM for KV is sized so that every request stays fully resident in every
system (steady state, no pressure): this measures each system's fixed per-step cost. The
model is DeepSeek-V3.2-shaped (``--layers`` sparse-MLA layers, an indexer each).

Systems (``cli/benchmarks/vllm_baselines.py``): ``stock`` (plain vLLM: one KV cache group, no
connector), ``intree`` (vLLM's in-tree Hybrid HiSparse), ``plan`` (our KV plan with vLLM's
stock managers, no connector), ``noop`` (our plan and a connector that does nothing) and
``hisparse`` (ours). Ratios are reported against ``stock`` (what an operator runs without
us) and against ``plan`` (what our grouping alone costs), side by side.

Measurement hygiene: every run is a fresh process (CPython's specialising interpreter
keeps per-call-site state, so a run must not inherit call sites warmed by another
configuration); the systems are interleaved round by round (A/B/C, then B/C/A, ...);
ratios are taken within a round and reported as median and range over the rounds.

``--evict-mib N`` touches an N MiB buffer between steps (untimed), standing in for the
host-side work a real engine does between two scheduler steps.

``--instructions`` counts instructions instead of timing: each system runs once under
valgrind's callgrind, which counts only the timed region (a tiny C helper issuing
callgrind's client requests is compiled on first use; needs ``cc`` and valgrind's headers).
The counts do not depend on the machine's load; ``hisparse`` is also counted with our
connector's methods left out, which separates vLLM's share from ours. Slow (minutes per
run): use fewer steps.

    vllm-hisparse bench scheduler-overhead --repeats 5
    vllm-hisparse bench scheduler-overhead --instructions --steps 10
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from vllm_hisparse.cli.benchmarks import vllm_baselines as baselines
from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm.plugin import register
from vllm_hisparse.vllm.simulation.model import write_model_dir
from vllm_hisparse.vllm.simulation.scheduler_driver import SchedulerDriver

MODES = baselines.SYSTEMS
#: Our connector's scheduler-side methods, timed to separate them from vLLM's own work.
OWN_METHODS = ("build_connector_meta", "update_connector_output", "get_kv_connector_stats",
               "has_pending_push_work", "has_pending_block_frees", "get_num_new_matched_tokens",
               "update_state_after_alloc", "request_finished_all_groups", "take_events")
#: Device bytes one page of tokens may cost in any system (in-tree: the indexer group and a
#: resident group per hot group), per layer; the pool is sized from it.
_PAGE_BYTES_PER_LAYER = 64 * (656 + 132) * 5 // 4
#: Spare pool on top, in hot regions of 64 pages of every layer: the in-tree coordinator
#: starts handing out hot regions once fewer than a tenth of the blocks are free.
_SPARE_HOT_REGIONS = 16


def build_harness(model_dir: Path, mode: str, *, requests: int, context: int, max_tokens: int,
                  layers: int = 4) -> SchedulerDriver:
    """A scheduler of system ``mode`` holding ``requests`` requests of ``context`` +
    ``max_tokens`` tokens fully resident."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    block_size = 64
    max_model_len = context + max_tokens + block_size
    pages = cdiv(max_model_len, block_size)
    page_bytes = layers * _PAGE_BYTES_PER_LAYER
    setup = baselines.Setup(
        model_dir=model_dir, num_layers=layers,
        kv_bytes=requests * (pages + 2) * page_bytes * 5 // 4 + _SPARE_HOT_REGIONS * 64 * 64 * 656 * layers,
        max_model_len=max_model_len, max_num_seqs=requests,
        max_num_batched_tokens=max(2 * context, 4 * requests),
        # Every request's whole length, with room to spare (bookkeeping only here).
        host_pool_gib=requests * (pages + 2) * page_bytes * 2 / (1 << 30))
    return baselines.build(mode, setup)


def measure(model_dir: Path, mode: str, *, requests: int, context: int, steps: int, warmup: int,
            layers: int = 4, evict_mib: int = 0, callgrind: str | None = None) -> dict[str, Any]:
    """One run: per-step times (ms) of ``steps`` decode steps after ``warmup`` steps.

    ``callgrind`` (the process runs under ``valgrind --tool=callgrind``): ``"all"`` counts
    the instructions of the timed region, ``"vllm"`` the same minus our connector's
    methods (``OWN_METHODS``); the parent reads the counts from callgrind's output.
    """
    # Requests prefilled first decode while the others prefill (two per step).
    max_tokens = warmup + steps + requests + 8
    harness = build_harness(model_dir, mode, requests=requests, context=context,
                            max_tokens=max_tokens, layers=layers)
    harness.add_requests(requests, prompt_len=context, max_tokens=max_tokens)
    scheduler = harness.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in harness.requests.values()):
        harness.step()
    start = toggle = None
    if callgrind is not None:
        start, toggle = baselines.callgrind_controls()
    own = [0.0]
    if mode == "hisparse" and callgrind != "all":
        # Our connector's own scheduler-side methods: timed (or left out of the count),
        # to separate them from what vLLM's scheduler does around them.
        target = harness.connector
        for name in OWN_METHODS:
            real = getattr(target, name)

            def timed(*a, _real=real, **k):
                if toggle is not None:
                    toggle()
                t = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    own[0] += time.perf_counter() - t
                    if toggle is not None:
                        toggle()

            setattr(target, name, timed)
    times, own_times = [], []
    evict = np.zeros(max(1, evict_mib * (1 << 20) // 8), dtype=np.int64)

    def between_steps() -> None:
        evict[...] += 1  # what a real engine does between two scheduler steps

    for i in range(warmup + steps):
        counted = toggle is not None and i >= warmup
        if start is not None and i == warmup:
            start()
        own[0] = 0.0
        output, ms = baselines.measured_step(harness, toggle if counted else None,
                                             between_steps if evict_mib else None)
        if len(output.num_scheduled_tokens) != requests:
            raise RuntimeError(f"{mode}, step {i}: {len(output.num_scheduled_tokens)} of {requests} "
                               f"requests scheduled ({len(scheduler.running)} running, "
                               f"{len(scheduler.waiting)} waiting)")
        if i >= warmup:
            times.append(ms)
            own_times.append(own[0] * 1e3)
    return {"mode": mode, "median_ms": statistics.median(times), "min_ms": min(times),
            "own_ms": statistics.median(own_times),
            "num_groups": len(harness.kv_cache_config.kv_cache_groups)}


def _run_child(args: argparse.Namespace, mode: str, callgrind: str | None = None) -> dict[str, Any]:
    cmd = baselines.python_child(
        "scheduler-overhead", "--child", mode, "--model-dir", str(args.model_dir), "--requests", str(args.requests),
        "--context", str(args.context), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--layers", str(args.layers), "--evict-mib", str(args.evict_mib))
    if callgrind is not None:
        cmd += ["--callgrind", callgrind]
    result, count = baselines.run_child(cmd, mode, callgrind=callgrind is not None)
    if count is not None:
        result["instructions_per_step"] = count / args.steps
    return result


def _ratio_line(label: str, value: float, counts: dict[str, float]) -> str:
    parts = [f"  {label:<24} {value / 1e6:9.3f} M"]
    for base in ("stock", "plan"):
        if base in counts:
            parts.append(f"{value / counts[base]:.3f}x {base}")
    return "   ".join(parts)


def count_instructions(args: argparse.Namespace, modes: list[str]) -> None:
    """Instructions per step of every system, and of vLLM's part of the ``hisparse`` step,
    as ratios to ``stock`` and to ``plan``."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (callgrind) on PATH; not found")
    counts: dict[str, float] = {}
    groups: dict[str, int] = {}
    for mode in modes:
        result = _run_child(args, mode, "all")
        counts[mode] = result["instructions_per_step"]
        groups[mode] = result["num_groups"]
        print(f"  {mode:<9} {counts[mode] / 1e6:.3f} M instructions per step", file=sys.stderr, flush=True)
    if "hisparse" in modes:
        counts["hisparse_vllm_part"] = _run_child(args, "hisparse", "vllm")["instructions_per_step"]
    print(f"{args.requests} running requests x {args.context} tokens, {args.layers} layers, "
          f"{args.steps} decode steps (schedule + update_from_output): instructions per step "
          "(callgrind, one run each)")
    labels = {m: f"{m} ({groups[m]} groups)" for m in modes}
    labels["hisparse_vllm_part"] = "  of which vLLM's calls"
    for key, value in counts.items():
        print(_ratio_line(labels[key], value, counts))
    if "hisparse" in counts:
        own = counts["hisparse"] - counts["hisparse_vllm_part"]
        print(_ratio_line("  of which our methods", own, counts))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "instructions_per_step": counts, "num_groups": groups}, indent=1))


def _spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hisparse bench scheduler-overhead",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=61, help="sparse-MLA layers, an indexer each")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each runs every system once, interleaved")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--evict-mib", type=int, default=0,
                        help="touch this many MiB between steps (untimed)")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions of the timed region under valgrind's callgrind instead "
                             "of timing (deterministic; one run per system; slow: use e.g. --steps 10)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--callgrind", choices=("all", "vllm"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    register()
    if args.child:
        result = measure(args.model_dir, args.child, requests=args.requests, context=args.context,
                         steps=args.steps, warmup=args.warmup, layers=args.layers,
                         evict_mib=args.evict_mib, callgrind=args.callgrind)
        print(json.dumps(result))
        return 0
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or "stock" not in modes:
        parser.error(f"--modes: {bad or 'stock is required'}; accepted: {MODES}")
    args.model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "dsv32", num_hidden_layers=args.layers)
    if args.instructions:
        count_instructions(args, modes)
        return 0
    runs: list[dict[str, Any]] = []
    for round_index in range(args.repeats):
        # Rotate the order every round so no system always runs first.
        k = round_index % len(modes)
        for mode in modes[k:] + modes[:k]:
            result = _run_child(args, mode)
            result["round"] = round_index
            runs.append(result)
            print(f"  round {round_index} {mode:<9} {result['median_ms']:.3f} ms", file=sys.stderr, flush=True)
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
    per_round = {m: {r["round"]: r["median_ms"] for r in by_mode[m]} for m in modes}
    print(f"{args.requests} running requests x {args.context} tokens, {args.layers} layers, {args.steps} "
          "decode steps (schedule + update_from_output); per run the median step, then median "
          f"[min-max] over {args.repeats} interleaved rounds (one process per run)"
          f"{f', {args.evict_mib} MiB touched between steps' if args.evict_mib else ''}:")
    summary: dict[str, Any] = {}
    for mode in modes:
        ms = [r["median_ms"] for r in by_mode[mode]]
        summary[mode] = {"median_ms": ms}
        line = (f"  {mode:<9} ({by_mode[mode][0]['num_groups']} groups) {_spread(ms, '.3f')} ms   "
                f"({statistics.median(ms) * 1e3 / args.requests:.2f} us/request)")
        for base in ("stock", "plan"):
            if base in modes and mode != base:
                ratios = [per_round[mode][i] / per_round[base][i] for i in range(args.repeats)]
                summary[mode][f"ratio_to_{base}"] = ratios
                line += f"   {_spread(ratios, '.3f')}x {base}"
        print(line)
    if "hisparse" in modes:
        own = [r["own_ms"] for r in by_mode["hisparse"]]
        base = [r["median_ms"] for r in by_mode["stock"]]
        summary["own_ms"] = own
        print(f"  our methods           {_spread(own, '.3f')} ms   "
              f"({statistics.median(own) / statistics.median(base) * 100:.1f} % of the stock step)")
        print("  target: hisparse / stock <= 1.3")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": runs, "summary": summary}, indent=1))
    return 0
