"""Probes of the CUDA kernels for benchmarks and tests (GPU only; not for serving).

The production ops (:mod:`vllm_hisparse.ops`, :func:`vllm_hisparse.ops.select`) check their
inputs and launch the production kernels. This module is the documented way in for code that
measures them (``vllm-hisparse bench kernels``, ``vllm-hisparse bench profile-resolve``,
``tests/ops/test_cuda_resolve.py``):

* :func:`resolve`: one launch, unchecked, with an explicit :class:`KernelTuning` and, on
  request, the probe kernels of ``vllm_hisparse._C`` (compile-time probes,
  ``csrc/resolve_probe.cuh``, built with ``-DHISPARSE_PROBE_KERNELS=ON``:
  :func:`has_probe_kernels`): ``times`` receives phase stamps, ``stop`` makes every CTA return
  at a stop point, ``general_only`` runs the general kernel for every request. Without
  ``times`` and ``stop`` it launches the production kernels (``general_only`` then picks the
  production general kernel), so timings of those options measure production code;
* :func:`launch_info`: the shared-memory plan a launch would use (host code: runs without a
  GPU wherever the extension is built);
* :func:`gather_rows`, :func:`copy_blocks`, :func:`mirror_rows`: the row copies, unchecked,
  with explicit tuning and grid cap;
* :func:`host_alloc_registered` / :func:`host_free_registered`: mmap'ed, registered host
  buffers with 4 KiB, transparent huge or ``MAP_HUGETLB`` pages (the host page experiment);
* :func:`spin`: a one-thread kernel that waits a number of µs of the GPU's global timer;
* :func:`check_errors`: synchronize and raise a recorded
  :class:`~vllm_hisparse.ops.errors.ResolveError`.

Inputs must satisfy the op contracts of :mod:`vllm_hisparse.ops.reference` (the probes do not
check them).
"""

from __future__ import annotations

import torch

from vllm_hisparse.ops import cuda
from vllm_hisparse.ops.cuda import available, check_errors
from vllm_hisparse.ops.tuning import DEFAULT_TUNING, KernelTuning

__all__ = [
    "NUM_STOPS",
    "NUM_TIMES",
    "available",
    "check_errors",
    "copy_blocks",
    "gather_rows",
    "host_alloc_registered",
    "host_free_registered",
    "launch_info",
    "mirror_rows",
    "resolve",
]

#: Stop points of both resolve kernels: 1 = at entry (the launch floor), then one after each
#: barrier (docs/kernels.md, "Probes").
NUM_STOPS = 5
#: Words of ``times``: %globaltimer (ns) at phase ends 0..6 of CTA 0, clock64 at phases 0 and
#: 6 in [7] and [8], and the number of requests the fast path handed over in [9].
NUM_TIMES = 10


def has_probe_kernels() -> bool:
    """Whether the extension holds resolve's phase-probe kernels (``times``, ``stop``; the
    CMake option ``HISPARSE_PROBE_KERNELS``, off in a plain install)."""
    return bool(getattr(cuda._module(), "has_probe_kernels", False))


def resolve(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru, block_size,
            out_rows, miss_src, miss_dst, miss_count, stats=None, slot_class=None, *,
            tuning: KernelTuning = DEFAULT_TUNING, times: torch.Tensor | None = None,
            stop: int = 0, general_only: bool = False) -> None:
    """One resolve launch (arguments of :func:`vllm_hisparse.ops.reference.resolve`).

    times: int64 tensor of >= ``NUM_TIMES`` elements on the device of ``topk`` (zeroed by the
        caller; [9] is incremented), or None.
    stop: 0 (run to the end) or 1..``NUM_STOPS``; outputs are incomplete with a stop.
    general_only: the general kernel for every request (the path the fast path hands to).
    """
    if times is not None and (times.dtype != torch.int64 or times.numel() < NUM_TIMES
                              or times.device != topk.device):
        raise ValueError(f"times must be an int64 tensor of >= {NUM_TIMES} elements on the "
                         f"device of topk")
    if isinstance(stop, bool) or not isinstance(stop, int) or not 0 <= stop <= NUM_STOPS:
        raise ValueError(f"stop must be in 0..{NUM_STOPS}, got {stop!r}")
    if not isinstance(general_only, bool):
        raise ValueError(f"general_only must be a bool, got {general_only!r}")
    if (times is not None or stop) and not has_probe_kernels():
        raise RuntimeError("probe.resolve: phase stamps and stop points need the probe "
                           "kernels; rebuild the extension with -DHISPARSE_PROBE_KERNELS=ON "
                           "(pip: SKBUILD_CMAKE_DEFINE=\"HISPARSE_PROBE_KERNELS=ON\"; "
                           "scripts/gpu_session.sh does)")
    probe = None
    if times is not None or stop or general_only:
        probe = {"times": 0 if times is None else times.data_ptr(), "stop": stop,
                 "general_only": general_only}
    cuda._launch_resolve(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru,
                         block_size, out_rows, miss_src, miss_dst, miss_count, stats, tuning,
                         probe, slot_class=slot_class)


def launch_info(num_tokens: int, k: int, num_slots: int, block_size: int, num_pages: int = 0,
                *, tuning: KernelTuning = DEFAULT_TUNING) -> dict:
    """The launch plan of :func:`resolve` (:func:`vllm_hisparse.ops.cuda.resolve_launch_info`)."""
    return cuda.resolve_launch_info(num_tokens, k, num_slots, block_size, num_pages,
                                    tuning=tuning)


def gather_rows(src_layers, dst_layers, miss_src, miss_dst, miss_count, *,
                tuning: KernelTuning = DEFAULT_TUNING, max_ctas: int = 0) -> None:
    """The miss-plan gather with ``tuning`` and a grid cap of ``max_ctas`` (0 = none)."""
    cuda.gather_rows_tuned(src_layers, dst_layers, miss_src, miss_dst, miss_count,
                           max_ctas=max_ctas, tuning=tuning)


def copy_blocks(src_layers, dst_layers, src_blocks, dst_blocks, block_size, *,
                tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """Page copies with ``tuning``."""
    cuda.copy_blocks(src_layers, dst_layers, src_blocks, dst_blocks, block_size, tuning=tuning)


def mirror_rows(src_layers, dst_layers, src_rows, dst_rows, *,
                tuning: KernelTuning = DEFAULT_TUNING) -> None:
    """Row-pair copies with ``tuning``."""
    cuda.mirror_rows(src_layers, dst_layers, src_rows, dst_rows, tuning=tuning)


_HOST_PAGE_MODES = {"4k": 0, "thp": 1, "hugetlb": 2}


def host_alloc_registered(num_bytes: int, mode: str) -> dict:
    """mmap ``num_bytes`` with 4 KiB pages (``"4k"``), transparent huge pages (``"thp"``) or
    ``MAP_HUGETLB`` (``"hugetlb"``), fault it in and ``cudaHostRegister`` it. Returns
    ``ptr``, ``bytes``, ``mode``, ``huge_requested_ok``, ``cuda_error`` and ``message``."""
    if mode not in _HOST_PAGE_MODES:
        raise ValueError(f"mode must be one of {sorted(_HOST_PAGE_MODES)}, got {mode!r}")
    return cuda._module().host_alloc_registered(int(num_bytes), _HOST_PAGE_MODES[mode])


def host_free_registered(ptr: int, num_bytes: int) -> int:
    """Unregister and unmap a buffer of :func:`host_alloc_registered`; returns the CUDA error."""
    return cuda._module().host_free_registered(int(ptr), int(num_bytes))


def spin(microseconds: float, *, ctas: int = 1, busy: bool = False) -> None:
    """Hold ``ctas`` SMs for ``microseconds`` of the GPU's global timer on the current stream
    (a stand-in for work of a known duration that does not stretch when the SM clock drops,
    as a cycle count does; capturable). ``busy`` polls without sleeping, which keeps the
    GPU's clocks up."""
    stream = torch.cuda.current_stream().cuda_stream
    cuda._module().spin(int(microseconds * 1000), int(ctas), bool(busy), int(stream))
