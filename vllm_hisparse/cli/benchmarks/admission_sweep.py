"""Does the connector ever lose to running without it? ``vllm-hisparse simulate`` over 64
configurations.

Each configuration runs the simulator's workload twice on the same device pool, without and
with ``HiSparseResidencyConnector`` (vLLM's real ``Scheduler``, both connector roles, the
synthetic DSA model; ``simulate``'s defaults otherwise: 4 sparse layers, 2 per indexer,
top-k 128, 32 sequences, 1024 batched tokens). The connector *loses* a configuration when,
with it, the peak of running requests is lower, the run takes more steps, or vLLM preempts
more often. The target is no loss anywhere.

The grid: 16 requests arriving at once (lengths within +-25 %, seeded per configuration),
prompts of 128, 512, 1024 and 4096 tokens, outputs of 64 and 512, four device pools per
prompt length (60 to 1000 blocks), and a loose host pool (every request at once) or a
tight one (four requests of the longest length). Row checks are off by default (they do
not change a scheduling decision; ``--check`` turns them on).

    vllm-hisparse bench admission-sweep                  # all 64, ~15 min on 2 cores
    vllm-hisparse bench admission-sweep --only 0-7 --check
    vllm-hisparse bench admission-sweep --json sweep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from vllm_hisparse.cli.simulate import DEFAULTS
from vllm_hisparse.core.units import GIB, cdiv

PROMPTS = (128, 512, 1024, 4096)
OUTPUTS = (64, 512)
#: Device pools per prompt length (blocks, all KV cache groups together).
POOLS = {128: (60, 80, 120, 200), 512: (64, 120, 240, 480), 1024: (100, 160, 320, 640),
         4096: (280, 400, 600, 1000)}
HOSTS = ("loose", "tight")
NUM_REQUESTS = 16
JITTER = 0.25
#: A tight host pool backs this many requests of the longest length at once.
TIGHT_HOST_REQUESTS = 4


def _host_block_bytes(spec) -> int:
    """One host block: a page of every sparse-MLA layer and of every indexer layer."""
    from vllm_hisparse.vllm.simulation.model import INDEXER_ROW_BYTES, MLA_ROW_BYTES

    indexers = len(spec.leaders)
    return spec.block_size * (spec.num_layers * MLA_ROW_BYTES + indexers * INDEXER_ROW_BYTES)


def configurations(check: bool = False) -> list:
    """The 64 :class:`SimulationSpec` of the sweep, in a fixed order."""
    from vllm_hisparse.vllm.simulation.spec import SimulationSpec

    base = dict(num_layers=DEFAULTS["layers"], layers_per_indexer=DEFAULTS["layers_per_indexer"],
                block_size=DEFAULTS["block_size"], top_k=DEFAULTS["top_k"],
                prefill_top_k=DEFAULTS["prefill_top_k"], max_num_seqs=DEFAULTS["max_num_seqs"],
                max_num_batched_tokens=DEFAULTS["max_num_batched_tokens"],
                num_requests=NUM_REQUESTS, length_jitter=JITTER, check=check)
    specs = []
    for prompt in PROMPTS:
        for output in OUTPUTS:
            for blocks in POOLS[prompt]:
                for host in HOSTS:
                    seed = len(specs)
                    spec = SimulationSpec(prompt_len=prompt, output_len=output, device_blocks=blocks,
                                          seed=seed, **base)
                    if host == "tight":
                        pages = TIGHT_HOST_REQUESTS * cdiv(spec.max_model_len, spec.block_size)
                        gib = pages * _host_block_bytes(spec) / GIB
                        spec = dataclasses.replace(spec, host_pool_gib=cdiv(int(gib * 4096), 1) / 4096)
                    specs.append(spec)
    return specs


def _command(spec) -> str:
    """The ``vllm-hisparse simulate`` command line of one configuration."""
    cmd = (f"vllm-hisparse simulate --requests {spec.num_requests} --prompt-len {spec.prompt_len} "
           f"--output-len {spec.output_len} --length-jitter {spec.length_jitter} "
           f"--device-blocks {spec.device_blocks} --seed {spec.seed}")
    if spec.host_pool_gib is not None:
        cmd += f" --host-pool-gib {spec.host_pool_gib}"
    return cmd


def run_one(spec) -> dict:
    """Both runs of one configuration: ``{"without": {...}, "with": {...}}`` (or an error)."""
    from vllm_hisparse.vllm.simulation.engine import SimulationEngine, SimulationFailure

    engine = SimulationEngine(spec)
    out: dict = {"command": _command(spec)}
    try:
        for label, with_connector in (("without", False), ("with", True)):
            r = engine.run(with_connector)
            out[label] = {"peak_running": r.peak_running, "steps": r.steps,
                          "preemptions": r.preemptions, "finished": r.finished,
                          "mean_running": round(r.mean_running, 2), "wall_s": round(r.wall_s, 2),
                          "demotions": r.demotions, "promotions": r.promotions}
    except (SimulationFailure, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        engine.close()
    return out


def losses(result: dict) -> list[str]:
    """How the run with the connector lost to the one without (empty: it did not)."""
    if "error" in result:
        return ["error"]
    a, b = result["without"], result["with"]
    out = []
    if b["peak_running"] < a["peak_running"]:
        out.append(f"peak {b['peak_running']} < {a['peak_running']}")
    if b["steps"] > a["steps"]:
        out.append(f"steps {b['steps']} > {a['steps']}")
    if b["preemptions"] > a["preemptions"]:
        out.append(f"preemptions {b['preemptions']} > {a['preemptions']}")
    return out


def _parse_only(text: str | None, n: int) -> list[int]:
    if not text:
        return list(range(n))
    picked: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if not 0 <= first <= last < n:
            raise SystemExit(f"--only {text!r}: indices must lie in 0-{n - 1}")
        picked.extend(range(first, last + 1))
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hisparse bench admission-sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--only", help="configuration indices, e.g. 0-7,12 (default: all 64)")
    parser.add_argument("--check", action="store_true", help="check every row read (slower)")
    parser.add_argument("--json", type=Path, help="write every configuration's result here")
    args = parser.parse_args(argv)
    from vllm_hisparse.cli.quiet import quiet

    with quiet(verbose=False):
        import torch

        torch.set_num_threads(1)
        _sweep(args)
    return 0


def _sweep(args: argparse.Namespace) -> None:
    specs = configurations(check=args.check)
    picked = _parse_only(args.only, len(specs))
    results = []
    started = time.perf_counter()
    print("| # | prompt | output | blocks | host | peak without / with | steps without / with "
          "| preemptions without / with | lost |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i in picked:
        spec = specs[i]
        result = run_one(spec)
        result["index"] = i
        result["lost"] = losses(result)
        results.append(result)
        host = "loose" if spec.host_pool_gib is None else f"{spec.host_pool_gib:g} GiB"
        if "error" in result:
            print(f"| {i} | {spec.prompt_len} | {spec.output_len} | {spec.device_blocks} | {host} "
                  f"| {result['error']} | | | error |", flush=True)
            continue
        a, b = result["without"], result["with"]
        print(f"| {i} | {spec.prompt_len} | {spec.output_len} | {spec.device_blocks} | {host} "
              f"| {a['peak_running']} / {b['peak_running']} | {a['steps']} / {b['steps']} "
              f"| {a['preemptions']} / {b['preemptions']} | {'; '.join(result['lost']) or '-'} |",
              flush=True)
    ok = [r for r in results if "error" not in r]
    lost = [r for r in results if r["lost"]]

    def total(key: str, label: str) -> int:
        return sum(r[label][key] for r in ok)

    print()
    print(f"{len(results)} configurations in {time.perf_counter() - started:.0f} s; the connector "
          f"lost {len(lost)}: lower peak in "
          f"{sum(any(x.startswith('peak') for x in r['lost']) for r in results)}, more steps in "
          f"{sum(any(x.startswith('steps') for x in r['lost']) for r in results)}, more preemptions in "
          f"{sum(any(x.startswith('preemptions') for x in r['lost']) for r in results)}, errors "
          f"{len(results) - len(ok)}")
    print(f"summed over the configurations, without / with: steps {total('steps', 'without')} / "
          f"{total('steps', 'with')}, preemptions {total('preemptions', 'without')} / "
          f"{total('preemptions', 'with')}, peak running {total('peak_running', 'without')} / "
          f"{total('peak_running', 'with')}")
    if args.json:
        args.json.write_text(json.dumps({"configurations": results}, indent=1))
