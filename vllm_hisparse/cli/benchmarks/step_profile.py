"""One decode step's GPU timeline under ``torch.profiler``: where the step's time went.

``bench throughput`` profiles one step per system at its largest batch, over the same span as
a timed step (from before ``start_load_kv`` to after ``wait_for_save``) and behind the same
gate (a long busy wait queued first, so the host has queued the whole step before the GPU
starts it; :mod:`.throughput_probe`). The timeline (kernels, copies, memsets: what CUPTI
records, kernels replayed from a CUDA graph included) gives:

* ``kernel_ms``: GPU time per kernel class (:data:`KERNEL_CLASSES`, first match wins;
  copies and memsets are the ``copy / memset`` class);
* ``span_ms``: from the gate's end to the step's last event; ``idle_ms``: the part of the
  span in which nothing ran (the union of all streams' events subtracted);
* ``idle_before``: that idle time by the name of the event that ended each gap, largest first
  (a gap is the GPU waiting for what comes next: a graph's node gaps, a copy's DMA latency, a
  stream waiting on another's event);
* ``kernels``: GPU time and launch count per event name, largest first (the
  :data:`NUM_KERNEL_NAMES` largest): what to compare between two systems' profiles;
* ``side_ms`` / ``side_exposed_ms``: per class, the GPU time of its events on streams other
  than the compute stream (the gate's), and the part of it in which the compute stream ran
  nothing. A class's kernel time alone does not say what the step waited for: the leader's
  miss gather (the side stream of its index group, the compute stream waiting) and the
  background copies (spills, restores, the mirror, beside the compute stream's work) are one
  kernel; the exposed part is the former.
"""

from __future__ import annotations

import json
import os
import re
import tempfile

#: Kernel-name patterns of the split, first match wins (our kernels by their names in csrc/;
#: elementwise torch kernels fall to "other").
KERNEL_CLASSES = (
    ("indexer logits", re.compile(r"indexer_logits", re.I)),  # bench throughput's stand-ins
    ("sparse MLA", re.compile(r"sparse_mla_decode", re.I)),
    ("resolve", re.compile(r"resolve", re.I)),
    ("merge rows", re.compile(r"merge_rows|token_state_rows|score_threshold|slot_classes", re.I)),
    ("gather", re.compile(r"copy_rows|gather_rows|zero_copy", re.I)),
    ("comm stand-in", re.compile(r"sleep|spin", re.I)),
    ("top-k", re.compile(r"topk|radix|sort|bitonic", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|sm90_|cublas|bmm|matmul", re.I)),
    ("conversion (vLLM)", re.compile(r"convert|physical", re.I)),
    ("row gather (attention)", re.compile(r"index_select|indexselect|index_kernel", re.I)),
    ("softmax", re.compile(r"softmax", re.I)),
)
#: Chrome-trace categories of GPU activity.
GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "copy", "gpu_memset": "copy"}
#: Gaps listed in ``idle_before``.
NUM_IDLE_NAMES = 8
#: Event names listed in ``kernels``.
NUM_KERNEL_NAMES = 40
#: Characters of an event name kept in ``idle_before`` and ``kernels``.
NAME_CHARS = 100


def kernel_class(name: str) -> str:
    return next((c for c, rx in KERNEL_CLASSES if rx.search(name)), "other")


#: One GPU event: start and end (µs), name, class, stream.
Event = tuple[float, float, str, str, int]


def gpu_events(trace: dict) -> list[Event]:
    """``(start_us, end_us, name, class, stream)`` of every GPU event of a chrome trace, by
    start (the stream from the event's ``args``, else its ``tid``)."""
    out = []
    for ev in trace.get("traceEvents", []):
        kind = GPU_CATEGORIES.get(str(ev.get("cat", "")).lower())
        if kind is None or ev.get("ph") != "X":
            continue
        ts, dur, name = float(ev["ts"]), float(ev.get("dur", 0.0)), str(ev.get("name", ""))
        stream = int((ev.get("args") or {}).get("stream", ev.get("tid", 0)) or 0)
        out.append((ts, ts + dur, name,
                    "copy / memset" if kind == "copy" else kernel_class(name), stream))
    out.sort()
    return out


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _covered_us(s: float, e: float, busy: list[tuple[float, float]]) -> float:
    """µs of ``[s, e]`` inside the (disjoint, sorted) ``busy`` intervals."""
    return sum(max(0.0, min(e, be) - max(s, bs)) for bs, be in busy if bs < e and be > s)


def split_timeline(events: list[Event], gate_us: float) -> dict:
    """The split of the events after the gate (the first event at least ``gate_us / 2`` long;
    from the first event when there is none; the compute stream is the gate's, else the
    first event's). Times in ms."""
    gate = next((ev for ev in events if ev[1] - ev[0] >= gate_us / 2), None)
    start = None if gate is None else gate[1]
    step = [ev for ev in events if start is None or ev[0] >= start]
    if not step:
        return dict(kernel_ms={}, span_ms=0.0, idle_ms=0.0, idle_before=[], kernels=[],
                    side_ms={}, side_exposed_ms={})
    begin = step[0][0] if start is None else start
    compute = (step[0] if gate is None else gate)[4]
    compute_busy = _union([(s, e) for s, e, _, _, st in step if st == compute])
    classes: dict[str, float] = {}
    side: dict[str, float] = {}
    side_exposed: dict[str, float] = {}
    idle: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    covered, total_idle = begin, 0.0
    for s, e, name, label, stream in step:
        if stream != compute:
            side[label] = side.get(label, 0.0) + (e - s) / 1e3
            side_exposed[label] = (side_exposed.get(label, 0.0)
                                   + (e - s - _covered_us(s, e, compute_busy)) / 1e3)
        classes[label] = classes.get(label, 0.0) + (e - s) / 1e3
        busy = by_name.setdefault(name[:NAME_CHARS], [0.0, 0])
        busy[0] += (e - s) / 1e3
        busy[1] += 1
        if s > covered:
            gap = s - covered
            total_idle += gap
            entry = idle.setdefault(name[:NAME_CHARS], [0.0, 0])
            entry[0] += gap / 1e3
            entry[1] += 1
        covered = max(covered, e)
    ranked = sorted(idle.items(), key=lambda kv: -kv[1][0])[:NUM_IDLE_NAMES]
    busiest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:NUM_KERNEL_NAMES]
    return dict(kernel_ms=classes, span_ms=(covered - begin) / 1e3, idle_ms=total_idle / 1e3,
                idle_before=[dict(name=n, ms=ms, gaps=int(c)) for n, (ms, c) in ranked],
                kernels=[dict(name=n, ms=ms, launches=int(c)) for n, (ms, c) in busiest],
                side_ms=side, side_exposed_ms=side_exposed)


class StepProfile:
    """``torch.profiler`` over one step: :meth:`start` before the gate, :meth:`stop` after the
    step's end event completed. ``trace_path``: where the chrome trace is kept (None: a
    temporary file, removed)."""

    def __init__(self, gate_us: float, trace_path: str | None = None):
        self.gate_us = gate_us
        self.trace_path = trace_path
        self._prof = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CUDA])
        self._prof.__enter__()

    def stop(self) -> dict:
        import torch

        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        path = self.trace_path
        if path is None:
            fd, path = tempfile.mkstemp(suffix=".json")
            os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        finally:
            if self.trace_path is None:
                os.unlink(path)
        return split_timeline(gpu_events(trace), self.gate_us)
