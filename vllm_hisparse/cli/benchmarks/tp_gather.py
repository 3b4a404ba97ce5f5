"""Tensor-parallel ranks gathering from ONE shared pinned host pool, alone and all at once.

    vllm-hisparse bench tp-gather [--ranks 2] [--rows 2048 16384 131072] [--row-bytes 656]
                                  [--layers 1] [--pool-gib 4] [--seconds 0.5] [--json PATH]

Every rank is a process (spawned, as vLLM starts its workers) on its own GPU, rank r on
``cuda:r``. Rank 0 creates the host pool as a named shared segment (``HostPool(shared=...)``,
docs/worker.md "Tensor parallelism") and fills it; the other ranks map it read-only and
register their own mapping, as the TP ranks of one vLLM replica do. Each rank gathers
scattered rows (``ops.gather_rows``, the resolve miss path: a random plan of ``N`` rows per
launch, captured in a CUDA graph of several launches) from the pool into its own GPU memory:

1. each rank alone, the others idle;
2. all ranks at once, released together by a barrier.

It prints per-rank GB/s and the aggregate (every rank's bytes over the window from the first
start to the last end) next to the one-link figures of docs/benchmarks.md, "CUDA kernels".
PCIe links are per GPU, so the aggregate should approach ``ranks x`` one rank alone unless
the host side (DRAM, the root complex, address translation of the one pool) is the limit. Every rank's gathered rows
are compared with the pool's bytes (rank r > 0 reads what rank 0 wrote), and each rank's
host memory is measured (``HostPool.memory_usage``, ``VmRSS``/``RssShmem``): the pool is held
once however many ranks map it.

With one visible GPU every rank uses ``cuda:0`` (one link: no aggregate gain is expected,
and the output says so); without a GPU (or ``--device cpu``) the ranks gather with the
reference op on the CPU, which exercises the processes, the segment and the checks, but its
figures are memory copies, not PCIe.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
import uuid

from vllm_hisparse.cli.args import output_path, positive_float, positive_int
from vllm_hisparse.cli.memory import check_fits_in_memory

#: GB/s of the GPU zero-copy gather of scattered rows on the H200 machine (one GPU, PCIe Gen5
#: x16), by (row bytes, rows per launch): docs/benchmarks.md, "CUDA kernels".
DESIGN_GATHER_GBPS = {(656, 2048): 38.0, (656, 16384): 44.0, (1152, 2048): 47.0,
                      (1152, 16384): 50.0}
DESIGN_DMA_H2D_GBPS = 55.0  # contiguous pinned DMA, one link
BLOCK_SIZE = 64
ROWS_PER_TOKEN = 2048  # one plan row of the miss plan: a token's K selections
GRAPH_LAUNCHES = 8  # gathers per CUDA-graph replay (distinct random plans)
MIN_POOL_BYTES = 64 << 20
#: A rank waits at most this long for the others at a barrier (then fails and exits), and
#: the parent this long for each rank's report: nothing is left running after a hang.
BARRIER_TIMEOUT_S = 120.0
REPORT_TIMEOUT_S = 280.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-hisparse bench tp-gather",
                                description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=positive_int, default=2,
                   help="tensor-parallel ranks, rank r on cuda:r (default: %(default)s)")
    p.add_argument("--rows", type=positive_int, nargs="+", default=[2048, 16384, 131072],
                   metavar="N", help="scattered rows per gather launch (default: %(default)s)")
    p.add_argument("--row-bytes", type=positive_int, default=656, metavar="B",
                   help="bytes per row, a multiple of 16 (656 fp8_ds_mla, 1152 bf16; "
                   "default: %(default)s)")
    p.add_argument("--layers", type=positive_int, default=1,
                   help="layers gathered per launch at the same positions (an index group, "
                   "position-major pool; default: %(default)s)")
    p.add_argument("--pool-gib", type=positive_float, default=4.0, metavar="GIB",
                   help="shared host pool size; refused when this machine cannot allocate it, "
                   "else shrunk, with a note, to fit the segment directory's free space "
                   "(default: %(default)s)")
    p.add_argument("--seconds", type=positive_float, default=0.5, metavar="S",
                   help="time per rank and phase (default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when visible, else the CPU reference (default: %(default)s)")
    p.add_argument("--shm-dir", metavar="DIR", default=None,
                   help="directory of the shared segment (a tmpfs or hugetlbfs mount; "
                   "default: the host pool's, /dev/shm)")
    p.add_argument("--json", metavar="PATH", type=output_path, help="write every figure as JSON")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Errors argparse cannot see, naming the flag (ValueError: exit status 2)."""
    if args.row_bytes % 16:
        raise ValueError(f"--row-bytes={args.row_bytes} is invalid; accepted: a multiple of "
                         "16 (the gather's 16 B loads)")
    if args.ranks > 8:
        raise ValueError(f"--ranks={args.ranks} is invalid; accepted: 1 to 8")
    if args.shm_dir is not None and not os.path.isdir(args.shm_dir):
        raise ValueError(f"--shm-dir={args.shm_dir} is not a directory")
    # Refused against what this machine can allocate, like every command's host pool; only
    # a pool that fits is shrunk (with a note) to the segment directory's room.
    check_fits_in_memory("--pool-gib", args.pool_gib, what="the shared host pool")


def plan_devices(requested: str, ranks: int) -> tuple[list[str], str]:
    """Each rank's device and a note on what the figures mean."""
    import torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda" and visible == 0:
        raise ValueError("--device=cuda is invalid: no CUDA device is visible; accepted: cpu")
    if requested == "cpu" or visible == 0:
        return ["cpu"] * ranks, ("CPU reference gathers (no GPU in use): the figures are host "
                                 "memory copies, not PCIe")
    if visible < ranks:
        return ["cuda:0"] * ranks, (f"{visible} CUDA device(s) visible for {ranks} ranks: every "
                                    "rank on cuda:0, one link (no aggregate gain expected)")
    return [f"cuda:{r}" for r in range(ranks)], "one GPU, hence one PCIe link, per rank"


def pool_blocks(args: argparse.Namespace) -> tuple[int, str | None]:
    """Host blocks of the pool and, when it was shrunk to the directory's room, why."""
    block_bytes = args.layers * BLOCK_SIZE * args.row_bytes
    want = int(args.pool_gib * (1 << 30))
    note = None
    directory = args.shm_dir or "/dev/shm"
    try:
        st = os.statvfs(directory)
        room = int(st.f_bavail * st.f_frsize * 0.9) - (4 << 20)  # header, rounding
    except OSError:
        room = want
    if room < want:
        note = (f"pool shrunk from {want / (1 << 30):.2f} GiB to the "
                f"{room / (1 << 30):.2f} GiB {directory} has room for")
        want = room
    if want < MIN_POOL_BYTES:
        raise ValueError(f"--pool-gib: {directory} has room for {max(0, room) >> 20} MiB, less "
                         f"than {MIN_POOL_BYTES >> 20} MiB; enlarge it (docker: --shm-size) or "
                         "pass --shm-dir")
    return want // block_bytes, note


# ------------------------------------------------------------------------------ one rank


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


class _Gatherer:
    """One rank's plans, destination buffers and timed launches for one row count."""

    def __init__(self, torch, ops, pool, device, rows: int, seed: int):
        self.torch, self.ops, self.pool, self.device = torch, ops, pool, device
        self.rows = rows
        self.cuda = device.type == "cuda"
        tokens = -(-rows // ROWS_PER_TOKEN)
        g = torch.Generator().manual_seed(seed)
        host_rows = pool.rows_per_layer
        dst_rows = tokens * ROWS_PER_TOKEN
        self.dst = [torch.zeros((dst_rows, pool.row_bytes), dtype=torch.uint8, device=device)
                    for _ in range(pool.num_layers)]
        count = torch.full((tokens,), ROWS_PER_TOKEN, dtype=torch.int32)
        count[-1] = rows - (tokens - 1) * ROWS_PER_TOKEN
        self.plans = []
        for _ in range(GRAPH_LAUNCHES if self.cuda else 1):
            src = torch.randint(0, host_rows, (tokens, ROWS_PER_TOKEN), dtype=torch.int32,
                                generator=g)
            dst = torch.randperm(dst_rows, generator=g).to(torch.int32).reshape(tokens, -1)
            self.plans.append(tuple(t.to(device) for t in (src, dst, count)))
        self.bytes_per_launch = rows * pool.row_bytes * pool.num_layers
        self.graph = None
        if self.cuda:
            self.launch(0)  # module load, outside the capture
            torch.cuda.synchronize(device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                for i in range(len(self.plans)):
                    self.launch(i)

    def launch(self, i: int) -> None:
        src, dst, count = self.plans[i]
        self.ops.gather_rows(self.pool.layers, self.dst, src, dst, count)

    def run(self, reps: int) -> tuple[float, float, int]:
        """``reps`` rounds (a graph replay of every plan on CUDA); (start, end, bytes), the
        times on the system-wide monotonic clock, the work complete at ``end``."""
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize(self.device)
        start = time.monotonic()
        for _ in range(reps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.launch(0)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        end = time.monotonic()
        return start, end, reps * len(self.plans) * self.bytes_per_launch

    def exact(self) -> bool:
        """The last launch's destination rows hold the pool's bytes of its sources."""
        src, dst, count = (t.cpu() for t in self.plans[-1])
        self.launch(len(self.plans) - 1)
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
        valid = self.torch.arange(src.shape[1])[None, :] < count[:, None]
        s, d = src[valid].long(), dst[valid].long()
        return all(self.torch.equal(out.cpu()[d], host[s])
                   for out, host in zip(self.dst, self.pool.layers))


def _fill(torch, pool) -> None:
    """A pattern no row shares with another: int64 words counting up, in 256 MiB pieces."""
    words = pool.buffer.view(torch.int64)
    step = 32 << 20
    for lo in range(0, words.numel(), step):
        hi = min(words.numel(), lo + step)
        words[lo:hi] = torch.arange(lo, hi, dtype=torch.int64) * 0x9E3779B1


def rank_main(rank: int, cfg: dict, barrier, out) -> None:
    """Body of one rank's process (see the module docstring); reports through ``out``."""
    try:
        import torch

        from vllm_hisparse import ops
        from vllm_hisparse.worker.host_pool import HostPool, SharedSegment

        device = torch.device(cfg["devices"][rank])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = ops.select("cuda" if device.type == "cuda" else "reference")
        geometry = (cfg["layers"], cfg["blocks"], BLOCK_SIZE, cfg["row_bytes"])
        dirs = (cfg["shm_dir"],) if cfg["shm_dir"] else None
        pool = None
        if rank == 0:
            pool = HostPool(*geometry, shared=SharedSegment(
                cfg["name"], create=True, num_ranks=cfg["ranks"], dirs=dirs),
                pin=device.type == "cuda")
            _fill(torch, pool)
        barrier.wait(BARRIER_TIMEOUT_S)  # the segment is published and filled
        if rank > 0:
            pool = HostPool(*geometry, shared=SharedSegment(
                cfg["name"], create=False, num_ranks=cfg["ranks"], dirs=dirs, read_only=True,
                open_timeout_s=BARRIER_TIMEOUT_S), pin=device.type == "cuda")
        barrier.wait(BARRIER_TIMEOUT_S)
        report = {"rank": rank, "device": str(device), "page_mode": pool.page_mode,
                  "segment": pool.segment_path, "rows": [], "exact": True}
        for i, rows in enumerate(cfg["rows"]):
            gatherer = _Gatherer(torch, backend, pool, device, rows, seed=1000 * rank + i)
            start, end, _ = gatherer.run(2)  # warm, and the time of one round
            reps = max(2, math.ceil(cfg["seconds"] / max(1e-6, (end - start) / 2)))
            alone = None
            for turn in range(cfg["ranks"]):  # each rank alone, in rank order
                barrier.wait(BARRIER_TIMEOUT_S)
                if turn == rank:
                    alone = gatherer.run(reps)
                barrier.wait(BARRIER_TIMEOUT_S)
            barrier.wait(BARRIER_TIMEOUT_S)  # then everyone at once
            together = gatherer.run(reps)
            barrier.wait(BARRIER_TIMEOUT_S)
            report["exact"] &= gatherer.exact()
            report["rows"].append({"rows": rows, "alone": alone, "together": together})
            del gatherer
        report["memory"] = dict(pool.memory_usage(), vm_rss_bytes=_status_kib("VmRSS") << 10,
                                rss_shmem_bytes=_status_kib("RssShmem") << 10)
        barrier.wait(BARRIER_TIMEOUT_S)  # every rank measured while all map the pool
        out.put(("ok", rank, report))
        if rank > 0:
            pool.close()
        barrier.wait(BARRIER_TIMEOUT_S)  # readers first: the creator unlinks the name
        if rank == 0:
            pool.close()
    except BaseException:  # noqa: BLE001 - reported to the parent, the others released
        barrier.abort()
        out.put(("error", rank, traceback.format_exc()))


# ------------------------------------------------------------------------------ the parent


def summarize(reports: list[dict], cfg: dict) -> dict:
    """Per row count: each rank's GB/s alone and together, the aggregate, one link's figure."""
    table = []
    for i, rows in enumerate(cfg["rows"]):
        entries = [r["rows"][i] for r in reports]
        alone = [e["alone"][2] / (e["alone"][1] - e["alone"][0]) / 1e9 for e in entries]
        together = [e["together"][2] / (e["together"][1] - e["together"][0]) / 1e9
                    for e in entries]
        starts = [e["together"][0] for e in entries]
        ends = [e["together"][1] for e in entries]
        window = max(ends) - min(starts)
        aggregate = sum(e["together"][2] for e in entries) / window / 1e9
        overlap = max(0.0, min(ends) - max(starts)) / window
        table.append({"rows": rows, "alone_gbps": alone, "together_gbps": together,
                      "aggregate_gbps": aggregate, "aggregate_over_best_alone":
                      aggregate / max(alone), "overlap": overlap,
                      "design_one_link_gbps": DESIGN_GATHER_GBPS.get((cfg["row_bytes"], rows))})
    return {"table": table, "exact": all(r["exact"] for r in reports),
            "memory": [r["memory"] for r in reports]}


def _gbps(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"


def format_report(summary: dict, cfg: dict) -> str:
    gib = 1 << 30
    n = cfg["ranks"]
    head = " | ".join([f"rank {r} alone" for r in range(n)] + [f"rank {r} both" for r in range(n)])
    out = [f"| rows/launch | {head} | aggregate | aggregate / best alone | overlap | "
           f"one link |", "|---:" * (2 * n + 5) + "|"]
    for row in summary["table"]:
        cells = [_gbps(g) for g in row["alone_gbps"] + row["together_gbps"]]
        limit = row["design_one_link_gbps"]
        cells += [_gbps(row["aggregate_gbps"]), f"{row['aggregate_over_best_alone']:.2f}x",
                  f"{100 * row['overlap']:.0f} %", "-" if limit is None else f"{limit:.0f}"]
        out.append(f"| {row['rows']:,} | " + " | ".join(cells) + " |")
    out.append("GB/s; one link (docs/benchmarks.md, \"CUDA kernels\"): contiguous DMA H2D "
               f"{DESIGN_DMA_H2D_GBPS:.0f} GB/s; "
               f"expected aggregate with one link per rank: up to {n} x alone")
    mem = summary["memory"]
    pss = sum(m["pss_bytes"] for m in mem)
    out.append(
        f"host memory: pool {mem[0]['logical_bytes'] / gib:.2f} GiB per rank; segment pages "
        f"{mem[0]['segment_bytes'] / gib:.2f} GiB (held once); ranks' Pss "
        + " + ".join(f"{m['pss_bytes'] / gib:.2f}" for m in mem) + f" = {pss / gib:.2f} GiB; "
        "resident per rank " + " / ".join(f"{m['resident_bytes'] / gib:.2f}" for m in mem)
        + " GiB; RssShmem " + " / ".join(f"{m['rss_shmem_bytes'] / gib:.2f}" for m in mem)
        + " GiB")
    out.append("exact: every rank's gathered rows equal the pool's bytes" if summary["exact"]
               else "NOT EXACT: a rank's gathered rows differ from the pool's bytes")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    devices, meaning = plan_devices(args.device, args.ranks)
    blocks, shrunk = pool_blocks(args)
    cfg = dict(ranks=args.ranks, rows=args.rows, row_bytes=args.row_bytes, layers=args.layers,
               blocks=blocks, seconds=args.seconds, devices=devices, shm_dir=args.shm_dir,
               name=f"bench-{uuid.uuid4().hex[:16]}")
    pool_bytes = blocks * BLOCK_SIZE * args.layers * args.row_bytes
    print(f"tp-gather: {args.ranks} ranks on {', '.join(devices)} ({meaning}); "
          f"{args.row_bytes} B rows x {args.layers} layer(s), shared pool "
          f"{pool_bytes / (1 << 30):.2f} GiB" + (f" ({shrunk})" if shrunk else ""), flush=True)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, cfg, barrier, out), daemon=True)
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    reports: dict[int, dict] = {}
    errors = []
    try:
        while len(reports) + len(errors) < args.ranks:
            status, rank, body = out.get(timeout=REPORT_TIMEOUT_S)
            if status == "ok":
                reports[rank] = body
            else:
                errors.append(f"rank {rank}:\n{body}")
    except Exception as exc:  # noqa: BLE001 - queue timeout: name it, stop the ranks
        errors.append(f"no report from every rank within {REPORT_TIMEOUT_S:.0f} s ({exc!r})")
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.terminate()
    if errors:
        print("vllm-hisparse bench tp-gather: FAILED\n" + "\n".join(errors), file=sys.stderr)
        return 1
    ordered = [reports[r] for r in range(args.ranks)]
    summary = summarize(ordered, cfg)
    print(f"pages: {ordered[0]['page_mode']}, segment {ordered[0]['segment']}")
    print(format_report(summary, cfg))
    if args.json:
        import torch

        result = {"command": "bench tp-gather", "argv": sys.argv, "config": cfg,
                  "meaning": meaning, "pool_bytes": pool_bytes, "pool_note": shrunk,
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  "torch": torch.__version__,
                  "gpu": torch.cuda.get_device_name(0) if devices[0] != "cpu" else None,
                  "design": {"gather_gbps": {f"{b}B/{n}": v for (b, n), v in
                                             DESIGN_GATHER_GBPS.items()},
                             "dma_h2d_gbps": DESIGN_DMA_H2D_GBPS},
                  "ranks": ordered, **summary}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if summary["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
