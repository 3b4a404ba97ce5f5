"""P/D host landing: reading a prefill's pages into the position-major host pool (NIXL).

A prefill holds a request's KV as one region per layer, ``block_size`` rows of
``row_bytes`` per page (vLLM's layer-outermost registration). Our host pool is
position-major: the rows of all layers of one position are adjacent. Two ways in:

* ``direct``: register the host pool with NIXL and read every (layer, row) into place,
  one ``row_bytes`` descriptor each (pages cannot be contiguous on our side);
* ``staged``: read whole pages (one descriptor per layer and page) into a page-contiguous
  staging buffer of ``--staging-pages`` pages, then copy each staged page into the pool's
  rows with the package's page copy (``ops.copy_blocks``: its pure-torch reference twin
  on CPU, the CUDA kernel on a GPU). ``staged-read`` and ``staged-copy`` are its shares.

Two processes on 127.0.0.1, NIXL's UCX backend on CPU memory; median of ``--repeats``.

    vllm-hisparse bench pd-import --pages 64 --layers 8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time


def _prefill(conn, layers: int, pages: int, page_bytes: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("bench-prefill", nixl_agent_config(backends=["UCX"]))
    kv = torch.randint(0, 255, (layers, pages, page_bytes), dtype=torch.uint8,
                       generator=torch.Generator().manual_seed(0))
    agent.register_memory(agent.get_reg_descs([(kv.data_ptr(), kv.nbytes, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), kv.data_ptr()))
    conn.recv()


def _read(agent, name, local, remote) -> float:
    import numpy as np

    local_h = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
    remote_h = agent.prep_xfer_dlist(name, remote, "DRAM")
    index = np.arange(local.shape[0])
    start = time.perf_counter()
    handle = agent.make_prepped_xfer("READ", local_h, index, remote_h, index)
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    elapsed = time.perf_counter() - start
    if state != "DONE":
        raise RuntimeError(f"NIXL read ended {state}")
    agent.release_xfer_handle(handle)
    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-hisparse bench pd-import", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--row-bytes", type=int, default=656)
    parser.add_argument("--staging-pages", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)

    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from vllm_hisparse import ops

    L, P, bs, rb, S = args.layers, args.pages, args.block_size, args.row_bytes, args.staging_pages
    page = bs * rb
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill, args=(child, L, P, page), daemon=True)
    proc.start()
    meta, remote_base = parent.recv()
    agent = nixl_agent("bench-decode", nixl_agent_config(backends=["UCX"]))
    name = agent.add_remote_agent(meta)
    pool = torch.zeros((P * bs, L, rb), dtype=torch.uint8)  # position-major host pool
    staging = torch.zeros((L, S * bs, rb), dtype=torch.uint8)
    for t in (pool, staging):
        agent.register_memory(agent.get_reg_descs([(t.data_ptr(), t.nbytes, 0, "")], "DRAM"))
    expected = torch.randint(0, 255, (L, P, page), dtype=torch.uint8,
                             generator=torch.Generator().manual_seed(0))
    want = expected.view(L, P * bs, rb).permute(1, 0, 2)
    total = L * P * page

    # direct: one descriptor per (layer, row)
    layer, row = np.meshgrid(np.arange(L), np.arange(P * bs), indexing="ij")
    layer, row = layer.ravel(), row.ravel()
    local = np.stack([pool.data_ptr() + (row * L + layer) * rb, np.full_like(row, rb),
                      np.zeros_like(row)], 1)
    remote = np.stack([remote_base + (layer * P * bs + row) * rb, np.full_like(row, rb),
                       np.zeros_like(row)], 1)
    direct = []
    for _ in range(args.repeats):
        pool.zero_()
        direct.append(_read(agent, name, local, remote))
    assert torch.equal(pool, want), "direct read is not exact"

    # staged: page descriptors into the staging buffer, then the page copy into the pool
    host_layers = [pool.view(P * bs, L * rb)[:, l * rb:(l + 1) * rb] for l in range(L)]
    copy_ops = ops.select("auto")  # the reference twin on CPU
    staged_read, staged_copy, staged = [], [], []
    for _ in range(args.repeats):
        pool.zero_()
        read_s = copy_s = 0.0
        start = time.perf_counter()
        for first in range(0, P, S):
            n = min(S, P - first)
            lay, slot = np.meshgrid(np.arange(L), np.arange(n), indexing="ij")
            lay, slot = lay.ravel(), slot.ravel()
            loc = np.stack([staging.data_ptr() + (lay * S * bs + slot * bs) * rb,
                            np.full_like(slot, page), np.zeros_like(slot)], 1)
            rem = np.stack([remote_base + (lay * P + first + slot) * page, np.full_like(slot, page),
                            np.zeros_like(slot)], 1)
            read_s += _read(agent, name, loc, rem)
            copy_start = time.perf_counter()
            copy_ops.copy_blocks(list(staging), host_layers, torch.arange(n, dtype=torch.int32),
                                 torch.arange(first, first + n, dtype=torch.int32), bs)
            copy_s += time.perf_counter() - copy_start
        staged.append(time.perf_counter() - start)
        staged_read.append(read_s)
        staged_copy.append(copy_s)
    assert torch.equal(pool, want), "staged read is not exact"
    parent.send("stop")
    proc.join(10)

    rows = [("direct", L * P * bs, direct), ("staged", L * P, staged),
            ("staged-read", L * P, staged_read), ("staged-copy", 0, staged_copy)]
    print(f"{P} pages x {L} layers x {bs} rows x {rb} B = {total / 2**20:.1f} MiB; "
          f"staging {S} pages; median of {args.repeats}")
    print(f"{'path':<12}{'descriptors':>12}{'ms':>10}{'GB/s':>8}")
    results = []
    for label, descs, times in rows:
        ms = statistics.median(times) * 1e3
        gbs = total / (ms / 1e3) / 1e9
        print(f"{label:<12}{descs:>12}{ms:>10.1f}{gbs:>8.2f}")
        results.append(dict(path=label, descriptors=descs, ms=ms, gb_per_s=gbs,
                            runs_ms=[t * 1e3 for t in times]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), bytes=total, results=results), f, indent=1)
    return 0
