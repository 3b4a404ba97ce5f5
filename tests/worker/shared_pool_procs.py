"""Process bodies for the shared host pool tests (run with the ``spawn`` start method, so
they live in an importable module). Each reports through a queue; nothing is asserted here
except what the parent cannot see (the bytes a child read)."""

from __future__ import annotations

import os
import traceback

import torch

from vllm_hisparse.worker.host_pool import HostPool, SharedSegment
from vllm_hisparse.worker.synthetic import kv_rows
from vllm_hisparse.worker.transfer import TransferEngine

# Geometry of the two-rank data test: 3 layers of 48 B rows (position-major stride 144 B),
# block size 4, 8 device blocks, 10 host blocks.
L, BS, ROW_BYTES, DEVICE_BLOCKS, HOST_BLOCKS = 3, 4, 48, 8, 10
SPILL_DEVICE, SPILL_HOST = [3, 0, 5], [7, 2, 4]  # transfer 1: whole pages
MIRROR_DEVICE, MIRROR_HOST = [25, 26, 9], [36, 37, 3]  # transfer 2: single rows
RESTORE_DEVICE = [1, 6, 2]  # the reader restores host blocks SPILL_HOST into these
GATHER_DST = [28, 29, 30, 31, 12]  # the reader gathers host rows here (device block 7, row 12)


def truth(layer: int, device_rows) -> torch.Tensor:
    """The KV bytes of the writer's device rows (the same on every rank: replicated KV)."""
    return kv_rows(1, torch.as_tensor(device_rows), layer, ROW_BYTES)


def pattern(num_bytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=g)


def create_and_hold(spec: dict, geometry: tuple, seed: int, out, release, crash: bool = False):
    """Create a shared pool, fill it with ``pattern(seed)``, report, then either hold it until
    ``release`` is set and close it, or exit at once without closing (a crashed creator)."""
    try:
        pool = HostPool(*geometry, huge_pages="never", pin=False, shared=SharedSegment(**spec))
        pool.buffer.copy_(pattern(pool.total_bytes, seed))
        out.put(("ready", pool.segment_path, pool.page_mode, pool.physical_gib))
        if crash:
            out.close()
            out.join_thread()  # flush the report, then die without close() or finalizers
            os._exit(0)
        release.wait(120)
        pool.close()
        out.put(("closed", os.path.exists(pool.segment_path)))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def writer_rank(device: str, spec: dict, out, done):
    """TP rank 0: spill pages and mirror rows of its device KV into the shared pool."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # as a vLLM worker process does
        pool = HostPool(L, HOST_BLOCKS, BS, ROW_BYTES, huge_pages="auto", pin=dev.type == "cuda",
                        shared=SharedSegment(**spec))
        rows = torch.arange(DEVICE_BLOCKS * BS)
        layers = [truth(l, rows).to(dev) for l in range(L)]
        engine = TransferEngine(layers, pool.layers, BS)
        engine.spill(1, SPILL_DEVICE, SPILL_HOST)
        engine.mirror(2, MIRROR_DEVICE, MIRROR_HOST)
        report = engine.wait_all()
        out.put(("written", sorted(report.completed), report.bytes_to_host, pool.page_mode))
        done.wait(300)
        pool.close()
        out.put(("closed", os.path.exists(pool.segment_path)))
    except BaseException:
        out.put(("error", traceback.format_exc()))


def reader_rank(device: str, spec: dict, out, go):
    """TP rank 1: once the writer's copies are complete (``go``), run the same spill and
    mirror (acknowledged, not copied), then restore the spilled pages and gather the mirrored
    rows into its own device KV (what the scheduler allows once every rank acknowledged);
    report mismatches."""
    try:
        dev = torch.device(device)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        pool = HostPool(L, HOST_BLOCKS, BS, ROW_BYTES, huge_pages="auto", pin=dev.type == "cuda",
                        shared=SharedSegment(**spec))
        # This rank's device KV: zeros. If it wrote its spill, the host pages would be zeros.
        layers = [torch.zeros((DEVICE_BLOCKS * BS, ROW_BYTES), dtype=torch.uint8, device=dev)
                  for _ in range(L)]
        engine = TransferEngine(layers, pool.layers, BS, writes_host=False)
        if not go.wait(300):
            raise TimeoutError("the writer never finished")
        # The same commands as the writer's, run after its copies so a write would show.
        engine.spill(1, SPILL_DEVICE, SPILL_HOST)
        engine.mirror(2, MIRROR_DEVICE, MIRROR_HOST)
        acked = engine.wait_all()
        engine.restore(3, SPILL_HOST, RESTORE_DEVICE)
        engine.wait_all()
        ops = engine._ops
        src = torch.tensor([MIRROR_HOST + [SPILL_HOST[1] * BS + 2, SPILL_HOST[2] * BS + 3]],
                           dtype=torch.int32, device=dev)
        dst = torch.tensor([GATHER_DST], dtype=torch.int32, device=dev)
        ops.gather_rows(pool.layers, layers, src, dst, torch.tensor([5], dtype=torch.int32,
                                                                    device=dev))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        bad = []
        for l in range(L):
            got = layers[l].cpu()
            for dst_block, src_block in zip(RESTORE_DEVICE, SPILL_DEVICE):
                want = truth(l, torch.arange(src_block * BS, (src_block + 1) * BS))
                if not torch.equal(got[dst_block * BS:(dst_block + 1) * BS], want):
                    bad.append(f"layer {l}: restored block {dst_block} != writer block {src_block}")
            gathered_from = MIRROR_DEVICE + [SPILL_DEVICE[1] * BS + 2, SPILL_DEVICE[2] * BS + 3]
            if not torch.equal(got[GATHER_DST], truth(l, gathered_from)):
                bad.append(f"layer {l}: gathered rows differ")
        out.put(("read", sorted(acked.completed), acked.bytes_to_host,
                 engine.num_skipped_host_writes, pool.physical_gib, bad))
        pool.close()
    except BaseException:
        out.put(("error", traceback.format_exc()))


def race_create(shm_dir: str, name: str, go, out, release):
    """One of two creators of one segment name, started together: report whether this one
    published it, then hold it until ``release``."""
    from vllm_hisparse.worker import shm_segment

    try:
        go.wait(120)
        try:
            segment = shm_segment.create_segment(name, 4096, {}, huge_pages="never",
                                                 dirs=(shm_dir,))
        except shm_segment.SegmentError as exc:
            out.put(("refused", str(exc)))
            return
        out.put(("published", segment.inode))
        release.wait(120)
        segment.unlink()
        segment.mapping.close()
        segment.close_file()
    except BaseException:
        out.put(("error", traceback.format_exc()))
