"""GPU timing helpers shared by the kernel benchmarks (``bench kernels``,
``bench profile-resolve``): CUDA-event medians with the L2 flushed, clock warm-up, and
the run's results dictionary that ``--json`` writes."""

from __future__ import annotations

import statistics

import torch

DEV = torch.device("cuda")
#: Every section's numbers, written as JSON by ``bench kernels --json``.
RESULTS: dict = {}


def log(*a):
    print(*a, flush=True)


_flush_buf = None


def flush_l2():
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(128 << 20, dtype=torch.uint8, device=DEV)
    _flush_buf.fill_(1)  # 128 MiB > 60 MB of L2


def time_events(fn, reps: int, before=None, flush=True) -> float:
    """Median µs of fn() between two events; `before(i)` and an L2 flush run outside."""
    times = []
    for i in range(reps):
        if before is not None:
            before(i)
        if flush:
            flush_l2()
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn(i)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0)
    return statistics.median(times)


def spin_clocks(ms: float = 30.0) -> None:
    """Keep the GPU busy for about `ms` so that its clocks leave the idle state before a
    timing (the SM clock is read back in resolve_phase_stamps)."""
    torch.cuda._sleep(int(ms * 1e-3 * 1.98e9))
