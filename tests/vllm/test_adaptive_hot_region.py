"""Adaptive hot regions on the worker role (reference ops on CPU, vLLM-allocated KV): the
per-row miss counts reach the policy, its resizes reach every index group's hot tables, and
every row attention reads after a grow or a shrink is still the ground truth. The run on
vLLM's real ``Scheduler`` is ``test_simulate_adaptive_hot_region_is_exact`` below."""

from __future__ import annotations

import pytest
import torch

from tests.vllm.test_worker_side import (  # noqa: F401 - model_dir is a fixture
    Rig,
    assert_nothing_leaked,
    model_dir,
    run_decode_loop,
)
from vllm_hisparse.core import Residency
from vllm_hisparse.core.hot_sizing import HotSizingConfig

ADAPTIVE = {"adaptive_hot_region": True}


class CheckedRig(Rig):
    """After every step, every index group's hot tables hold exactly the policy's leases:
    the leased blocks first, -1 past them, and no slot of an unleased block holds a
    position."""

    def step(self, scheduled, **kw):
        super().step(scheduled, **kw)
        for rid in self.policy.request_ids():
            row = self.policy.row_of(rid)
            blocks = [self.lead(b) for b in self.policy.hot_block_ids(rid)]
            if not blocks:
                continue
            n = len(blocks)
            for lane in self.role.lanes:
                want = lane.layout.scale_blocks([self.bundles[b][lane.sparse_index] for b in blocks])
                for state in lane.hot_states:
                    assert state.hot_blocks[row, :n].tolist() == want
                    assert (state.hot_blocks[row, n:] == -1).all()
                    assert (state.slot_pos[row, n * state.block_size:] == -1).all()


def _run(model_dir, target: float) -> CheckedRig:
    rig = CheckedRig(model_dir, num_blocks=200, policy_blocks=44, extra=ADAPTIVE,
                     hot_sizing=HotSizingConfig(block_size=64, min_blocks=1, max_blocks=4,
                                                target_miss_rate=target, window_steps=2))
    assert all(s.hot_blocks_per_request == 4 for l in rig.role.lanes for s in l.hot_states)
    run_decode_loop(rig, steps=24)
    assert int(Residency.MIXED) in rig.residency_seen
    assert rig.reads_checked > 0
    assert_nothing_leaked(rig)
    return rig


def test_grown_regions_read_ground_truth(model_dir):
    rig = _run(model_dir, target=0.01)  # every window misses more: regions grow
    assert rig.policy.stats.num_hot_grows > 0
    rig.role.shutdown()


def test_shrunk_regions_read_ground_truth(model_dir):
    rig = _run(model_dir, target=0.9)  # every window misses less: regions shrink
    assert rig.policy.stats.num_hot_shrinks > 0
    rig.role.shutdown()


def test_worker_counts_misses_per_row_and_only_rank_0_reports(model_dir):
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44, extra=ADAPTIVE)
    counts = rig.role._hot_counts
    assert counts is not None
    seen: dict[int, list[int]] = {}
    original = rig.role.build_worker_meta

    def spy():
        meta = original()
        for row, (m, r) in (meta.hot_counts if meta is not None else {}).items():
            acc = seen.setdefault(row, [0, 0])
            acc[0] += m
            acc[1] += r
        return meta

    rig.role.build_worker_meta = spy
    run_decode_loop(rig, steps=16)
    rest = counts.poll(sync=True)
    for row, (m, r) in rest.items():
        seen.setdefault(row, [0, 0])
        seen[row][0] += m
        seen[row][1] += r
    # What the worker reported adds up to its device counters, which add up to the misses
    # of the first index group's resolves (its own stats); the other groups count nothing.
    total = counts.counts.sum(dim=0).tolist()
    assert [sum(v[0] for v in seen.values()), sum(v[1] for v in seen.values())] == total
    states = [s for l in rig.role.lanes for s in l.hot_states]
    assert states[0].row_counts is counts and all(s.row_counts is None for s in states[1:])
    hits, misses = int(states[0].stats[1]), int(states[0].stats[2])
    assert total[0] == misses > 0 and total[1] == hits + misses
    rig.role.worker_rank = 1
    counts.counts += 1  # rank 1 never reports its counts
    assert (rig.role.build_worker_meta() or type("M", (), {"hot_counts": {}})).hot_counts == {}
    rig.role.shutdown()


def test_fixed_regions_count_nothing(model_dir):
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44)
    assert rig.role._hot_counts is None
    assert all(s.row_counts is None and s.hot_blocks_per_request == 2
               for l in rig.role.lanes for s in l.hot_states)
    rig.role.shutdown()


def test_simulate_adaptive_hot_region_is_exact():
    """vLLM's real Scheduler + the connector with adaptive_hot_region: every row read is the
    ground truth, regions resize, nothing leaks (the engine checks at the end)."""
    from vllm_hisparse.vllm.simulation.engine import SimulationEngine
    from vllm_hisparse.vllm.simulation.spec import SimulationSpec

    spec = SimulationSpec(num_layers=2, layers_per_indexer=1, block_size=16, top_k=16,
                          prefill_top_k=4, device_blocks=120, max_num_seqs=12,
                          max_num_batched_tokens=256, num_requests=10, prompt_len=160,
                          output_len=64, connector_extra={**ADAPTIVE,
                                                          "hot_region_target_miss_rate": 0.02})
    spec.validate()
    torch.manual_seed(0)
    engine = SimulationEngine(spec)
    try:
        result = engine.run(True)
    finally:
        engine.close()
    assert result.finished == 10 and result.rows_checked > 0
    assert result.demotions > 0 and result.hot_request_steps > 0
    assert result.hot_grows + result.hot_shrinks > 0


def test_aggregated_worker_metadata_keeps_rank_0_counts():
    from vllm_hisparse.vllm.metadata import HiSparseWorkerMetadata

    rank0 = HiSparseWorkerMetadata(worker_rank=0, hot_counts={3: (1, 4)})
    rank1 = HiSparseWorkerMetadata(worker_rank=1)
    rank2 = HiSparseWorkerMetadata(worker_rank=2)
    for folded in (rank1.aggregate(rank0).aggregate(rank2), rank0.aggregate(rank1)):
        assert folded.hot_counts == {3: (1, 4)}
        assert sorted(r for r, _ in folded.reports()) == sorted(
            {0, 1, 2} if len(folded.peers) == 2 else {0, 1})


@pytest.mark.parametrize("under_multi", [False, True], ids=["alone", "multiconnector"])
def test_resizes_on_vllms_scheduler_and_block_pool(model_dir, under_multi):
    """vLLM's real Scheduler and BlockPool (fake forward and acks): host-backed requests
    report a high miss rate, then a low one. Their regions grow
    from vLLM's free blocks and shrink back into the pool; the invariants hold every step and
    nothing leaks (``assert_no_leaks``; next to OffloadingConnector, whose stores nobody acks
    here, our side comes to rest)."""
    from tests.vllm.fake_worker import FakeWorker
    from tests.vllm.test_connector_scheduler import WORKLOAD, build, run

    worker = FakeWorker(multi_index=0 if under_multi else None)
    harness = build(model_dir, extra={"host_pool_gib": 1, **ADAPTIVE}, worker=worker,
                    under_multi=under_multi, num_blocks=500)
    policy = harness.residency.policy

    def counts():
        policy.check_invariants()
        misses = 90 if worker.step < 300 else 0
        return {row: (misses, 100) for row in policy.non_full_rows}

    worker.hot_counts = counts
    if not under_multi:
        run(harness, dict(WORKLOAD, max_tokens=600))
    else:
        requests = harness.add_requests(**dict(WORKLOAD, max_tokens=600))
        while harness.scheduler.running or harness.scheduler.waiting:
            harness.step()
            assert harness.stats.steps < 5000
        for _ in range(3):  # our last transfers acknowledged
            harness.step()
        harness.drain()
        assert all(r.is_finished() for r in requests)
        assert harness.residency.is_idle() and not harness.residency.book.hot_rows
    assert policy.stats.num_hot_grows > 0 and policy.stats.num_hot_shrinks > 0
