"""Scheduler overhead of HiSparseResidencyConnector on vLLM's real Scheduler (CPU).

Same workload and same KV plan (the connector's split: 4 sparse-MLA groups + 1 indexer
group for the 4-layer test model) under three configurations:

* ``none``: no connector (vLLM's stock managers over the same plan): the baseline;
* ``noop``: a trivial ``KVConnectorBase_V1`` + ``SupportsHMA`` connector that does
  nothing, i.e. what vLLM's scheduler itself spends because *a* connector is configured;
* ``hisparse``: our connector (scheduler role, with a fake worker acking its transfers).

``--requests`` requests of ``--context`` prompt tokens are prefilled, then ``--steps``
decode steps are timed. A step is ``schedule()`` + ``update_from_output()``; the fake
forward (one sampled token per request) and the fake worker's acks are built outside the
timed region. The pool is sized so that every request stays fully resident (steady
state, no pressure): this measures the connector's fixed per-step cost.

Measurement hygiene: every run is a fresh process (CPython's specialising interpreter
keeps per-call-site state, so a run must not inherit call sites warmed by another
configuration); the configurations are interleaved round by round (A/B/C, then
B/C/A, ...); ratios are taken within a round and reported as median and range over the
rounds.

``--evict-mib N`` touches an N MiB buffer between steps (untimed), standing in for the
host-side work a real engine does between two scheduler steps.

``--instructions`` counts instructions instead of timing: each configuration runs once
under valgrind's callgrind, which counts only the timed region (a tiny C helper issuing
callgrind's client requests is compiled on first use; needs ``cc`` and valgrind's headers).
The counts do not depend on the machine's load; ``hisparse`` is also counted with our
connector's methods left out, which separates vLLM's share from ours. Slow (minutes per
run): use fewer steps.

    python benchmarks/bench_scheduler_overhead.py --repeats 5
    python benchmarks/bench_scheduler_overhead.py --instructions --requests 64 --context 2048 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm.dsa_specs import dsa_layer_specs  # noqa: E402
from tests.vllm.scheduler_harness import SchedulerHarness, planned_kv_cache_config  # noqa: E402
from tests.vllm.vllm_configs import kv_transfer_config, make_vllm_config, write_model_dir  # noqa: E402
from vllm_hisparse.core.capacity import HostMemoryLimit  # noqa: E402
from vllm_hisparse.vllm import compat  # noqa: E402
from vllm_hisparse.vllm import config as config_module  # noqa: E402
from vllm_hisparse.vllm.plugin import register  # noqa: E402

MODES = ("none", "noop", "hisparse")
NOOP_CONNECTOR = "BenchNoopConnector"
#: Our connector's scheduler-side methods, timed to separate them from vLLM's own work.
OWN_METHODS = ("build_connector_meta", "update_connector_output", "get_kv_connector_stats",
               "has_pending_push_work", "has_pending_block_frees", "get_num_new_matched_tokens",
               "update_state_after_alloc", "request_finished_all_groups", "take_events")


class NoopConnector(compat.KVConnectorBase_V1, compat.SupportsHMA):
    """A connector that does nothing: what any configured connector costs vLLM."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return compat.KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


def build_harness(model_dir: Path, mode: str, *, requests: int, context: int, max_tokens: int) -> SchedulerHarness:
    """A scheduler over our connector's KV plan, with ``mode``'s connector (or none)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    block_size = 64
    max_model_len = context + max_tokens + block_size
    pages = -(-max_model_len // block_size)
    num_groups = 5
    # The scheduler side pins no host memory (its host pool is bookkeeping), so the 64 GiB
    # pool of a 256 x 32K run is checked against a 1 TiB host, whatever this machine has.
    config_module.host_memory_limit = lambda: HostMemoryLimit(1 << 40, None, None)
    vllm_config = make_vllm_config(
        model_dir,
        kv_transfer=kv_transfer_config({"host_pool_gib": 64}),
        max_model_len=max_model_len,
        max_num_seqs=requests,
        max_num_batched_tokens=max(2 * context, 4 * requests),
    )
    specs = dsa_layer_specs(4, block_size=block_size)
    # Planned with our connector configured (its group split), whatever runs after.
    kv_cache_config = planned_kv_cache_config(vllm_config, specs, requests * (pages + 1) * num_groups + 64)
    if mode == "none":
        vllm_config.kv_transfer_config = None
    elif mode == "noop":
        if not compat.connector_is_registered(NOOP_CONNECTOR):
            compat.KVConnectorFactory.register_connector(NOOP_CONNECTOR, __name__, NoopConnector.__name__)
        vllm_config.kv_transfer_config = type(vllm_config.kv_transfer_config)(
            kv_connector=NOOP_CONNECTOR, kv_role="kv_both")
    return SchedulerHarness(vllm_config, kv_cache_config)


def measure(model_dir: Path, mode: str, *, requests: int, context: int, steps: int, warmup: int,
            evict_mib: int = 0, callgrind: str | None = None) -> dict[str, Any]:
    """One run: per-step times (ms) of ``steps`` decode steps after ``warmup`` steps.

    ``callgrind`` (the process runs under ``valgrind --tool=callgrind``): ``"all"`` counts
    the instructions of the timed region, ``"vllm"`` the same minus our connector's
    methods (``OWN_METHODS``); the parent reads the counts from callgrind's output.
    """
    # Requests prefilled first decode while the others prefill (two per step).
    max_tokens = warmup + steps + requests + 8
    harness = build_harness(model_dir, mode, requests=requests, context=context, max_tokens=max_tokens)
    harness.add_requests(requests, prompt_len=context, max_tokens=max_tokens)
    scheduler = harness.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in harness.requests.values()):
        harness.step()
    start = toggle = None
    if callgrind is not None:
        start, toggle = _callgrind_controls()
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
    for i in range(warmup + steps):
        counted = toggle is not None and i >= warmup
        if start is not None and i == warmup:
            start()
        own[0] = 0.0
        if counted:
            toggle()
        t0 = time.perf_counter()
        output = scheduler.schedule()
        t1 = time.perf_counter()
        if counted:
            toggle()
        model_output = harness.fake_forward(output)  # not timed (fake model + fake worker acks)
        if evict_mib:
            evict += 1  # not timed: what runs between two steps in a real engine
        if counted:
            toggle()
        t2 = time.perf_counter()
        scheduler.update_from_output(output, model_output)
        t3 = time.perf_counter()
        if counted:
            toggle()
        if len(output.num_scheduled_tokens) != requests:
            raise RuntimeError(f"step {i}: {len(output.num_scheduled_tokens)} of {requests} requests scheduled "
                               f"({len(scheduler.running)} running, {len(scheduler.waiting)} waiting)")
        if i >= warmup:
            times.append(((t1 - t0) + (t3 - t2)) * 1e3)
            own_times.append(own[0] * 1e3)
    return {"mode": mode, "median_ms": statistics.median(times), "min_ms": min(times),
            "own_ms": statistics.median(own_times)}


# Callgrind client requests (valgrind/callgrind.h), compiled on first use: instruction
# counts of exactly the timed region are deterministic, unlike times on a shared VM.
_CALLGRIND_SOURCE = """#include <valgrind/callgrind.h>
void hs_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void hs_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def _callgrind_controls() -> tuple[Any, Any]:
    """``(start_instrumentation, toggle_collect)`` as ctypes functions."""
    import ctypes

    out = Path(tempfile.mkdtemp()) / "libhs_callgrind.so"
    src = out.with_suffix(".c")
    src.write_text(_CALLGRIND_SOURCE)
    done = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"--callgrind needs a C compiler and valgrind's callgrind.h:\n{done.stderr}")
    lib = ctypes.CDLL(str(out))
    return lib.hs_start, lib.hs_toggle


def _run_child(args: argparse.Namespace, mode: str, callgrind: str | None = None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--model-dir", str(args.model_dir),
           "--requests", str(args.requests), "--context", str(args.context), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--evict-mib", str(args.evict_mib)]
    env = None
    if callgrind is not None:
        out_file = Path(tempfile.mkdtemp()) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={out_file}", *cmd, "--callgrind", callgrind]
        # Same string hashes in every run: dict layouts, hence instruction counts, repeat.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if callgrind is not None:
        totals = [line for line in out_file.read_text().splitlines() if line.startswith(("totals:", "summary:"))]
        result["instructions_per_step"] = int(totals[-1].split()[1]) / args.steps
    return result


def count_instructions(args: argparse.Namespace, modes: list[str]) -> None:
    """Instructions per step of every mode, and of vLLM's part of the ``hisparse`` step."""
    if shutil.which("valgrind") is None:
        raise SystemExit("--instructions needs valgrind (callgrind) on PATH; not found")
    counts: dict[str, float] = {}
    for mode in modes:
        counts[mode] = _run_child(args, mode, "all")["instructions_per_step"]
        print(f"  {mode:<9} {counts[mode] / 1e6:.3f} M instructions per step", file=sys.stderr, flush=True)
    if "hisparse" in modes:
        counts["hisparse_vllm_part"] = _run_child(args, "hisparse", "vllm")["instructions_per_step"]
    base = counts["none"]
    print(f"{args.requests} running requests x {args.context} tokens, {args.steps} decode steps "
          "(schedule + update_from_output): instructions per step (callgrind, one run each)")
    labels = {"none": "none", "noop": "noop", "hisparse": "hisparse",
              "hisparse_vllm_part": "  of which vLLM's calls"}
    for key, value in counts.items():
        print(f"  {labels[key]:<24} {value / 1e6:9.3f} M   ratio to none {value / base:.4f}")
    if "hisparse" in counts:
        own = counts["hisparse"] - counts["hisparse_vllm_part"]
        print(f"  {'  of which our methods':<24} {own / 1e6:9.3f} M   ({own / base * 100:.1f} % of none)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "instructions_per_step": counts}, indent=1))


def _spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5, help="rounds; each runs every mode once, interleaved")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    parser.add_argument("--evict-mib", type=int, default=0,
                        help="touch this many MiB between steps (untimed)")
    parser.add_argument("--json", type=Path, help="write every run and the summary here")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions of the timed region under valgrind's callgrind instead "
                             "of timing (deterministic; one run per mode; slow: use e.g. --requests 64 "
                             "--context 2048 --steps 20)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--callgrind", choices=("all", "vllm"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    register()
    if args.child:
        result = measure(args.model_dir, args.child, requests=args.requests, context=args.context,
                         steps=args.steps, warmup=args.warmup, evict_mib=args.evict_mib,
                         callgrind=args.callgrind)
        print(json.dumps(result))
        return
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or "none" not in modes:
        parser.error(f"--modes: {bad or 'none is required'}; accepted: {MODES}")
    args.model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "dsv32_tiny")
    if args.instructions:
        count_instructions(args, modes)
        return
    runs: list[dict[str, Any]] = []
    for round_index in range(args.repeats):
        # Rotate the order every round so no configuration always runs first.
        k = round_index % len(modes)
        for mode in modes[k:] + modes[:k]:
            result = _run_child(args, mode)
            result["round"] = round_index
            runs.append(result)
            print(f"  round {round_index} {mode:<9} {result['median_ms']:.3f} ms", file=sys.stderr, flush=True)
    by_mode = {m: [r for r in runs if r["mode"] == m] for m in modes}
    per_round = {m: {r["round"]: r["median_ms"] for r in by_mode[m]} for m in modes}
    base = [r["median_ms"] for r in by_mode["none"]]
    print(f"{args.requests} running requests x {args.context} tokens, {args.steps} decode steps "
          f"(schedule + update_from_output); per run the median step, then median [min-max] over "
          f"{args.repeats} interleaved rounds (one process per run)"
          f"{f', {args.evict_mib} MiB touched between steps' if args.evict_mib else ''}:")
    summary: dict[str, Any] = {}
    for mode in modes:
        ms = [r["median_ms"] for r in by_mode[mode]]
        ratios = [per_round[mode][i] / per_round["none"][i] for i in range(args.repeats)]
        summary[mode] = {"median_ms": ms, "ratio_to_none": ratios}
        line = f"  {mode:<9} {_spread(ms, '.3f')} ms   ({statistics.median(ms) * 1e3 / args.requests:.2f} us/request)"
        if mode != "none":
            line += f"   ratio to none {_spread(ratios, '.3f')}"
        print(line)
    if "noop" in modes and "hisparse" in modes:
        ratios = [per_round["hisparse"][i] / per_round["noop"][i] for i in range(args.repeats)]
        summary["hisparse_to_noop"] = ratios
        print(f"  hisparse / noop       {_spread(ratios, '.3f')}   (our share; noop / none is vLLM's)")
    if "hisparse" in modes:
        own = [r["own_ms"] for r in by_mode["hisparse"]]
        summary["own_ms"] = own
        print(f"  our methods           {_spread(own, '.3f')} ms   "
              f"({statistics.median(own) / statistics.median(base) * 100:.1f} % of the baseline step)")
        print("  target: hisparse / none <= 1.10")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "runs": runs, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
