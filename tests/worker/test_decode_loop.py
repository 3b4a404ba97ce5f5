"""The worker pieces together, without vLLM: host pool + transfer engine + hot state driving
resolve and gather over many decode steps. Every row attention would read is checked against
the synthetic ground truth, layer by layer, right after that layer waited for its rows (the
order attention runs in). Runs on CPU with the reference ops (side-stream launches queued
until waited for, the latest a stream could run them) and, with ``-m gpu``, on CUDA with the
kernels, pinned memory, a copy stream, the gather side stream (held back by a sleep so that a
missing wait would read stale rows) and events; plus a CUDA-graph capture of a whole step."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from vllm_hisparse import ops
from vllm_hisparse.worker.host_pool import HostPool
from vllm_hisparse.worker.hot_state import GroupGather, HotState
from vllm_hisparse.worker.synthetic import TopkGenerator, describe_row, kv_rows
from vllm_hisparse.worker.transfer import TransferEngine


class DecodeLoop:
    """A tiny stand-in for scheduler + model: requests decode one (or several) tokens a step;
    pages are mirrored to the host, some are spilled and released, a hot region serves them."""

    def __init__(self, device: str, *, num_layers=3, row_bytes=32, block_size=16, k=48,
                 hot_slots=160, num_requests=4, device_blocks=160, seed=0,
                 tokens_per_step=1, ops_backend="auto", gather_mode="side", chunks=None,
                 side_delay_cycles=0, side_ctas_per_sm=1, leader_ctas_per_sm=0, shared=None,
                 writes_host=True):
        self.rng = random.Random(seed)
        self.device = torch.device(device)
        self.bs = block_size
        self.k = k
        self.num_layers = num_layers
        self.row_bytes = row_bytes
        self.tokens_per_step = tokens_per_step
        self.max_pages = 64
        self.device_kv = [torch.zeros((device_blocks * block_size, row_bytes), dtype=torch.uint8,
                                      device=self.device) for _ in range(num_layers)]
        # ``shared``: a tensor-parallel rank's mapping of one pool (test_decode_loop_tp.py);
        # ``writes_host=False`` on the ranks that only read it.
        self.host = HostPool(num_layers, num_requests * self.max_pages, block_size, row_bytes,
                             huge_pages="never", shared=shared)
        self.engine = TransferEngine(self.device_kv, self.host.layers, block_size,
                                     ops_backend=ops_backend, writes_host=writes_host)
        self.state = HotState(num_requests, self.max_pages, hot_slots, block_size, self.device,
                              ops_backend=ops_backend)
        self.gather = GroupGather(self.state, self.host.layers, self.device_kv, mode=gather_mode,
                                  chunks=chunks, side_ctas_per_sm=side_ctas_per_sm,
                                  leader_ctas_per_sm=leader_ctas_per_sm)
        self.side_delay_cycles = side_delay_cycles
        self.free_blocks = list(range(device_blocks))
        self.rng.shuffle(self.free_blocks)
        self.next_transfer = 0
        self.pending: dict[int, tuple] = {}
        self.requests = []
        for r in range(num_requests):
            context = self.rng.randint(2 * k, 5 * k)
            req = dict(row=r, context=0, pages={}, host={}, gen=TopkGenerator(k, seed * 100 + r,
                       recent=8, drift_tokens=3.0))
            self.requests.append(req)
            hot = [self.free_blocks.pop() for _ in range(hot_slots // block_size)]
            self.state.lease_hot_region(r, hot)
            self._append_tokens(req, context)
        self._drain()

    # -- model side: write new KV into the tail page and mirror it to the host
    def _append_tokens(self, req, n):
        rows, host_rows = [], []
        for _ in range(n):
            pos = req["context"]
            page = pos // self.bs
            if page not in req["pages"]:
                req["pages"][page] = self.free_blocks.pop()
                req["host"][page] = req["row"] * self.max_pages + page
                self.state.set_pages([req["row"]], [page], [req["pages"][page]])
                self.state.set_host_blocks([req["row"]], [page], [req["host"][page]])
            row = req["pages"][page] * self.bs + pos % self.bs
            for layer in range(self.num_layers):
                self.device_kv[layer][row] = kv_rows(req["row"], torch.tensor([pos]), layer,
                                                     self.row_bytes)[0].to(self.device)
            rows.append(row)
            host_rows.append(req["host"][page] * self.bs + pos % self.bs)
            req["context"] += 1
        self._transfer("mirror", rows, host_rows, None)

    def _transfer(self, kind, src, dst, on_complete):
        tid = self.next_transfer
        self.next_transfer += 1
        getattr(self.engine, kind)(tid, src, dst)
        self.pending[tid] = on_complete

    def _drain(self, block=True):
        report = self.engine.wait_all() if block else self.engine.poll()
        assert not report.failed
        for tid in report.completed:
            callback = self.pending.pop(tid)
            if callback:
                callback()

    # -- policy side: spill a sealed page and release its device block once the copy is done
    def _release_some_pages(self):
        for req in self.requests:
            sealed = [p for p in req["pages"] if (p + 2) * self.bs <= req["context"]]
            for page in self.rng.sample(sealed, min(len(sealed), self.rng.randint(0, 3))):
                block = req["pages"].pop(page)

                def release(req=req, page=page, block=block):
                    self.state.set_pages([req["row"]], [page], [-1])
                    self.free_blocks.append(block)
                # The page was mirrored row by row already; a spill re-copies it (as the
                # policy does for pages written before mirroring was on).
                self._transfer("spill", [block], [req["host"][page]], release)
        self.engine.fence()

    def step(self, *, follower_layers=True, wait=True):
        """One decode step. ``follower_layers=False``: only the leader layer reads (a step
        whose followers never ran; the next resolve must fence their gathers). ``wait=False``:
        read every layer without waiting for its rows (a broken caller; must fail)."""
        self._release_some_pages()
        self._drain(block=False)
        self.read(follower_layers=follower_layers, wait=wait)
        self.write()
        self._drain(block=False)

    def read(self, *, follower_layers=True, wait=True):
        """Resolve this step's selections, gather the misses, check each layer's rows."""
        token_rows, topk = [], []
        for req in self.requests:
            for _ in range(self.tokens_per_step):
                token_rows.append(req["row"])
                topk.append(req["gen"].select(req["context"]))
        topk_t = torch.stack(topk).to(self.device)
        rows_t = torch.tensor(token_rows, dtype=torch.int32, device=self.device)
        self.engine.fence()
        result = self.state.resolve(topk_t, rows_t)
        if self.side_delay_cycles and self.gather.side_launches:
            with torch.cuda.stream(self.gather.side_stream):
                torch.cuda._sleep(self.side_delay_cycles)
        self.gather.launch(result)
        topk_c, rows_c, out_c = topk_t.cpu(), rows_t.cpu(), result.out_rows.cpu()
        for layer in range(self.num_layers if follower_layers else 1):
            if wait:
                self.gather.wait(layer)
            self.check(topk_c, rows_c, out_c, layer)

    def write(self):
        """Every request's new tokens: KV into its tail page, mirrored to the host."""
        for req in self.requests:
            self._append_tokens(req, self.tokens_per_step)

    def check(self, topk, token_rows, out_rows, layer):
        kv = self.device_kv[layer].cpu()
        for t in range(topk.shape[0]):
            valid = topk[t] >= 0
            assert torch.equal(out_rows[t][~valid], torch.full_like(out_rows[t][~valid], -1))
            got = kv[out_rows[t][valid].to(torch.int64)]
            want = kv_rows(int(token_rows[t]), topk[t][valid], layer, self.row_bytes)
            if not torch.equal(got, want):
                bad = int(torch.nonzero((got != want).any(dim=1))[0])
                pytest.fail(f"token {t} layer {layer}: read {describe_row(got[bad])}, "
                            f"expected {describe_row(want[bad])}")

    def close(self):
        self.state.fence_side_work()  # a last step without followers left gathers running
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.engine.wait_all()
        self.host.close()


@pytest.mark.parametrize("tokens_per_step", [1, 3])
@pytest.mark.parametrize("gather_mode, chunks", [("side", None), ("single", None),
                                                 ("side", (1,)), ("side", (2, 99))])
def test_decode_loop_reads_exact_rows_on_cpu(tokens_per_step, gather_mode, chunks):
    loop = DecodeLoop("cpu", tokens_per_step=tokens_per_step, seed=tokens_per_step,
                      gather_mode=gather_mode, chunks=chunks)
    try:
        for _ in range(25):
            loop.step()
        resident, hits, misses = loop.state.counters()
        assert hits > 0 and misses > 0 and resident > 0  # every path was exercised
    finally:
        loop.close()


def test_side_launch_schedule_and_counts():
    loop = DecodeLoop("cpu", num_layers=8, gather_mode="side")
    try:
        assert loop.gather.chunks == (2, 2, 4) and loop.gather.side_launches == 2
        before = loop.gather.launches
        loop.step()
        assert loop.gather.launches - before == 3
    finally:
        loop.close()
    for mode, chunks, want in [("single", None, (8,)), ("side", (1,), (1,) * 8),
                               ("side", (1, 99), (1, 7)), ("side", (3, 2), (3, 2, 2, 1))]:
        loop = DecodeLoop("cpu", num_layers=8, gather_mode=mode, chunks=chunks)
        assert loop.gather.chunks == want, (mode, chunks)
        loop.close()


def test_side_launches_are_issued_at_the_first_follower_wait():
    """The host issues the followers' launches only when a follower first waits (after the
    leader's layer is queued), or when the work is joined or fenced; never later."""
    loop = DecodeLoop("cpu", num_layers=8, gather_mode="side", seed=3)
    try:
        loop.step()  # fill hot regions so the next plan has misses
        result = loop.state.resolve(*loop_inputs(loop))
        before = loop.gather.launches
        loop.gather.launch(result)
        assert loop.gather.side_pending and loop.gather.launches - before == 1
        loop.gather.wait(0)
        loop.gather.wait(1)  # the leader's launch holds layers 0 and 1: nothing to issue
        assert loop.gather.side_pending
        loop.gather.wait(2)  # first follower of a side launch: every side launch is issued
        assert not loop.gather.side_pending and loop.gather.launches - before == 2
        loop.gather.wait(7)
        assert loop.gather.launches - before == 3
        # A fence issues and runs pending side work too (a step whose followers never ran).
        result = loop.state.resolve(*loop_inputs(loop))
        loop.gather.launch(result)
        assert loop.gather.side_pending
        loop.state.fence_side_work()
        assert not loop.gather.side_pending and loop.state.side_work is None
    finally:
        loop.close()


def loop_inputs(loop):
    """The next step's (topk, token_rows) of a DecodeLoop, one token per request."""
    topk = torch.stack([req["gen"].select(req["context"]) for req in loop.requests])
    rows = torch.tensor([req["row"] for req in loop.requests], dtype=torch.int32)
    return topk.to(loop.device), rows.to(loop.device)


def test_followers_that_never_ran_are_fenced_by_the_next_resolve():
    """Steps whose follower layers do not read leave side launches queued; the next resolve
    must run them before it rewrites the miss plan, or hot slots filled in that step hold
    stale follower rows when a later step hits them."""
    loop = DecodeLoop("cpu", num_layers=4, seed=7)
    try:
        for i in range(25):
            loop.step(follower_layers=i % 3 == 2)
        assert loop.state.counters()[1] > 0
    finally:
        loop.close()


def test_missing_fence_or_missing_wait_reads_stale_rows(monkeypatch):
    """The checks above can fail: without the resolve-time fence, or without the followers'
    waits, the CPU side queue delivers rows too late and the loop reads wrong bytes."""
    loop = DecodeLoop("cpu", num_layers=4, seed=7)
    try:
        with pytest.raises(pytest.fail.Exception):
            for _ in range(10):
                loop.step(wait=False)
    finally:
        loop.close()
    monkeypatch.setattr(HotState, "fence_side_work", lambda self: None)
    loop = DecodeLoop("cpu", num_layers=4, seed=7)
    try:
        with pytest.raises(pytest.fail.Exception):
            for i in range(25):
                loop.step(follower_layers=i % 3 == 2)
    finally:
        loop.close()


def test_group_gather_rejects_bad_arguments():
    state = HotState(2, 4, 16, 16)
    layers = [torch.zeros((64, 16), dtype=torch.uint8)]
    with pytest.raises(ValueError, match="mode must be one of side, single"):
        GroupGather(state, layers, layers, mode="async")
    with pytest.raises(ValueError, match="positive ints"):
        GroupGather(state, layers, layers, chunks=(0,))
    with pytest.raises(ValueError, match="one host layer per device layer"):
        GroupGather(state, layers, layers * 2)
    with pytest.raises(ValueError, match="outside the index group of 1 layers"):
        GroupGather(state, layers, layers).wait(1)
    with pytest.raises(ValueError, match="side_max_ctas must be an int >= 0, got -1"):
        GroupGather(state, layers, layers, side_max_ctas=-1)
    with pytest.raises(ValueError, match="side_ctas_per_sm must be an int >= 0, got True"):
        GroupGather(state, layers, layers, side_ctas_per_sm=True)
    with pytest.raises(ValueError, match="leader_ctas_per_sm must be an int >= 0, got -2"):
        GroupGather(state, layers, layers, leader_ctas_per_sm=-2)


def test_leader_launch_runs_on_a_backend_that_differs_only_in_its_grid():
    state = HotState(2, 4, 16, 16, ops_backend=ops.select("reference", copy_rows_per_warp=2))
    layers = [torch.zeros((64, 16), dtype=torch.uint8)]
    assert GroupGather(state, layers, layers, leader_ctas_per_sm=0).leader_ops is state.ops
    leader = GroupGather(state, layers, layers, leader_ctas_per_sm=1).leader_ops
    assert leader.name == "reference" and leader is not state.ops
    assert leader.tuning == dataclasses.replace(state.ops.tuning, copy_ctas_per_sm=1)


@pytest.mark.gpu
@pytest.mark.parametrize("row_bytes, gather_mode, chunks, side_ctas, leader_ctas", [
    (656, "side", None, 1, 0), (1152, "side", None, 1, 0), (656, "single", None, 1, 0),
    (656, "side", (1,), 0, 0), (1152, "side", (2, 99), 2, 0), (656, "single", None, 1, 1),
    (1152, "side", (1,), 1, 2)])
def test_decode_loop_reads_exact_rows_on_gpu(row_bytes, gather_mode, chunks, side_ctas,
                                             leader_ctas):
    # The side stream sleeps ~1 ms before each step's gathers: a follower that read without
    # waiting on its event would see the previous occupant of a hot slot.
    loop = DecodeLoop("cuda", row_bytes=row_bytes, k=256, hot_slots=512, block_size=64,
                      device_blocks=256, num_requests=6, tokens_per_step=2, seed=row_bytes,
                      num_layers=4, gather_mode=gather_mode, chunks=chunks,
                      side_delay_cycles=2_000_000, side_ctas_per_sm=side_ctas,
                      leader_ctas_per_sm=leader_ctas)
    try:
        for i in range(30):
            loop.step(follower_layers=i % 5 != 4)
        resident, hits, misses = loop.state.counters()
        assert hits > 0 and misses > 0 and resident > 0
    finally:
        loop.close()


@pytest.mark.gpu
@pytest.mark.parametrize("gather_mode", ["side", "single"])
def test_step_with_side_prefetch_captures_in_a_cuda_graph(gather_mode):
    """resolve + the group's gathers (fork to the side stream, one event per follower, joins)
    + every layer's read of its rows, captured once and replayed step after step: every read
    row equals the ground truth."""
    dev = torch.device("cuda")
    L, bs, K, D, R, row_bytes = 4, 64, 256, 512, 4, 656
    P = 48  # 3072 positions per request
    gens = [TopkGenerator(K, seed=40 + r, recent=32, drift_tokens=6.0) for r in range(R)]
    host = HostPool(L, R * P, bs, row_bytes, huge_pages="never")
    device_rows = (R * P + R * (D // bs)) * bs
    kv = [torch.zeros((device_rows, row_bytes), dtype=torch.uint8, device=dev) for _ in range(L)]
    state = HotState(R, P, D, bs, dev)
    gather = GroupGather(state, host.layers, kv, mode=gather_mode)
    rows, pages, blocks, hosts = [], [], [], []
    positions = torch.arange(P * bs)
    for r in range(R):
        for l in range(L):
            host.layers[l][r * P * bs:(r + 1) * P * bs] = kv_rows(r, positions, l, row_bytes)
        state.lease_hot_region(r, [R * P + r * (D // bs) + i for i in range(D // bs)])
        for p in range(P):
            rows.append(r)
            pages.append(p)
            hosts.append(r * P + p)
            resident = p >= P - 2 or p % 5 == 0  # tail pages and every fifth page
            blocks.append(r * P + p if resident else -1)
            if resident:
                for l in range(L):
                    kv[l][(r * P + p) * bs:(r * P + p + 1) * bs] = kv_rows(
                        r, positions[p * bs:(p + 1) * bs], l, row_bytes).to(dev)
    state.set_pages(rows, pages, blocks)
    state.set_host_blocks(rows, pages, hosts)
    token_rows = torch.arange(R, dtype=torch.int32, device=dev)
    static_topk = torch.stack([g.select(P * bs) for g in gens]).to(dev)
    reads = [torch.empty((R * K, row_bytes), dtype=torch.uint8, device=dev) for _ in range(L)]

    def step():
        res = state.resolve(static_topk, token_rows)
        gather.launch(res)
        flat = res.out_rows.reshape(-1).clamp_min(0).to(torch.int64)
        for l in range(L):
            gather.wait(l)
            torch.index_select(kv[l], 0, flat, out=reads[l])
        return res

    def check(topk, tag):
        valid = (topk >= 0).reshape(-1)
        for l in range(L):
            want = torch.cat([kv_rows(r, topk[r][topk[r] >= 0], l, row_bytes) for r in range(R)])
            got = reads[l].cpu()[valid]
            assert torch.equal(got, want), f"{tag} layer {l}"

    try:
        step()  # eager warm-up: module load, side stream and events created, joined
        torch.cuda.synchronize()
        check(static_topk.cpu(), "eager")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        before = state.counters()
        for i in range(6):
            static_topk.copy_(torch.stack([g.select(P * bs) for g in gens]))
            graph.replay()
            torch.cuda.synchronize()
            check(static_topk.cpu(), f"replay {i}")
        _, hits, misses = (a - b for a, b in zip(state.counters(), before))
        assert hits > 0 and misses > 0
        assert state.side_work is None  # every follower waited inside the graph: joined
    finally:
        host.close()
