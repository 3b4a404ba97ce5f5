"""Requests that share a long prompt prefix, on vLLM's real Scheduler (CPU): plain vLLM,
vLLM's in-tree Hybrid HiSparse and our connector side by side.

``--requests`` requests arrive at once; each prompt is one ``--prefix``-token prefix that
every request shares (vLLM's prefix cache holds it once) followed by a suffix of its own,
``--suffix-min`` to ``--suffix-max`` tokens (seeded), and each generates ``--output``
tokens. Every system gets the same HBM for KV (``--kv-gib``; each plan packs its own block
size) on a DeepSeek-V3.2-shaped model (``--layers`` layers, an indexer each, top-k 2048).
The fake forward samples one token per request; the in-tree connector's and ours' fake
workers acknowledge transfers in the step that issued them.

Per system: steps to finish, peak running requests, preemptions, the mean step
(``schedule()`` + ``update_from_output()``, the fake forward left out) and the prefix-cache
lookups vLLM makes per step (every waiting request it looks at is one; vLLM skips a request
whose connector answers ``None`` and looks at the next one). With ``--instructions`` each
system runs once more under callgrind, which counts the instructions of the same region
(deterministic, where times on a shared machine are not).

    vllm-hisparse bench shared-prefix
    vllm-hisparse bench shared-prefix --instructions --json shared_prefix.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_hisparse.cli.benchmarks import vllm_baselines as baselines
from vllm_hisparse.core.units import GIB, cdiv
from vllm_hisparse.vllm.simulation.model import write_model_dir

SYSTEMS = ("stock", "intree", "plan", "hisparse")


def _setup(args: argparse.Namespace) -> baselines.Setup:
    max_len = args.prefix + args.suffix_max + args.output
    return baselines.Setup(
        model_dir=args.model_dir, num_layers=args.layers, kv_bytes=int(args.kv_gib * GIB),
        max_model_len=cdiv(max_len, 64) * 64, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, host_pool_gib=args.host_gib)


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(10, 1000) for _ in range(args.prefix)]
    return [prefix + [rng.randrange(10, 1000) for _ in range(rng.randint(args.suffix_min, args.suffix_max))]
            for _ in range(args.requests)]


def measure(args: argparse.Namespace, system: str, callgrind: bool = False) -> dict[str, Any]:
    """One system's run of the workload (the child process's work)."""
    harness = baselines.build(system, _setup(args))
    scheduler = harness.scheduler
    lookups = [0]
    real_lookup = scheduler._get_local_prefix_cache_hit

    def counted_lookup(*a, **k):
        lookups[0] += 1
        return real_lookup(*a, **k)

    scheduler._get_local_prefix_cache_hit = counted_lookup
    for prompt in _prompts(args):
        harness.add_request(len(prompt), args.output, prompt_token_ids=prompt)
    start = toggle = None
    if callgrind:
        start, toggle = baselines.callgrind_controls()
        start()
    times, lookups_per_step, running = [], [], []
    preemptions = 0
    while scheduler.has_requests():
        if len(times) >= args.max_steps:
            raise RuntimeError(f"{system}: not finished after {args.max_steps} steps")
        lookups[0] = 0
        output, ms = baselines.measured_step(harness, toggle)
        times.append(ms)
        lookups_per_step.append(lookups[0])
        running.append(len(scheduler.running))
        preemptions += len(output.preempted_req_ids or ())
    groups = harness.kv_cache_config.kv_cache_groups
    return {"system": system, "steps": len(times), "peak_running": max(running),
            "mean_running": statistics.fmean(running), "preemptions": preemptions,
            "mean_step_ms": statistics.fmean(times), "median_step_ms": statistics.median(times),
            "lookups_per_step": statistics.fmean(lookups_per_step),
            "num_groups": len(groups), "num_blocks": harness.kv_cache_config.num_blocks}


def _child_args(args: argparse.Namespace, system: str) -> list[str]:
    return baselines.python_child(
        "shared-prefix", "--child", system, "--model-dir", str(args.model_dir),
        *(f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
            "requests", "prefix", "suffix_min", "suffix_max", "output", "kv_gib", "host_gib",
            "layers", "max_num_seqs", "max_num_batched_tokens", "seed", "max_steps")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hisparse bench shared-prefix",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--prefix", type=int, default=16384, help="shared prompt tokens")
    parser.add_argument("--suffix-min", type=int, default=1024)
    parser.add_argument("--suffix-max", type=int, default=4096)
    parser.add_argument("--output", type=int, default=512, help="generated tokens per request")
    parser.add_argument("--kv-gib", type=float, default=5.0, help="HBM for KV, every system")
    parser.add_argument("--host-gib", type=float, default=256.0,
                        help="host pool of the hierarchical systems (bookkeeping only here)")
    parser.add_argument("--layers", type=int, default=61, help="sparse-MLA layers, an indexer each")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=20_000)
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {baselines.SYSTEMS}")
    parser.add_argument("--instructions", action="store_true",
                        help="also count each system's instructions under callgrind (slow)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--child", choices=baselines.SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--callgrind", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.suffix_min <= args.suffix_max:
        parser.error("--suffix-min and --suffix-max: 0 < min <= max")
    if args.child:
        from vllm_hisparse.vllm.plugin import register

        register()
        print(json.dumps(measure(args, args.child, callgrind=args.callgrind)))
        return 0
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in baselines.SYSTEMS]
    if bad:
        parser.error(f"--systems: {bad}; accepted: {baselines.SYSTEMS}")
    args.model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "dsv32", num_hidden_layers=args.layers)
    results: dict[str, dict[str, Any]] = {}
    for system in systems:
        result, _ = baselines.run_child(_child_args(args, system), system)
        if args.instructions:
            _, count = baselines.run_child([*_child_args(args, system), "--callgrind"], system,
                                           callgrind=True)
            result["instructions_per_step"] = count / result["steps"]
        results[system] = result
        print(f"  {system:<9} done", file=sys.stderr, flush=True)
    print(f"{args.requests} requests: {args.prefix}-token shared prefix + {args.suffix_min}-"
          f"{args.suffix_max}-token suffix, {args.output} output tokens; {args.kv_gib:g} GiB of KV, "
          f"{args.layers} layers; schedule() + update_from_output() per step")
    header = ("| system | KV cache groups | blocks | steps | peak running | preemptions | mean step ms "
              "| median step ms | lookups per step |")
    if args.instructions:
        header += " instructions per step |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for system, r in results.items():
        line = (f"| {system} | {r['num_groups']} | {r['num_blocks']:,} | {r['steps']} | {r['peak_running']} "
                f"| {r['preemptions']} | {r['mean_step_ms']:.2f} | {r['median_step_ms']:.2f} "
                f"| {r['lookups_per_step']:.2f} |")
        if args.instructions:
            line += f" {r['instructions_per_step'] / 1e6:.2f} M |"
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=1))
    return 0
