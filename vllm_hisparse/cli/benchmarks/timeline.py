"""Kernel timeline of a profiled region: how much gather time ran under other kernels.

The decode-capacity benchmark's question is whether the host→hot gathers of an index group's
followers run *while* the model computes (then their time is hidden) or between its kernels
(then it adds to the step). Step times alone cannot tell the two apart when the copies also
slow the compute down, so this module reads the kernels' own start and end times from
``torch.profiler`` (CUPTI) and measures the overlap directly.

Intervals are ``(start_us, end_us)`` floats; a kernel is ``(start_us, end_us, name, stream)``.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Callable, Iterable, Sequence

#: Substring of the gather kernel's name (csrc/copy_rows.cu); the reference twin never shows.
GATHER_KERNEL = "copy_rows"

Interval = tuple[float, float]
Kernel = tuple[float, float, str, int]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the given ones (empty ones dropped)."""
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length_us(intervals: Sequence[Interval]) -> float:
    """Total length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def intersect_us(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of the intersection of two lists of sorted disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernels_from_chrome_trace(trace: dict) -> list[Kernel]:
    """The GPU kernels of a ``torch.profiler`` Chrome trace (``traceEvents`` with
    ``cat == "kernel"``, ``ts``/``dur`` in µs, ``args.stream``)."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel" or "dur" not in ev:
            continue
        start = float(ev["ts"])
        out.append((start, start + float(ev["dur"]), str(ev.get("name", "")),
                    int(ev.get("args", {}).get("stream", -1))))
    return out


def gather_overlap(kernels: Sequence[Kernel], gather_name: str = GATHER_KERNEL) -> dict:
    """Split the region's GPU time into gather and other kernels and measure their overlap.

    Returns µs: ``span_us`` (first start to last end), ``gather_us`` and ``other_us`` (union
    of each kind's kernels), ``gather_hidden_us`` (gather time during which some other kernel
    ran), ``gather_exposed_us`` (``gather_us - gather_hidden_us``), ``idle_us`` (no kernel at
    all), ``gather_kernels`` and ``streams`` (distinct streams seen)."""
    gathers = union((s, e) for s, e, name, _ in kernels if gather_name in name)
    others = union((s, e) for s, e, name, _ in kernels if gather_name not in name)
    everything = union(list(gathers) + list(others))
    span = (everything[-1][1] - everything[0][0]) if everything else 0.0
    hidden = intersect_us(gathers, others)
    gather_us = length_us(gathers)
    return dict(span_us=span, gather_us=gather_us, other_us=length_us(others),
                gather_hidden_us=hidden, gather_exposed_us=gather_us - hidden,
                idle_us=span - length_us(everything),
                gather_kernels=sum(1 for k in kernels if gather_name in k[2]),
                streams=len({k[3] for k in kernels}))


def profile_kernels(fn: Callable[[], None]) -> list[Kernel]:
    """Run ``fn`` once under ``torch.profiler`` (CUDA activity) and return its kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return kernels_from_chrome_trace(json.load(f))
    finally:
        os.unlink(path)
