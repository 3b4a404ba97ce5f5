"""Host-read benchmarks of the CUDA data plane (``bench kernels --only gather,copies,huge,layout``;
the reach section is :mod:`.reach`): scattered row gathers from pinned host memory against the
DMA and zero-copy ceilings of the same run, page copies and row mirrors, 4 KiB vs 2 MiB host
pages, and host pool layouts. The module docstring of :mod:`~vllm_hisparse.cli.benchmarks.kernels` lists what each section measures."""

from __future__ import annotations

import time

import torch

from vllm_hisparse.cli.benchmarks.gpu_timing import DEV, RESULTS, log, time_events
from vllm_hisparse.ops import probe, reference
from vllm_hisparse.ops.tuning import KernelTuning


def plan_for(n_rows, K, src_rows, dst_rows, g, contiguous=False):
    T = (n_rows + K - 1) // K
    if contiguous:
        src = torch.arange(T * K, dtype=torch.int32, device=DEV).reshape(T, K)
        dst = torch.arange(T * K, dtype=torch.int32, device=DEV).reshape(T, K)
    else:
        src = torch.randint(0, src_rows, (T, K), dtype=torch.int32, device=DEV, generator=g)
        dst = torch.randperm(dst_rows, device=DEV, generator=g)[:T * K].reshape(T, K).to(torch.int32)
    count = torch.full((T,), K, dtype=torch.int32, device=DEV)
    count[-1] = n_rows - (T - 1) * K
    return src, dst, count


def gather_gbps(src_layers, dst_layers, n_rows, row_bytes, reps, rpw=None, cps=None,
                contiguous=False, plans=4, span_rows=None):
    g = torch.Generator(device=DEV).manual_seed(n_rows + row_bytes)
    src_rows = src_layers[0].shape[0] if span_rows is None else span_rows
    dst_rows = dst_layers[0].shape[0]
    ps = [plan_for(n_rows, 2048, src_rows, dst_rows, g, contiguous) for _ in range(plans)]
    tuning = KernelTuning(copy_rows_per_warp=rpw or 0, copy_ctas_per_sm=cps or 0)

    def fn(i):
        s, d, c = ps[i % len(ps)]
        probe.gather_rows(src_layers, dst_layers, s, d, c, tuning=tuning)

    fn(0)
    us = time_events(fn, reps, flush=True)
    nbytes = n_rows * row_bytes * len(src_layers)
    return nbytes / (us * 1e-6) / 1e9, us


def dma_ceiling(nbytes=512 << 20):
    h = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    d = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    h.fill_(3)
    d.copy_(h, non_blocking=True)
    h2d = time_events(lambda i: d.copy_(h, non_blocking=True), 10, flush=False)
    d2h = time_events(lambda i: h.copy_(d, non_blocking=True), 10, flush=False)
    del h, d
    return nbytes / (h2d * 1e-6) / 1e9, nbytes / (d2h * 1e-6) / 1e9


def bench_gather(quick: bool):
    log("\n== gather_rows from pinned host (GB/s) ==")
    h2d, d2h = dma_ceiling()
    log(f"contiguous DMA ceiling: H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s")
    RESULTS["dma_ceiling"] = dict(h2d=h2d, d2h=d2h)
    host_bytes = 4 << 30
    out = {}
    for row_bytes in (656, 1152):
        src_rows = host_bytes // row_bytes
        host = torch.empty((src_rows, row_bytes), dtype=torch.uint8).pin_memory()
        host.view(-1)[:: 1 << 20].fill_(7)
        dev = torch.empty((300_000, row_bytes), dtype=torch.uint8, device=DEV)
        # contiguous zero-copy ceiling (sequential rows), best of a small sweep
        zc = max(gather_gbps([host], [dev], 131072, row_bytes, 10, rpw, 4, contiguous=True)[0]
                 for rpw in (2, 4, 8))
        log(f"{row_bytes} B: contiguous zero-copy ceiling {zc:.1f} GB/s")
        sweep = []
        for rpw in (1, 2, 4, 8):
            for cps in (2, 4, 8):
                gb, _ = gather_gbps([host], [dev], 16384, row_bytes, 15 if not quick else 6,
                                    rpw, cps)
                sweep.append(dict(rows_per_warp=rpw, ctas_per_sm=cps, gbps=gb))
        best = max(sweep, key=lambda r: r["gbps"])
        log(f"{row_bytes} B sweep at 16K rows: " + ", ".join(
            f"{r['rows_per_warp']}r/{r['ctas_per_sm']}c {r['gbps']:.1f}" for r in sweep))
        table = []
        for n in (2048, 8192, 16384, 131072):
            gb_def, us_def = gather_gbps([host], [dev], n, row_bytes, 20 if not quick else 8)
            gb_best, _ = gather_gbps([host], [dev], n, row_bytes, 20 if not quick else 8,
                                     best["rows_per_warp"], best["ctas_per_sm"])
            gb_one, _ = gather_gbps([host], [dev], n, row_bytes, 20 if not quick else 8, 1, 8)
            table.append(dict(rows=n, default_gbps=gb_def, default_us=us_def,
                              best_gbps=gb_best, one_row_per_warp_gbps=gb_one))
        # an index group of 4 layers in one launch, 2K rows each
        hosts4 = [host[i * (src_rows // 4):(i + 1) * (src_rows // 4)] for i in range(4)]
        devs4 = [dev[i * 70_000:(i + 1) * 70_000] for i in range(4)]
        gb4, us4 = gather_gbps(hosts4, devs4, 2048, row_bytes, 20 if not quick else 8)
        # torch reference on the GPU (index_select on pinned host + copy), one point
        g = torch.Generator(device=DEV).manual_seed(1)
        s, d, c = plan_for(16384, 2048, src_rows, dev.shape[0], g)
        t0 = time.perf_counter()
        reference.gather_rows([host], [dev], s, d, c)
        torch.cuda.synchronize()
        ref_us = (time.perf_counter() - t0) * 1e6
        ref_gb = 16384 * row_bytes / (ref_us * 1e-6) / 1e9
        spans = {}
        for span_mb in (16, 128, 1024, 4096):
            span_rows = min(src_rows, (span_mb << 20) // row_bytes)
            spans[span_mb] = gather_gbps([host], [dev], 16384, row_bytes, 10,
                                         span_rows=span_rows)[0]
        log(f"{row_bytes} B, 16K random rows within a span of the pinned pool: " + ", ".join(
            f"{k} MiB {v:.1f}" for k, v in spans.items()) + " GB/s")
        out[row_bytes] = dict(zero_copy_ceiling=zc, span_16k=spans, sweep=sweep, best=best, table=table,
                              four_layers_2k=dict(gbps=gb4, us=us4),
                              reference_16k=dict(gbps=ref_gb, us=ref_us))
        log(f"{row_bytes} B: {'rows':>7} {'default':>8} {'best':>8} {'1 row/warp':>10} (GB/s)")
        for r in table:
            log(f"{'':>8} {r['rows']:>7} {r['default_gbps']:8.1f} {r['best_gbps']:8.1f} "
                f"{r['one_row_per_warp_gbps']:10.1f}   ({r['default_us']:.1f} µs)")
        log(f"{row_bytes} B: 4 layers x 2K rows in one launch: {gb4:.1f} GB/s ({us4:.1f} µs); "
            f"torch reference 16K rows: {ref_gb:.2f} GB/s")
        del host, dev, hosts4, devs4
    RESULTS["gather"] = out


def bench_copies(quick: bool):
    log("\n== page copies and mirrors ==")
    bs, row_bytes, L = 64, 656, 4
    dev = [torch.empty((4096 * bs, row_bytes), dtype=torch.uint8, device=DEV) for _ in range(L)]
    host = [torch.empty((4096 * bs, row_bytes), dtype=torch.uint8).pin_memory() for _ in range(L)]
    res = {}
    for n in (16, 256):
        sb = torch.randperm(4096, device=DEV)[:n].to(torch.int32)
        db = torch.randperm(4096, device=DEV)[:n].to(torch.int32)
        nbytes = n * bs * row_bytes * L
        spill = time_events(lambda i: probe.copy_blocks(dev, host, sb, db, bs), 10)
        restore = time_events(lambda i: probe.copy_blocks(host, dev, db, sb, bs), 10)
        sbl, dbl = sb.tolist(), db.tolist()

        def dma(i, src=dev, dst=host, a=sbl, b=dbl):
            for l in range(L):
                for x, y in zip(a, b):
                    dst[l][y * bs:(y + 1) * bs].copy_(src[l][x * bs:(x + 1) * bs],
                                                      non_blocking=True)

        dma_spill = time_events(dma, 3)
        dma_restore = time_events(lambda i: dma(i, host, dev, dbl, sbl), 3)
        res[n] = dict(bytes=nbytes, kernel_spill_gbps=nbytes / spill / 1e3,
                      kernel_restore_gbps=nbytes / restore / 1e3,
                      dma_spill_gbps=nbytes / dma_spill / 1e3,
                      dma_restore_gbps=nbytes / dma_restore / 1e3)
        log(f"{n} pages x {L} layers ({nbytes / 1e6:.1f} MB): kernel spill "
            f"{res[n]['kernel_spill_gbps']:.1f} / restore {res[n]['kernel_restore_gbps']:.1f} "
            f"GB/s; one DMA per page: spill {res[n]['dma_spill_gbps']:.1f} / restore "
            f"{res[n]['dma_restore_gbps']:.1f} GB/s (GPU time only)")
    # mirrors: 256 new rows x 61 layers device -> host
    Lm = 61
    devm = [torch.empty((8192, row_bytes), dtype=torch.uint8, device=DEV) for _ in range(Lm)]
    hostm = [torch.empty((8192, row_bytes), dtype=torch.uint8).pin_memory() for _ in range(Lm)]
    sr = torch.randperm(8192, device=DEV)[:256].to(torch.int32)
    dr = torch.randperm(8192, device=DEV)[:256].to(torch.int32)
    us = time_events(lambda i: probe.mirror_rows(devm, hostm, sr, dr), 10)
    res["mirror_256x61"] = dict(us=us, gbps=256 * Lm * row_bytes / us / 1e3)
    log(f"mirror 256 rows x 61 layers: {us:.1f} µs ({res['mirror_256x61']['gbps']:.1f} GB/s)")
    RESULTS["copies"] = res


# --------------------------------------------------------------------------------------
# huge pages
# --------------------------------------------------------------------------------------


def anon_huge_kib(ptr: int) -> int | None:
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split()[0] if line.strip() else ""
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def bench_huge_pages(quick: bool):
    log("\n== 4 KiB vs 2 MiB host pages: 128K random 656 B rows over a 6 GiB buffer ==")
    import ctypes

    import numpy as np
    nbytes = 6 << 30
    row_bytes = 656
    rows = nbytes // row_bytes
    dev = torch.empty((300_000, row_bytes), dtype=torch.uint8, device=DEV)
    res = {}
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip()
    except OSError:
        thp = "unknown"
    try:
        nr = open("/proc/sys/vm/nr_hugepages").read().strip()
    except OSError:
        nr = "unknown"
    res["thp_setting"] = thp
    res["nr_hugepages"] = nr
    log(f"transparent_hugepage: {thp}; nr_hugepages: {nr}")
    for mode in ("4k", "thp", "hugetlb"):
        t0 = time.perf_counter()
        a = probe.host_alloc_registered(nbytes, mode)
        alloc_s = time.perf_counter() - t0
        if not a["ptr"]:
            res[mode] = dict(ok=False, message=a["message"])
            log(f"{mode}: not available ({a['message']})")
            continue
        huge_kib = anon_huge_kib(a["ptr"])
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * a["bytes"]).from_address(a["ptr"]))
        host = torch.from_numpy(arr)[: rows * row_bytes].view(rows, row_bytes)
        gbs = {}
        for n in (16384, 131072):
            gbs[n] = gather_gbps([host], [dev], n, row_bytes, 10 if not quick else 5)[0]
        spans = {}
        for span_mb in (16, 128, 1024):
            spans[span_mb] = gather_gbps([host], [dev], 16384, row_bytes, 8,
                                         span_rows=(span_mb << 20) // row_bytes)[0]
        res[mode] = dict(ok=True, alloc_register_s=alloc_s, anon_huge_kib=huge_kib,
                         huge_requested_ok=a["huge_requested_ok"],
                         gbps_16k=gbs[16384], gbps_128k=gbs[131072], span_16k=spans,
                         message=a["message"])
        log(f"{mode}: AnonHugePages {huge_kib} KiB, alloc+register {alloc_s:.1f} s; "
            f"16K rows {gbs[16384]:.1f} GB/s, 128K rows {gbs[131072]:.1f} GB/s; 16K rows within "
            + ", ".join(f"{k} MiB {v:.1f}" for k, v in spans.items()))
        del host, arr
        probe.host_free_registered(a["ptr"], a["bytes"])
    RESULTS["huge_pages"] = res


# --------------------------------------------------------------------------------------
# host pool layouts at scale
# --------------------------------------------------------------------------------------


def layout_views(buf: torch.Tensor, layout: str, L: int, H: int, row_bytes: int, bs: int):
    """L uint8 layer views of ``buf`` for H host rows per layer, and a function that maps host
    rows (positions) to the row ids the views are indexed with."""
    if layout == "layer":
        views = [buf[l * H * row_bytes:(l + 1) * H * row_bytes].view(H, row_bytes)
                 for l in range(L)]
        return views, lambda p: p
    if layout == "position":
        rows = buf[:H * L * row_bytes].view(H, L, row_bytes)
        return [rows[:, l, :] for l in range(L)], lambda p: p
    # page-major [host_block][layer][offset]: layer l of block b starts at (b * L + l) * bs rows
    # of a dense row view. Expressed with dense views that start l * bs rows in, indexed by
    # (p // bs) * L * bs + p % bs, so the kernel reads exactly the page-major addresses.
    flat = buf[:H * L * row_bytes].view(H * L, row_bytes)
    n = H * L - (L - 1) * bs
    views = [flat[l * bs:l * bs + n] for l in range(L)]
    return views, lambda p: (p // bs) * (L * bs) + p % bs


def registered_random_buffer(num_bytes: int):
    """``(allocation, uint8 tensor)``: ``num_bytes`` of registered host memory (transparent
    huge pages, else 4 KiB) filled with random bytes (never time on zeros); free it with
    ``probe.host_free_registered(a["ptr"], a["bytes"])`` once the tensor is gone."""
    import ctypes

    import numpy as np

    t0 = time.perf_counter()
    a = probe.host_alloc_registered(num_bytes, "thp")
    if not a["ptr"]:
        a = probe.host_alloc_registered(num_bytes, "4k")
    if not a["ptr"]:
        raise RuntimeError(f"could not register {num_bytes >> 30} GiB: {a['message']}")
    arr = np.ctypeslib.as_array((ctypes.c_uint8 * a["bytes"]).from_address(a["ptr"]))
    buf = torch.from_numpy(arr)
    chunk = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device=DEV)
    for off in range(0, num_bytes, 1 << 30):
        n = min(1 << 30, num_bytes - off)
        buf[off:off + n].copy_(chunk[:n], non_blocking=True)
    torch.cuda.synchronize()
    log(f"{num_bytes >> 30} GiB host buffer ({'thp' if a['huge_requested_ok'] else '4k'}) "
        f"allocated, registered and filled in {time.perf_counter() - t0:.1f} s")
    return a, buf


def layout_gather(views, dst, plans, count, pair_major: bool):
    """``fn(i, rpw=0, cps=0)``: one gather of plan ``i % len(plans)`` (``(src rows, dst rows)``)
    from ``views`` into ``dst``, with ``rpw`` rows per warp and ``cps`` CTAs per SM (0: the
    kernel's defaults): what the layout section and its rows-in-flight sweep time."""

    def fn(i, rpw=0, cps=0):
        s, d = plans[i % len(plans)]
        probe.gather_rows(views, dst, s, d, count, tuning=KernelTuning(
            copy_pair_major=pair_major, copy_rows_per_warp=rpw, copy_ctas_per_sm=cps))

    return fn


def bench_layout(quick: bool):
    log("\n== host pool layout: 128K random positions x all layers from one 24 GiB registered "
        "buffer (GB/s of payload) ==")
    bs = 64
    pool_bytes = 24 << 30
    a, buf = registered_random_buffer(pool_bytes)
    res = dict(mode=a["mode"], huge_requested_ok=a["huge_requested_ok"], runs=[], sweep=[])
    N = 131072
    K = 2048
    reps = 3 if quick else 5
    try:
        for L in (8, 61):
            for row_bytes in (656, 1152):
                H = pool_bytes // (L * row_bytes)
                H -= H % bs
                dst = [torch.empty((N, row_bytes), dtype=torch.uint8, device=DEV)
                       for _ in range(L)]
                g = torch.Generator(device=DEV).manual_seed(L * 10_000 + row_bytes)
                plans = []
                for _ in range(2):
                    pos = torch.randint(0, H, (N,), device=DEV, generator=g, dtype=torch.int64)
                    d = torch.randperm(N, device=DEV, generator=g).to(torch.int32)
                    plans.append((pos, d.view(N // K, K)))
                count = torch.full((N // K,), K, dtype=torch.int32, device=DEV)
                nbytes = N * L * row_bytes
                variants = [("layer", True), ("layer", False), ("position", True),
                            ("position", False), ("page", True)]
                for layout, pair_major in variants:
                    views, ids = layout_views(buf, layout, L, H, row_bytes, bs)
                    ps = [(ids(p).to(torch.int32).view(N // K, K), d) for p, d in plans]
                    fn = layout_gather(views, dst, ps, count, pair_major)
                    fn(0)
                    us = time_events(fn, reps, flush=False)
                    gb = nbytes / (us * 1e-6) / 1e9
                    row = dict(layers=L, row_bytes=row_bytes, layout=layout,
                               order="pair-major" if pair_major else "layer-major",
                               positions=N, us=us, gbps=gb,
                               mrows_per_s=N * L / us, mpos_per_s=N / us)
                    res["runs"].append(row)
                    log(f"L {L:>2}, {row_bytes:>4} B, {layout:>8}-major, {row['order']:>11} "
                        f"order: {gb:5.1f} GB/s, {row['mrows_per_s']:6.1f} M rows/s, "
                        f"{us / 1000:7.2f} ms")
                    if layout == "position" and row_bytes == 656 and L in (8, 61):
                        for rpw in (2, 4, 8, 16):
                            for cps in (1, 2, 4):
                                us2 = time_events(lambda i: fn(i, rpw=rpw, cps=cps),
                                                  2 if quick else 3, flush=False)
                                res["sweep"].append(dict(layers=L, row_bytes=row_bytes,
                                                         order=row["order"],
                                                         rows_per_warp=rpw, ctas_per_sm=cps,
                                                         gbps=nbytes / (us2 * 1e-6) / 1e9))
                        log(f"  position-major, {row['order']} order, sweep (rows/warp x "
                            f"CTAs/SM): " + ", ".join(
                                f"{r['rows_per_warp']}r/{r['ctas_per_sm']}c {r['gbps']:.1f}"
                                for r in res["sweep"]
                                if r["layers"] == L and r["order"] == row["order"]))
                del dst, plans
                torch.cuda.empty_cache()
    finally:
        RESULTS["layout"] = res
        del buf
        probe.host_free_registered(a["ptr"], a["bytes"])
