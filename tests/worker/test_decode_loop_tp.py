"""The decode loop of ``test_decode_loop.py`` as two tensor-parallel ranks on one shared host
pool (docs/worker.md, "Tensor parallelism: one host pool per node"): rank 0 creates the
segment and writes it (mirrors, spills), rank 1 maps it read-only and copies nothing device →
host; both run the same steps on their own device KV and check every row each layer reads
against the ground truth. A page's device block is given up only once BOTH ranks completed
its copies (the scheduler's vote, ``core.ack_vote``), so rank 1 reads host rows only after
rank 0's copies of them completed.

On CPU the writer's copy stream is made slow (``late_copies.LateCompletions``: its bytes
land only at completion); a vote that trusted the reader alone then reads stale rows (the
test that shows the check can fail). With ``-m gpu`` and two devices the ranks run on
cuda:0 and cuda:1 with the kernels, pinned shared memory registered by each, and the
writer's copy stream held back by a sleep."""

from __future__ import annotations

import contextlib
import os
import uuid

import pytest
import torch

from tests.worker.late_copies import LateCompletions
from tests.worker.test_decode_loop import DecodeLoop
from tests.worker.test_host_pool_shared import shm_dir  # noqa: F401 (fixture)
from vllm_hisparse.worker.host_pool import SharedSegment


def on(device):
    """``device`` as the current one (a no-op on CPU)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class TwoRankDecodeLoop:
    """Two :class:`DecodeLoop` ranks in lock step; their transfer completions are voted.

    Args:
        devices: rank 0's and rank 1's device.
        shm_dir: where the shared segment lives.
        late_writer_polls: CPU: rank 0's copies complete (and land) this many polls late.
        writer_delay_cycles: CUDA: rank 0's copy stream sleeps this long before each batch
            of copies.
        trust_reader: decide a transfer on rank 1's report alone (a broken vote).
    """

    def __init__(self, devices, shm_dir, *, late_writer_polls=0, writer_delay_cycles=0,
                 trust_reader=False, **kw):
        name = uuid.uuid4().hex[:16]
        self.loops = []
        for rank, device in enumerate(devices):
            shared = SharedSegment(name, create=rank == 0, dirs=(shm_dir,), read_only=rank > 0)
            with on(device):
                self.loops.append(DecodeLoop(device, shared=shared, writes_host=rank == 0,
                                             **kw))
        self.writer, self.reader = self.loops
        assert self.reader.host.segment_path == self.writer.host.segment_path
        if late_writer_polls:
            self.late = LateCompletions(self.writer.engine, late_writer_polls)
        self.writer_delay_cycles = writer_delay_cycles
        self.trust_reader = trust_reader
        self.done: tuple[set[int], set[int]] = (set(), set())  # completed, not decided yet

    def _delay_writer(self):
        if self.writer_delay_cycles:
            with on(self.writer.device), torch.cuda.stream(self.writer.engine._stream):
                torch.cuda._sleep(self.writer_delay_cycles)

    def _settle(self):
        """Poll both ranks; a transfer every rank completed is decided (the scheduler's
        vote): its callbacks (block releases) run on every rank."""
        for done, loop in zip(self.done, self.loops):
            with on(loop.device):
                report = loop.engine.poll()
            assert not report.failed
            done.update(report.completed)
        decided = set(self.done[1]) if self.trust_reader else self.done[0] & self.done[1]
        for tid in sorted(decided):
            for done, loop in zip(self.done, self.loops):
                done.discard(tid)
                callback = loop.pending.pop(tid)
                if callback:
                    with on(loop.device):
                        callback()

    def step(self):
        self._delay_writer()
        for loop in self.loops:
            with on(loop.device):
                loop._release_some_pages()
        self._settle()
        for loop in self.loops:
            with on(loop.device):
                loop.read()
        self._delay_writer()
        for loop in self.loops:
            with on(loop.device):
                loop.write()
        self._settle()

    def close(self):
        for loop in reversed(self.loops):  # readers first: the writer unlinks the segment
            with on(loop.device):
                loop.close()


def run_pair(pair, steps):
    try:
        for _ in range(steps):
            pair.step()
        for loop in pair.loops:
            resident, hits, misses = loop.state.counters()
            assert hits > 0 and misses > 0 and resident > 0  # every path was exercised
        assert pair.writer.state.counters() == pair.reader.state.counters()
        assert pair.reader.engine.num_skipped_host_writes > 0
    finally:
        pair.close()


def test_two_ranks_read_exact_rows_with_a_slow_writer_on_cpu(shm_dir):
    pair = TwoRankDecodeLoop(("cpu", "cpu"), shm_dir, late_writer_polls=20, tokens_per_step=3,
                             seed=5)
    run_pair(pair, 25)
    assert pair.late.landed > 0
    assert os.listdir(shm_dir) == []


def test_a_vote_that_trusts_the_reader_reads_stale_rows_on_cpu(shm_dir):
    pair = TwoRankDecodeLoop(("cpu", "cpu"), shm_dir, late_writer_polls=20, tokens_per_step=3,
                             seed=5, trust_reader=True)
    with pytest.raises(pytest.fail.Exception, match="unwritten|expected"):
        run_pair(pair, 25)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("row_bytes", [656, 1152])
def test_two_ranks_on_two_gpus_read_exact_rows(shm_dir, row_bytes):
    # Rank 0's copy stream sleeps ~1 ms before each batch of copies: a reader let in before
    # the writer's completion would gather stale rows.
    pair = TwoRankDecodeLoop(("cuda:0", "cuda:1"), shm_dir, writer_delay_cycles=2_000_000,
                             row_bytes=row_bytes, k=256, hot_slots=512, block_size=64,
                             device_blocks=256, num_requests=6, tokens_per_step=2,
                             seed=row_bytes, num_layers=4, side_delay_cycles=2_000_000)
    assert pair.writer.host.page_mode in ("hugetlb", "thp", "pinned")
    run_pair(pair, 30)
