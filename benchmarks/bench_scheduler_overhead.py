"""Scheduler overhead of HiSparseResidencyConnector on vLLM's real Scheduler (CPU).

Same process, same workload, same KV plan (the connector's split: 4 sparse-MLA groups
+ 1 indexer group for the 4-layer test model), with and without the connector:
``--requests`` requests of ``--context`` prompt tokens are prefilled, then
``--steps`` decode steps are timed. A step is ``schedule()`` + ``update_from_output()``;
the fake forward (one sampled token per request) and the fake worker's acks are built
outside the timed region. The pool is sized so that every request stays fully resident
(steady state, no pressure): this measures the connector's fixed per-step cost.

``--evict-mib N`` touches an N MiB buffer between steps in both runs (untimed), standing
in for the host-side work a real engine does between two scheduler steps (measured: it
slows both runs alike; see docs/vllm-integration.md, "Scheduler overhead").

    python benchmarks/bench_scheduler_overhead.py --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm.scheduler_harness import SchedulerHarness  # noqa: E402
from tests.vllm.vllm_configs import kv_transfer_config, write_model_dir  # noqa: E402
from vllm_hisparse.vllm.plugin import register  # noqa: E402


def measure(model_dir: Path, *, connector: bool, requests: int, context: int, steps: int, warmup: int,
            evict_mib: int = 0) -> list[float]:
    block_size = 64
    # Requests prefilled first decode while the others prefill (two per step).
    max_tokens = warmup + steps + requests + 8
    max_model_len = context + max_tokens + block_size
    pages = -(-max_model_len // block_size)
    num_groups = 5
    harness = SchedulerHarness.build(
        model_dir,
        kv_transfer=kv_transfer_config({"host_pool_gib": 64}),
        construct_connector=connector,
        num_blocks=requests * (pages + 1) * num_groups + 64,
        max_model_len=max_model_len,
        max_num_seqs=requests,
        max_num_batched_tokens=max(2 * context, 4 * requests),
    )
    harness.add_requests(requests, prompt_len=context, max_tokens=max_tokens)
    scheduler = harness.scheduler
    # Prefill until every request decodes.
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in harness.requests.values()):
        harness.step()
    own = [0.0]
    if connector:
        # Time our connector's own scheduler-side methods, to separate them from what
        # vLLM's scheduler does for any connector.
        target = harness.connector
        for name in ("build_connector_meta", "update_connector_output", "get_kv_connector_stats",
                     "has_pending_push_work"):
            real = getattr(target, name)

            def timed(*a, _real=real, **k):
                t = time.perf_counter()
                try:
                    return _real(*a, **k)
                finally:
                    own[0] += time.perf_counter() - t

            setattr(target, name, timed)
    times, own_times = [], []
    evict = np.zeros(max(1, evict_mib * (1 << 20) // 8), dtype=np.int64)
    for i in range(warmup + steps):
        own[0] = 0.0
        t0 = time.perf_counter()
        output = scheduler.schedule()
        t1 = time.perf_counter()
        model_output = harness.fake_forward(output)  # not timed (fake model + fake worker acks)
        if evict_mib:
            evict += 1  # not timed: what runs between two steps in a real engine
        t2 = time.perf_counter()
        scheduler.update_from_output(output, model_output)
        t3 = time.perf_counter()
        assert len(output.num_scheduled_tokens) == requests, (i, len(output.num_scheduled_tokens), len(scheduler.running), len(scheduler.waiting))
        if i >= warmup:
            times.append((t1 - t0) + (t3 - t2))
            own_times.append(own[0])
    measure.own_ms = statistics.median(own_times) * 1e3
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2, help="alternate baseline/connector runs")
    parser.add_argument("--evict-mib", type=int, default=0,
                        help="touch this many MiB between steps in both runs (untimed)")
    args = parser.parse_args()
    register()
    model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "dsv32_tiny")
    results: dict[bool, list[float]] = {False: [], True: []}
    own_ms: list[float] = []
    for _ in range(args.repeats):
        for connector in (False, True):
            times = measure(model_dir, connector=connector, requests=args.requests, context=args.context,
                            steps=args.steps, warmup=args.warmup, evict_mib=args.evict_mib)
            results[connector].append(statistics.median(times) * 1e3)
            if connector:
                own_ms.append(measure.own_ms)
    base = min(results[False])
    ours = min(results[True])
    print(f"{args.requests} running requests x {args.context} tokens, {args.steps} decode steps "
          f"(schedule + update_from_output), median per step, best of {args.repeats}"
          f"{f', {args.evict_mib} MiB touched between steps' if args.evict_mib else ''}:")
    print(f"  {'without connector':<22} {base:8.3f} ms   ({base * 1e3 / args.requests:.2f} us/request)")
    print(f"  {'with connector':<22} {ours:8.3f} ms   ({ours * 1e3 / args.requests:.2f} us/request)")
    print(f"  {'ratio':<22} {ours / base:8.3f}   (target <= 1.10)")
    print(f"  {'of which our methods':<22} {min(own_ms):8.3f} ms   "
          f"({min(own_ms) / base * 100:.1f} % of the baseline step)")


if __name__ == "__main__":
    main()
