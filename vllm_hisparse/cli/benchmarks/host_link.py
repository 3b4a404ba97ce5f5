"""The host link of this machine start, measured once before ``bench throughput``'s cases.

Two H100 starts of the same code, card, driver and misses differed by 8.3 % in hybrid tokens/s
(docs/benchmarks.md, "The fused stand-ins"): the same miss gathers took 35 % longer on one
host. A hybrid figure carries its host's link with it, so every run records the link beside
its results:

* ``dma_h2d_gbps`` / ``dma_d2h_gbps``: a 256 MiB copy between pinned host memory and the GPU
  on the copy engines (the contiguous ceiling);
* ``gather_gbps[row_bytes]``: 16,384 rows of ``row_bytes`` drawn at random from a 2 GiB
  pinned span, read by the connector's own gather kernel at the leader's grid (one CTA per SM,
  ``hot_state.DEFAULT_LEADER_CTAS_PER_SM``): the access pattern of an exposed miss gather;
  ``default_grid_gather_gbps[row_bytes]`` the same at the kernel's default grid (a slower
  link slows both; a grid that suits one host and not another shows here).

Each figure is the median of ``REPEATS`` timed launches after one untimed. Without CUDA, or
without the extension's kernels, there is nothing to measure (``{}``). The probe describes the
host, not the step: two H100 starts whose probes read 656 B rows at 31.9 and 39.2 GB/s exposed
the same gather in the step (docs/benchmarks.md, "Starts h and i"), whose gathers repeat every
step over each layer's own slab; the step's exposed gather is hybrid minus oracle.
"""

from __future__ import annotations

import statistics

import torch

#: Bytes of each DMA copy, of the pinned span the rows are drawn from, and rows per gather.
DMA_BYTES = 256 << 20
SPAN_BYTES = 2 << 30
GATHER_ROWS = 16384
REPEATS = 9


def _median_ms(fn) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _gather_gbps(row_bytes: int, grids: tuple[int, ...], device: torch.device,
                 g: torch.Generator) -> list[float]:
    """GB/s of one gather of :data:`GATHER_ROWS` random rows of ``row_bytes`` at each of
    ``grids`` (CTAs per SM; 0 = the kernel's default), from one pinned span."""
    from vllm_hisparse.ops import cuda as cuda_ops

    host = torch.empty((SPAN_BYTES // row_bytes, row_bytes), dtype=torch.uint8).pin_memory()
    host.view(-1)[:: 1 << 16].fill_(7)  # every 64 KiB touched: the pages are backed
    dev = torch.empty((GATHER_ROWS, row_bytes), dtype=torch.uint8, device=device)
    k = 2048
    tiles = GATHER_ROWS // k
    src = torch.randint(0, host.shape[0], (tiles, k), dtype=torch.int32, generator=g)
    dst = torch.randperm(GATHER_ROWS, generator=g).reshape(tiles, k).to(torch.int32)
    src, dst = src.to(device), dst.to(device)
    count = torch.full((tiles,), k, dtype=torch.int32, device=device)
    out = []
    for ctas_per_sm in grids:
        ms = _median_ms(lambda: cuda_ops.gather_rows_tuned([host], [dev], src, dst, count,
                                                           ctas_per_sm=ctas_per_sm))
        out.append(GATHER_ROWS * row_bytes / (ms * 1e-3) / 1e9)
    return out


def _dma_gbps(device: torch.device) -> tuple[float, float]:
    """H2D and D2H GB/s of one :data:`DMA_BYTES` copy on the copy engines."""
    host = torch.empty(DMA_BYTES, dtype=torch.uint8).pin_memory()
    dev = torch.empty(DMA_BYTES, dtype=torch.uint8, device=device)
    host.fill_(3)
    h2d = _median_ms(lambda: dev.copy_(host, non_blocking=True))
    d2h = _median_ms(lambda: host.copy_(dev, non_blocking=True))
    return DMA_BYTES / (h2d * 1e-3) / 1e9, DMA_BYTES / (d2h * 1e-3) / 1e9


def measure(row_bytes: list[int], device: torch.device) -> dict:
    """The link figures of the module docstring for each of ``row_bytes`` (``{}`` without
    CUDA or the extension)."""
    from vllm_hisparse.ops import cuda as cuda_ops
    from vllm_hisparse.worker.hot_state import DEFAULT_LEADER_CTAS_PER_SM

    if device.type != "cuda" or not cuda_ops.available():
        return {}
    h2d_gbps, d2h_gbps = _dma_gbps(device)
    g = torch.Generator().manual_seed(0)
    leader, default = {}, {}
    for rb in sorted(set(row_bytes)):
        leader[str(rb)], default[str(rb)] = _gather_gbps(rb, (DEFAULT_LEADER_CTAS_PER_SM, 0),
                                                         device, g)
    return dict(dma_h2d_gbps=h2d_gbps, dma_d2h_gbps=d2h_gbps, gather_gbps=leader,
                default_grid_gather_gbps=default, gather_rows=GATHER_ROWS,
                span_bytes=SPAN_BYTES, ctas_per_sm=DEFAULT_LEADER_CTAS_PER_SM)


def describe(link: dict) -> str:
    """One line for the run's output (empty when nothing was measured)."""
    if not link:
        return ""
    default = link.get("default_grid_gather_gbps", {})
    rows = ", ".join(f"{rb} B {gbps:.1f}"
                     + (f" (default grid {default[rb]:.1f})" if rb in default else "")
                     for rb, gbps in link["gather_gbps"].items())
    return (f"host link of this start: DMA H2D {link['dma_h2d_gbps']:.1f} / D2H "
            f"{link['dma_d2h_gbps']:.1f} GB/s; {link['gather_rows']} random rows from "
            f"{link['span_bytes'] >> 30} GiB pinned, {link['ctas_per_sm']} CTA per SM: {rows} "
            f"GB/s")
