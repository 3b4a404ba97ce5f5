"""Cost of one residency-policy step with many long running requests.

Default: 256 running requests of 32K tokens (64-token pages, 512 pages each), decoding one
token per step. Each measured step is what the scheduler side pays per engine step:

    apply_acks(previous step's worker report) + schedule (every request) + build_step()

Scenarios:
  full          no pressure: every request FULL (mirror only)
  mixed         every request MIXED (hot region leased, clean pages released as they seal)
  full-per-req  as ``full`` but one ``schedule()`` call per request instead of the batched
                ``schedule_rows()`` (what a per-request connector hook would cost)

Usage:
    vllm-hisparse bench core-step [--requests 256] [--context 32768] [--steps 640]
                                         [--repeats 1] [--json]

``--repeats N`` runs every scenario N times and keeps the run with the lowest mean (a shared
or busy machine only ever adds time).

The vLLM connector budget is 10 % of a 2.2 ms scheduler step at 256 requests, i.e. about
0.86 us per running request per step for everything the connector adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from vllm_hisparse.core import (
    HostBlockPool,
    InMemoryDevicePool,
    PolicyConfig,
    Residency,
    ResidencyPolicy,
    WorkerAcks,
)

BUDGET_US_PER_REQUEST = 0.10 * 2200 / 256


def build(num_requests: int, context_tokens: int, block_size: int, hot_rows: int, mixed: bool):
    """A policy with ``num_requests`` requests prefilled to ``context_tokens``."""
    pages = -(-context_tokens // block_size)
    headroom_pages = 64  # room to decode past the context during the run
    num_device = num_requests * (pages + headroom_pages) + 1024
    cfg = PolicyConfig(
        block_size=block_size,
        max_num_rows=num_requests,
        max_pages_per_request=pages + headroom_pages,
        device_buffer_size_rows=hot_rows,
        low_watermark_blocks=16,
        high_watermark_blocks=num_device + 1,  # never promote during the run
        min_steps_between_transitions=0,
    )
    policy = ResidencyPolicy(cfg, InMemoryDevicePool(num_device), HostBlockPool(num_requests * (pages + headroom_pages)))
    rows = np.array([policy.add_request(f"r{i}").row for i in range(num_requests)], dtype=np.int64)
    # Stagger lengths by up to one page so page crossings spread over steps as in real
    # traffic (synchronised crossings would put every allocation into one step).
    lengths = context_tokens - 1 - (np.arange(num_requests) % block_size)
    policy.schedule_rows(rows, lengths.astype(np.int64))
    cmd = policy.build_step()
    policy.apply_acks(WorkerAcks(completed=[t.transfer_id for t in cmd.transfers]))
    if mixed:
        # One step under a watermark nobody can meet: every request is worth demoting.
        policy.low_watermark_blocks = num_device + 1
        policy.schedule_rows(rows, np.ones(num_requests, dtype=np.int64))
        cmd = policy.build_step()
        policy.apply_acks(WorkerAcks(completed=[t.transfer_id for t in cmd.transfers]))
        policy.low_watermark_blocks = 16
        assert all(policy.residency(f"r{i}") == Residency.MIXED for i in range(num_requests))
    return policy, rows


def run(scenario: str, num_requests: int, context_tokens: int, steps: int, block_size: int, hot_rows: int) -> dict:
    policy, rows = build(num_requests, context_tokens, block_size, hot_rows, mixed=(scenario == "mixed"))
    ones = np.ones(num_requests, dtype=np.int64)
    ids = [f"r{i}" for i in range(num_requests)]
    per_request = scenario == "full-per-req"
    pending = WorkerAcks()
    samples = []
    transfers = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        policy.apply_acks(pending)
        if per_request:
            for rid in ids:
                policy.schedule(rid, 1)
        else:
            policy.schedule_rows(rows, ones)
        cmd = policy.build_step()
        samples.append(time.perf_counter() - t0)
        # The worker reports last step's transfers with the next step (async scheduling).
        pending = WorkerAcks(completed=[t.transfer_id for t in cmd.transfers])
        transfers += len(cmd.transfers)
    policy.check_invariants()
    samples_us = np.array(samples) * 1e6
    mean = float(samples_us.mean())
    return {
        "scenario": scenario,
        "num_requests": num_requests,
        "context_tokens": context_tokens,
        "block_size": block_size,
        "steps": steps,
        "mean_us_per_step": mean,
        "p50_us_per_step": float(np.percentile(samples_us, 50)),
        "p99_us_per_step": float(np.percentile(samples_us, 99)),
        "max_us_per_step": float(samples_us.max()),
        "us_per_request_per_step": mean / num_requests,
        "budget_us_per_request_per_step": BUDGET_US_PER_REQUEST,
        "pages_released": policy.stats.num_pages_released,
        "transfers_per_step": transfers / steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hisparse bench core-step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=32768, help="tokens per request before decoding")
    parser.add_argument("--steps", type=int, default=640, help="decode steps measured (64 = one page each)")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--hot-rows", type=int, default=4096, help="device_buffer_size (rows)")
    parser.add_argument("--scenarios", default="full,mixed,full-per-req")
    parser.add_argument("--repeats", type=int, default=1, help="runs per scenario; the lowest mean is kept")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    results = [
        min(
            (run(s, args.requests, args.context, args.steps, args.block_size, args.hot_rows)
             for _ in range(max(1, args.repeats))),
            key=lambda r: r["mean_us_per_step"],
        )
        for s in args.scenarios.split(",")
    ]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"residency policy step: {args.requests} requests x {args.context} tokens, "
          f"block {args.block_size}, {args.steps} decode steps, best of {max(1, args.repeats)}")
    header = f"{'scenario':<14}{'mean us/step':>14}{'p50':>10}{'p99':>10}{'us/req/step':>13}{'budget':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r['scenario']:<14}{r['mean_us_per_step']:>14.1f}{r['p50_us_per_step']:>10.1f}"
              f"{r['p99_us_per_step']:>10.1f}{r['us_per_request_per_step']:>13.3f}"
              f"{r['budget_us_per_request_per_step']:>9.2f}")
    return 0
