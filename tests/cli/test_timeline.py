"""The overlap arithmetic of the decode-capacity benchmark's --trace (no GPU needed)."""

from __future__ import annotations

import random

import pytest

from vllm_hisparse.cli.benchmarks.timeline import (gather_overlap, intersect_us,
                                                   kernels_from_chrome_trace, union)


def test_union_merges_touching_and_nested_intervals_and_drops_empty_ones():
    assert union([(5, 7), (0, 2), (1, 3), (3, 4), (6, 6.5), (9, 9)]) == [(0, 4), (5, 7)]
    assert union([]) == []


def brute_force_intersection(a, b, step=0.5):
    covered = lambda xs, t: any(s <= t < e for s, e in xs)
    return sum(step for k in range(int(40 / step)) if covered(a, k * step) and covered(b, k * step))


@pytest.mark.parametrize("seed", range(20))
def test_intersection_matches_a_brute_force_count(seed):
    rng = random.Random(seed)
    make = lambda: union((s, s + rng.randint(1, 6)) for s in
                         (rng.randint(0, 30) for _ in range(rng.randint(0, 6))))
    a, b = make(), make()
    assert intersect_us(a, b) == brute_force_intersection(a, b)
    assert intersect_us(a, b) == intersect_us(b, a)


def test_gather_overlap_splits_hidden_and_exposed_time():
    kernels = [
        (0.0, 10.0, "void copy_rows_kernel<41, 4>(...)", 7),   # gather on the compute stream
        (10.0, 30.0, "gemm_kernel", 7),
        (12.0, 20.0, "void copy_rows_kernel<41, 4>(...)", 9),  # side stream, under the gemm
        (25.0, 35.0, "void copy_rows_kernel<41, 4>(...)", 9),  # half under the gemm
        (40.0, 45.0, "index_select", 7),                       # 35-40: nothing runs
    ]
    t = gather_overlap(kernels)
    assert t["span_us"] == 45.0
    assert t["gather_us"] == 10.0 + 8.0 + 10.0
    assert t["gather_hidden_us"] == 8.0 + 5.0
    assert t["gather_exposed_us"] == 28.0 - 13.0
    assert t["other_us"] == 25.0
    assert t["idle_us"] == 5.0
    assert t["gather_kernels"] == 3 and t["streams"] == 2


def test_kernels_are_read_from_a_chrome_trace_and_other_events_are_ignored():
    trace = {"traceEvents": [
        {"cat": "kernel", "name": "k1", "ts": 100.5, "dur": 2.0, "args": {"stream": 7}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 99.0, "dur": 1.0},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 90.0, "dur": 3.0},
        {"cat": "kernel", "name": "k2", "ts": 103.0, "dur": 1.5, "args": {"stream": 9}},
        {"ph": "M", "name": "process_name"},
    ]}
    assert kernels_from_chrome_trace(trace) == [(100.5, 102.5, "k1", 7), (103.0, 104.5, "k2", 9)]
