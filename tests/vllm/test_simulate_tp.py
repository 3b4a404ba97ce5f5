"""``simulate --tensor-parallel-size 2`` on CPU: two worker roles (TP ranks 0 and 1) on one
named shared host segment behind vLLM's real scheduler; every row each rank reads is checked
(vllm_hisparse/vllm/simulation/ranks.py).

The vote test makes one rank's copies complete late (``tests/worker/late_copies.py``: a slow
copy stream on CPU; the writer's device → host bytes land only at completion) and checks that
the scheduler applied every completion only after BOTH ranks reported it, and that the reads
stay exact. With the vote broken (the reader's report counted for the writer too) the reader
reads host rows the writer's copies have not filled yet, and the run fails."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm")

from tests.vllm.test_worker_tp_shared import shm_dir  # noqa: E402, F401 (fixture)
from tests.worker.late_copies import SEQUENCE, LateCompletions  # noqa: E402
from vllm_hisparse.cli.main import main  # noqa: E402
from vllm_hisparse.core.policy import ResidencyPolicy  # noqa: E402
from vllm_hisparse.vllm.metadata import HiSparseWorkerMetadata  # noqa: E402
from vllm_hisparse.vllm.simulation.engine import (  # noqa: E402
    SimulationEngine,
    SimulationMismatch,
    SimulationSpec,
)
from vllm_hisparse.worker.transfer import TransferEngine  # noqa: E402

# Pressure from the first steps and small pages: pages are released a few steps after their
# rows were mirrored, so reads of host rows follow their copies closely.
TINY = dict(num_requests=6, prompt_len=384, output_len=48, block_size=16, device_blocks=300,
            max_num_batched_tokens=512, num_layers=2, tensor_parallel_size=2)
LATE_POLLS = 10  # the late rank's copies complete 10 polls (steps) after their submission


def test_two_ranks_share_one_pool_and_both_read_exact(shm_dir, tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["simulate", "--requests", "6", "--prompt-len", "384", "--output-len", "48",
            "--block-size", "16", "--device-blocks", "300", "--max-num-batched-tokens", "512",
            "--layers", "2", "--runs", "with", "--quiet", "--tensor-parallel-size", "2",
            "--json", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "tensor-parallel ranks (with connector):" in stdout
    assert "in one shared segment" in stdout and "device cpu, cpu (tensor parallel 2)" in stdout
    run = json.loads(out.read_text())["runs"]["with connector"]
    writer, reader = run["ranks"]
    assert run["rows_checked"] == writer["rows_checked"] + reader["rows_checked"]
    assert writer["rows_checked"] == reader["rows_checked"] > 0
    assert (writer["resident"], writer["hot_hits"], writer["misses"]) == \
        (reader["resident"], reader["hot_hits"], reader["misses"])
    assert writer["writes_host"] and not reader["writes_host"]
    assert writer["bytes_d2h"] > 0 and reader["bytes_d2h"] == 0, "only rank 0 writes"
    # Rank 1 gathered misses from rows only rank 0 wrote, and they were exact.
    assert reader["misses"] > 0 and reader["gather_bytes"] > 0
    wpool, rpool = writer["host_pool"], reader["host_pool"]
    assert wpool["segment"] == rpool["segment"] and os.path.dirname(wpool["segment"]) == shm_dir
    assert wpool["shared"] and rpool["shared"]
    # Held once: the segment's pages, which the two mappings' Pss add up to.
    assert wpool["segment_bytes"] >= wpool["logical_bytes"] == rpool["logical_bytes"]
    assert 0 <= wpool["resident_bytes"] - wpool["logical_bytes"] < 2 * 4096  # whole pages
    held = wpool["pss_bytes"] + rpool["pss_bytes"]
    assert abs(held - wpool["segment_bytes"]) <= 64 << 10, (held, wpool["segment_bytes"])
    assert os.listdir(shm_dir) == [], "the writer unlinks the segment at shutdown"


def _late_run(late_rank: int, polls: int):
    """The TINY run with rank ``late_rank``'s copies completing ``polls`` polls late; returns
    (result, {rank: [LateCompletions per lane]}, {transfer id: SEQUENCE when applied})."""
    lanes: dict[int, list[LateCompletions]] = {0: [], 1: []}
    applied: dict[int, int] = {}
    init, apply = TransferEngine.__init__, ResidencyPolicy.apply_acks

    def late_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        rank = 0 if self.writes_host else 1  # only rank 0 writes the shared pool
        lanes[rank].append(LateCompletions(self, polls if rank == late_rank else 0))

    def recording_apply(self, acks):
        apply(self, acks)
        for tid in acks.completed:
            applied[tid] = next(SEQUENCE)

    engine = SimulationEngine(SimulationSpec(**TINY))
    try:
        TransferEngine.__init__ = late_init
        ResidencyPolicy.apply_acks = recording_apply
        result = engine.run(True)
    finally:
        TransferEngine.__init__, ResidencyPolicy.apply_acks = init, apply
        engine.close()
    return result, lanes, applied


@pytest.mark.parametrize("late_rank", [0, 1])
def test_the_vote_waits_for_both_ranks(shm_dir, late_rank):
    result, lanes, applied = _late_run(late_rank, LATE_POLLS)
    assert result.rows_checked > 0 and result.misses > 0
    assert all(lanes.values()), "both ranks' engines were wrapped"
    if late_rank == 0:
        assert sum(lane.landed for lane in lanes[0]) > 0, "the writer's bytes landed late"

    def done(rank, tid):  # a rank's worker reports a transfer once every lane completed it
        return max(lane.completed_at[tid] for lane in lanes[rank])

    assert applied
    early = 0
    for tid, seq in applied.items():
        assert seq > done(0, tid) and seq > done(1, tid), \
            f"transfer {tid} applied before both ranks reported it"
        early += done(1 - late_rank, tid) < done(late_rank, tid)
    assert early > len(applied) // 2, "the other rank reported first: the vote waited"


def test_a_vote_that_trusts_the_reader_alone_reads_stale_rows(shm_dir, monkeypatch):
    """The vote test can fail: if the scheduler counted the reader's report for the writer
    too, pages would be released before the writer's late bytes landed."""
    reports = HiSparseWorkerMetadata.reports

    def reader_for_all(self):
        reader = dict(reports(self)).get(1)
        return [] if reader is None else [(0, reader), (1, reader)]

    monkeypatch.setattr(HiSparseWorkerMetadata, "reports", reader_for_all)
    with pytest.raises(SimulationMismatch, match="TP rank [01]: MISMATCH"):
        _late_run(0, LATE_POLLS)
