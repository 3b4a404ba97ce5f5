"""Translation reach (``bench kernels --only reach``): how fast one layer's miss gather reads
pinned host memory, against the span of host memory its rows lie in (issue [16]).

Two parts, from one registered host buffer:

* **uniform**: 16K (and 128K) uniformly random rows drawn from the first S bytes of the buffer,
  S = 256 MiB ... 8 GiB: the knee of the span;
* **pool**: one layer's gather of a decode batch's misses laid out as the host pool holds them.
  Each of ``num_requests`` requests owns ``context_rows`` consecutive host rows (its host blocks,
  handed out lowest first), each request's ``misses_per_request`` positions are random within its
  context and the plan is request-major, one token row per request (what resolve emits for a
  one-token decode). Timed for the layer-major carving (layer ``l`` = one slab of
  ``num_requests * context_rows * row_bytes``) and the position-major one (rows of all layers of
  a position adjacent: the layer's rows ``num_layers * row_bytes`` apart), for a shuffled item
  order as a control, for the default grid and fewer rows in flight (CTAs per SM, a grid cap),
  warm (the same gather repeated) and cold (between two timed gathers, one gather from every
  other layer the buffer holds, as a decode step does).

The hypothesis the grid sweep tests: the knee is about the span of the rows *in flight* at a
time (the grid strides over the items in order, so a narrower grid over request-major items
keeps fewer requests' rows in flight), not the span of the whole gather.

The planning (:func:`carve`, :func:`miss_rows`, :func:`hot_rows`, :func:`item_order`,
:func:`span_bytes`, :func:`rows_in_flight`, :func:`inflight_span_bytes`, :func:`pool_cases`) is
numpy only and is tested on CPU; :func:`bench_reach` needs the GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from vllm_hisparse.cli.benchmarks.gpu_timing import DEV, RESULTS, log, time_events
from vllm_hisparse.cli.benchmarks.host_reads import gather_gbps, registered_random_buffer
from vllm_hisparse.ops import probe
from vllm_hisparse.ops.tuning import KernelTuning

#: Threads per copy CTA / warps per CTA of ``csrc/copy_rows.cu`` (kCopyThreads / kCopyWarps).
COPY_WARPS_PER_CTA = 8
#: The copy kernel's default grid cap per SM (``launch_copy_rows``).
DEFAULT_CTAS_PER_SM = 4
#: Span points of the uniform sweep, MiB.
UNIFORM_SPANS_MIB = (256, 512, 1024, 1760, 2048, 4096, 8192)
#: Bytes of host memory the bench leaves to everything else when it sizes its buffer.
HOST_RESERVE_BYTES = 16 << 30
#: Buffer cap: quick mode (registration time counts against the ~60 s) and the full run.
QUICK_HOST_BYTES = 24 << 30
FULL_HOST_BYTES = 112 << 30
#: Hot slots per request (D) the misses land in.
HOT_SLOTS = 4096
#: Width of one token row of the miss plan (K).
PLAN_K = 2048
LAYOUTS = ("layer", "position")
ORDERS = ("request", "shuffled")


@dataclasses.dataclass(frozen=True)
class ReachGeometry:
    """One decode batch's misses of one layer: ``num_requests`` requests of ``context_rows``
    positions, ``misses_per_request`` misses each, ``row_bytes`` per row, ``num_layers`` sparse
    layers in the pool."""

    name: str
    row_bytes: int
    num_layers: int
    num_requests: int = 80
    context_rows: int = 32768
    misses_per_request: int = 205

    @property
    def host_rows(self) -> int:
        """Host rows per layer in use: every request's context."""
        return self.num_requests * self.context_rows

    @property
    def slab_bytes(self) -> int:
        """Bytes of one layer's rows (a layer-major slab)."""
        return self.host_rows * self.row_bytes


#: DeepSeek-V3.2 (fp8_ds_mla rows, 61 layers) and GLM-5.1 (bf16 rows, 78 layers) at 32K, 80
#: requests with 10 % of K = 2048 missing.
GEOMETRIES = (ReachGeometry("DeepSeek-V3.2", 656, 61), ReachGeometry("GLM-5.1", 1152, 78))


@dataclasses.dataclass(frozen=True)
class GridSetting:
    """A copy launch: ``ctas_per_sm`` (0 = the kernel's 4) and ``max_ctas`` (0 = no cap)."""

    name: str
    ctas_per_sm: int = 0
    max_ctas: int = 0


GRIDS = (GridSetting("default"), GridSetting("2 CTAs/SM", ctas_per_sm=2),
         GridSetting("1 CTA/SM", ctas_per_sm=1), GridSetting("66 CTAs", max_ctas=66),
         GridSetting("33 CTAs", max_ctas=33))


@dataclasses.dataclass(frozen=True)
class PoolCarving:
    """How one buffer holds ``num_layers`` layers of ``host_rows`` rows of ``row_bytes``.

    ``layout="layer"``: row ``h`` of layer ``l`` at byte ``(l * host_rows + h) * row_bytes``;
    ``layout="position"``: at ``(h * num_layers + l) * row_bytes`` (HostPool's two layouts).
    """

    layout: str
    num_layers: int
    host_rows: int
    row_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.host_rows * self.row_bytes

    def byte_offsets(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """int64 byte offset in the buffer of host rows ``rows`` of ``layer``."""
        rows = np.asarray(rows, dtype=np.int64)
        if self.layout == "layer":
            return (layer * self.host_rows + rows) * self.row_bytes
        return (rows * self.num_layers + layer) * self.row_bytes


def carve(geometry: ReachGeometry, layout: str, buffer_bytes: int) -> PoolCarving:
    """The carving of ``geometry`` in ``layout`` into a buffer of ``buffer_bytes``: all its
    layers when they fit, else as many as fit (the position-major stride then shrinks with
    them; the carving says how many). Raises ValueError below two layers (a cold gather needs
    another layer)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    num_layers = min(geometry.num_layers, buffer_bytes // geometry.slab_bytes)
    if num_layers < 2:
        raise ValueError(f"{geometry.name}: a {buffer_bytes / 2**30:.1f} GiB buffer holds "
                         f"fewer than 2 slabs of {geometry.slab_bytes / 2**30:.2f} GiB")
    return PoolCarving(layout, int(num_layers), geometry.host_rows, geometry.row_bytes)


def miss_rows(geometry: ReachGeometry, seed: int) -> np.ndarray:
    """int64 ``[num_requests, misses_per_request]``: host rows of each request's misses,
    request ``r`` owning rows ``[r * context_rows, (r + 1) * context_rows)``; positions distinct
    within a request, in random (first-reference) order."""
    rng = np.random.default_rng(seed)
    g = geometry
    out = np.empty((g.num_requests, g.misses_per_request), dtype=np.int64)
    for r in range(g.num_requests):
        pos = rng.choice(g.context_rows, size=g.misses_per_request, replace=False)
        out[r] = r * g.context_rows + pos
    return out


def hot_rows(geometry: ReachGeometry, seed: int, slots_per_request: int = HOT_SLOTS) -> np.ndarray:
    """int64 ``[num_requests, misses_per_request]``: the device rows the misses land in, distinct
    slots of request ``r``'s hot region ``[r * slots_per_request, (r + 1) * slots_per_request)``."""
    rng = np.random.default_rng(seed)
    g = geometry
    if g.misses_per_request > slots_per_request:
        raise ValueError(f"{g.misses_per_request} misses exceed {slots_per_request} hot slots")
    out = np.empty((g.num_requests, g.misses_per_request), dtype=np.int64)
    for r in range(g.num_requests):
        out[r] = r * slots_per_request + rng.choice(slots_per_request, g.misses_per_request,
                                                    replace=False)
    return out


def item_order(num_items: int, order: str, seed: int) -> np.ndarray:
    """int64 permutation that puts a gather's (src, dst) pairs, request-major as resolve emits
    them, into the order timed: ``"request"`` (unchanged) or ``"shuffled"`` (random: the
    control)."""
    if order == "request":
        return np.arange(num_items, dtype=np.int64)
    if order == "shuffled":
        return np.random.default_rng(seed).permutation(num_items).astype(np.int64)
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")


def span_bytes(carving: PoolCarving, layer: int, rows: np.ndarray) -> int:
    """Bytes from the first byte of the lowest row read to the last byte of the highest."""
    off = carving.byte_offsets(layer, rows)
    return int(off.max() - off.min()) + carving.row_bytes


def rows_in_flight(row_bytes: int, num_sms: int, outer_rows: int, inner_rows: int,
                   grid: GridSetting, rows_per_warp: int = 0) -> int:
    """Rows one copy launch has in flight at once, as ``launch_copy_rows`` sizes its grid:
    G rows per warp (default 4 up to 768 B rows, else 2), 8 warps per CTA, CTAs =
    min(items / (8 G), SMs x CTAs per SM, max_ctas) for a plan of ``[outer_rows, inner_rows]``
    (the grid is sized from the plan's shape, not its counts)."""
    g = rows_per_warp or (4 if row_bytes <= 768 else 2)
    groups = -(-outer_rows * inner_rows // g)
    ctas = -(-groups // COPY_WARPS_PER_CTA)
    ctas = min(ctas, num_sms * (grid.ctas_per_sm or DEFAULT_CTAS_PER_SM))
    if grid.max_ctas:
        ctas = min(ctas, grid.max_ctas)
    return max(1, ctas) * COPY_WARPS_PER_CTA * g


def inflight_span_bytes(carving: PoolCarving, layer: int, items: np.ndarray,
                        window_rows: int) -> int:
    """Mean span (bytes, as :func:`span_bytes`) of consecutive windows of ``window_rows`` items
    (the last, shorter window included): what the grid stride has in flight when every warp
    advances together."""
    items = np.asarray(items, dtype=np.int64)
    spans = [span_bytes(carving, layer, items[i:i + window_rows])
             for i in range(0, len(items), window_rows)]
    return int(round(sum(spans) / len(spans)))


def pool_cases(geometries=GEOMETRIES) -> list[dict]:
    """Every timed point of the pool part: geometry x layout x order x grid x warm/cold,
    shuffled orders only at the default grid (the control)."""
    cases = []
    for geometry in geometries:
        for layout in LAYOUTS:
            for order in ORDERS:
                for grid in GRIDS:
                    if order == "shuffled" and grid.name != "default":
                        continue
                    for warm in (True, False):
                        cases.append(dict(geometry=geometry, layout=layout, order=order,
                                          grid=grid, warm=warm))
    return cases


def host_buffer_bytes(quick: bool, mem_available_bytes: int | None) -> int:
    """The registered buffer's size: the largest position-major pool of :data:`GEOMETRIES`,
    capped by the mode (:data:`QUICK_HOST_BYTES` / :data:`FULL_HOST_BYTES`) and by the host's
    available memory less :data:`HOST_RESERVE_BYTES`; at least the uniform sweep's 8 GiB."""
    need = max(g.num_layers * g.slab_bytes for g in GEOMETRIES)
    cap = QUICK_HOST_BYTES if quick else FULL_HOST_BYTES
    if mem_available_bytes is not None:
        cap = min(cap, mem_available_bytes - HOST_RESERVE_BYTES)
    size = min(need, cap)
    size -= size % (2 << 20)
    return max(size, UNIFORM_SPANS_MIB[-1] << 20)


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes (None when it cannot be read)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def best_setting(rows: list[dict], geometry: str) -> dict:
    """The fastest cold point of ``geometry`` (cold is what a decode step sees)."""
    cold = [r for r in rows if r["geometry"] == geometry and not r["warm"]]
    return max(cold, key=lambda r: r["gbps"])


# --------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------


def carve_views(buf, carving: PoolCarving) -> list:
    """``carving.num_layers`` uint8 views ``[host_rows, row_bytes]`` of ``buf`` (row-strided
    for position-major), indexed by host row."""
    h, rb, n = carving.host_rows, carving.row_bytes, carving.num_layers
    if carving.layout == "layer":
        return [buf[l * h * rb:(l + 1) * h * rb].view(h, rb) for l in range(n)]
    rows = buf[:carving.total_bytes].view(h, n, rb)
    return [rows[:, l, :] for l in range(n)]


def device_plan(geometry: ReachGeometry, src: np.ndarray, dst: np.ndarray, order: np.ndarray):
    """``(miss_src, miss_dst, miss_count)`` on the GPU: ``[num_requests, PLAN_K]`` int32 with
    each token row's first ``misses_per_request`` entries taken from the pairs ``src``/``dst``
    (request-major ``[R, M]``) put in ``order``."""
    g = geometry
    shape = (g.num_requests, PLAN_K)
    s = np.zeros(shape, dtype=np.int32)
    d = np.zeros(shape, dtype=np.int32)
    s[:, :g.misses_per_request] = src.reshape(-1)[order].reshape(src.shape)
    d[:, :g.misses_per_request] = dst.reshape(-1)[order].reshape(dst.shape)
    count = torch.full((g.num_requests,), g.misses_per_request, dtype=torch.int32, device=DEV)
    return torch.from_numpy(s).to(DEV), torch.from_numpy(d).to(DEV), count


def bench_uniform(buf, quick: bool) -> list[dict]:
    """16K (and 128K) uniformly random rows from the first S bytes of ``buf``."""
    out = []
    sizes = (16_384,) if quick else (16_384, 131_072)
    for row_bytes in (656, 1152):
        rows_total = (UNIFORM_SPANS_MIB[-1] << 20) // row_bytes
        src = buf[:rows_total * row_bytes].view(rows_total, row_bytes)
        for n in sizes:
            dst = torch.empty((n, row_bytes), dtype=torch.uint8, device=DEV)
            line = []
            for span_mib in UNIFORM_SPANS_MIB:
                span = min(rows_total, (span_mib << 20) // row_bytes)
                gb, us = gather_gbps([src], [dst], n, row_bytes, 5 if quick else 10,
                                     span_rows=span)
                out.append(dict(row_bytes=row_bytes, rows=n, span_mib=span_mib, gbps=gb, us=us))
                line.append(f"{span_mib} MiB {gb:.1f}")
            log(f"uniform, {row_bytes:>4} B rows, {n:>7} rows: " + ", ".join(line))
            del dst
    return out


def bench_pool_geometry(buf, geometry: ReachGeometry, quick: bool, sms: int) -> list[dict]:
    """Every :func:`pool_cases` point of ``geometry``; checks one gather per layout exactly."""
    reps = 5 if quick else 15
    g = geometry
    n_items = g.num_requests * g.misses_per_request
    nbytes = n_items * g.row_bytes
    dst_layer = torch.empty((g.num_requests * HOT_SLOTS, g.row_bytes), dtype=torch.uint8,
                            device=DEV)
    timed_layer = 0
    rows = []
    cases = pool_cases((g,))
    for layout in LAYOUTS:
        carving = carve(g, layout, buf.numel())
        views = carve_views(buf, carving)
        src = [miss_rows(g, seed=7919 * l + g.row_bytes) for l in range(carving.num_layers)]
        dst = [hot_rows(g, seed=104_729 * l + g.row_bytes) for l in range(carving.num_layers)]
        for order in ORDERS:
            perm = item_order(n_items, order, seed=g.row_bytes)
            plans = [device_plan(g, src[l], dst[l], perm) for l in range(carving.num_layers)]
            items = src[timed_layer].reshape(-1)[perm]
            check_gather(views[timed_layer], dst_layer, plans[timed_layer])
            for case in (c for c in cases if c["layout"] == layout and c["order"] == order):
                grid = case["grid"]
                tuning = KernelTuning(copy_ctas_per_sm=grid.ctas_per_sm)

                def gather(layer, grid=grid, tuning=tuning):
                    s, d, c = plans[layer]
                    probe.gather_rows([views[layer]], [dst_layer], s, d, c, tuning=tuning,
                                      max_ctas=grid.max_ctas)

                def others(i):
                    for layer in range(carving.num_layers):
                        if layer != timed_layer:
                            gather(layer)

                gather(timed_layer)
                us = time_events(lambda i: gather(timed_layer), reps,
                                 before=None if case["warm"] else others, flush=True)
                in_flight = rows_in_flight(g.row_bytes, sms, g.num_requests, PLAN_K, grid)
                rows.append(dict(
                    geometry=g.name, row_bytes=g.row_bytes, requests=g.num_requests,
                    context_rows=g.context_rows, misses_per_request=g.misses_per_request,
                    layout=layout, layers=carving.num_layers, model_layers=g.num_layers,
                    order=order, grid=grid.name, ctas_per_sm=grid.ctas_per_sm,
                    max_ctas=grid.max_ctas, warm=case["warm"],
                    cache="warm" if case["warm"] else "cold",
                    span_bytes=span_bytes(carving, timed_layer, items),
                    inflight_rows=in_flight,
                    inflight_span_bytes=inflight_span_bytes(carving, timed_layer, items,
                                                            in_flight),
                    us=us, gbps=nbytes / (us * 1e-6) / 1e9))
            del plans
        del views
    del dst_layer
    torch.cuda.empty_cache()
    return rows


def check_gather(view, dst_layer, plan) -> None:
    """One gather of ``plan`` from ``view`` into ``dst_layer``, compared byte for byte with
    the host rows (a wrong carving or plan fails here, not as a fast number)."""

    s, d, c = plan
    dst_layer.zero_()
    probe.gather_rows([view], [dst_layer], s, d, c)
    torch.cuda.synchronize()
    probe.check_errors()
    m = int(c[0])
    src_rows = s[:, :m].reshape(-1).cpu().long()
    dst_rows = d[:, :m].reshape(-1).long()
    if not torch.equal(dst_layer[dst_rows].cpu(), view[src_rows]):
        raise AssertionError("reach: the gathered rows differ from the host rows")


def log_pool(rows: list[dict]) -> None:
    log(f"{'geometry':<14} {'layout':<9} {'layers':>6} {'order':<9} {'grid':<10} "
        f"{'span GiB':>8} {'in flight':>9} {'fl. MiB':>8} {'warm':>6} {'cold':>6}  GB/s")
    for r in rows:
        if not r["warm"]:
            continue
        cold = next(x for x in rows if not x["warm"] and all(
            x[k] == r[k] for k in ("geometry", "layout", "order", "grid")))
        log(f"{r['geometry']:<14} {r['layout']:<9} {r['layers']:>6} {r['order']:<9} "
            f"{r['grid']:<10} {r['span_bytes'] / 2**30:8.2f} {r['inflight_rows']:>9} "
            f"{r['inflight_span_bytes'] / 2**20:8.0f} {r['gbps']:6.1f} {cold['gbps']:6.1f}")


def bench_reach(quick: bool) -> None:
    """The uniform sweep and the pool part (module docstring) from one registered buffer."""

    log("\n== translation reach: one layer's gather against the host span its rows lie in ==")
    size = host_buffer_bytes(quick, mem_available_bytes())
    a, buf = registered_random_buffer(size)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    res = dict(mode=a["mode"], buffer_bytes=size, uniform=[], pool=[], best={})
    try:
        res["uniform"] = bench_uniform(buf, quick)
        for geometry in GEOMETRIES:
            res["pool"] += bench_pool_geometry(buf, geometry, quick, sms)
        log(f"pool: {GEOMETRIES[0].num_requests} requests x 32K positions in consecutive host "
            f"rows, request-major misses; span = the layer's rows, in flight = rows per launch "
            f"wave and their mean span; cold = every other layer gathered in between")
        log_pool(res["pool"])
        for geometry in GEOMETRIES:
            best = best_setting(res["pool"], geometry.name)
            res["best"][geometry.name] = best
            log(f"best cold setting, {geometry.name}: {best['layout']}-major, {best['order']} "
                f"order, {best['grid']}: {best['gbps']:.1f} GB/s")
    finally:
        RESULTS["reach"] = res
        torch.cuda.synchronize()
        del buf
        probe.host_free_registered(a["ptr"], a["bytes"])
