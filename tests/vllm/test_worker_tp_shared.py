"""Tensor-parallel ranks share one host pool (docs/worker.md, "Tensor parallelism: one host
pool per node"): the decision from the vLLM config, the host block count it implies, the logs,
and two worker roles ("TP ranks" 0 and 1) driven by the same commands on CPU.

The two-rank run reuses ``test_worker_side.Rig`` (core policy, vLLM's real KV allocation for a
planned IndexShare model, reads through the hook on real ``SparseMLAIndexGroup`` objects,
every row checked against ground truth). Rank 1 is a second ``WorkerRole`` built
from a pickled copy of the config with ``parallel_config.rank = 1`` (as vLLM's multiprocess
executor ships the config to each worker), with its own device KV; both ranks get every
command, both ranks' acks are merged as the scheduler merges workers' reports
(``core.ack_vote.AckVote``: completed once every rank completed, failed once every rank
reported it and one failed).
"""

from __future__ import annotations

import copy
import logging
import os
import pickle

import pytest

from tests.vllm import test_worker_side as ws
from tests.vllm.test_worker_side import (  # noqa: F401  (fixtures)
    Rig,
    _unhook,
    allocate,
    assert_nothing_leaked,
    make_group,
    model_dir,
    run_decode_loop,
)
from vllm_hisparse.core import Residency
from vllm_hisparse.core.ack_vote import AckVote
from vllm_hisparse.core.commands import WorkerAcks
from vllm_hisparse.vllm.setup import host_sharing
from vllm_hisparse.vllm.setup.host_sharing import plan_host_pool_sharing, segment_name
from vllm_hisparse.vllm.setup.kv_plan import host_copies_per_replica
from vllm_hisparse.vllm.metadata import HiSparseWorkerMetadata
from vllm_hisparse.vllm.worker_side.role import WorkerRole
from vllm_hisparse.worker import shm_segment


def with_tp(vllm_config, tp=2, backend="mp"):
    pc = vllm_config.parallel_config
    pc.tensor_parallel_size = tp
    pc.world_size = tp
    pc.distributed_executor_backend = backend
    return vllm_config


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """Segments go to a private directory (tmpfs when /dev/shm exists)."""
    import shutil
    import tempfile

    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    path = tempfile.mkdtemp(prefix="hisparse-test-", dir=root)
    monkeypatch.setenv(host_sharing.ENV_SHM_DIR, path)
    monkeypatch.delenv(host_sharing.ENV_SHARED, raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tp2(monkeypatch):
    """Rig configs with two TP ranks under the given executor backend (planning included)."""
    def use(backend="mp"):
        original = ws.make_vllm_config
        monkeypatch.setattr(ws, "make_vllm_config",
                            lambda *a, **k: with_tp(original(*a, **k), 2, backend))
    return use


# ------------------------------------------------------------------------------ decision


def test_sharing_decision(model_dir, monkeypatch):
    monkeypatch.delenv(host_sharing.ENV_SHARED, raising=False)
    config, _ = ws.planned(model_dir, 100)
    one = plan_host_pool_sharing(config)
    assert not one.shared and one.host_copies == 1 and "one tensor-parallel rank" in one.reason
    with_tp(config)
    shared = plan_host_pool_sharing(config)
    assert shared.shared and shared.host_copies == 1 and shared.num_ranks == 2
    assert host_copies_per_replica(config) == 1
    assert shared.writes_host(0) and not shared.writes_host(1)
    assert shared.segment(0).create and not shared.segment(1).create
    # Every rank derives the same name from its own (pickled) copy of the config ...
    assert plan_host_pool_sharing(pickle.loads(pickle.dumps(config))).segment_name \
        == shared.segment_name == segment_name(config)
    # ... and another data-parallel replica (or another engine) a different one.
    other_dp = copy.deepcopy(config)
    other_dp.parallel_config.data_parallel_rank = 1
    assert segment_name(other_dp) != shared.segment_name
    for backend, why in (("ray", "executor backend 'ray'"),
                         ("external_launcher", "executor backend 'external_launcher'")):
        config.parallel_config.distributed_executor_backend = backend
        private = plan_host_pool_sharing(config)
        assert not private.shared and private.host_copies == 2 and why in private.reason
        assert host_copies_per_replica(config) == 2
        assert private.segment(1) is None and private.writes_host(1)
    config.parallel_config.distributed_executor_backend = "mp"
    monkeypatch.setattr(type(config.parallel_config), "nnodes_within_dp", property(lambda s: 2))
    assert "span 2 nodes" in plan_host_pool_sharing(config).reason
    monkeypatch.undo()
    monkeypatch.setenv(host_sharing.ENV_SHARED, "0")
    assert not plan_host_pool_sharing(config).shared


def test_private_fallback_is_logged(model_dir, tp2, shm_dir, caplog):
    tp2("ray")
    with caplog.at_level(logging.INFO, logger="vllm_hisparse"):
        rig = Rig(model_dir, num_blocks=100)
    try:
        text = caplog.text
        assert "one private host pool per tensor-parallel rank (executor backend 'ray'" in text
        assert "physical host memory = 2 x logical" in text
        assert "GiB physical (private pool)" in text
        assert rig.role.host_pool.segment_path is None and rig.role.writes_host
        assert os.listdir(shm_dir) == []
    finally:
        rig.role.shutdown()


# ------------------------------------------------------------------------------ two ranks


class _Ranks:
    """The rig's ``role``: every call goes to both ranks; ``lanes`` are the current rank's
    (the fake forward writes each rank's own device KV); acks merged across ranks."""

    def __init__(self, writer, reader):
        self.roles = (writer, reader)
        self.current = writer
        self._vote = AckVote(2, "worker")

    def __getattr__(self, name):  # max_pages, num_state_rows, host_num_blocks, ...
        return getattr(self.roles[0], name)

    @property
    def lanes(self):
        return self.current.lanes

    def start_load_kv(self, metadata, **kw):
        self._vote.expect(t.transfer_id for t in metadata.command.transfers)
        for role in self.roles:
            role.start_load_kv(metadata, **kw)

    def wait_for_save(self):
        for role in self.roles:
            role.wait_for_save()

    def build_worker_meta(self):
        parts = [role.build_worker_meta() for role in self.roles]
        acks = self._vote.vote([(rank, p.acks) for rank, p in enumerate(parts) if p is not None])
        return None if acks.is_empty() else HiSparseWorkerMetadata(acks=acks)


class TwoRankRig(Rig):
    """``Rig`` with a second tensor-parallel rank mapping the first one's host pool."""

    def __init__(self, model_dir, *, reader_fail=None, **kw):
        super().__init__(model_dir, **kw)  # TP rank 0: creates the pool and writes it
        self.writer = self.role
        config = pickle.loads(pickle.dumps(self.vllm_config))  # what a worker receives
        config.parallel_config.rank = 1
        self.reader = WorkerRole(config, self.hs_config, self.kv_cache_config,
                                         fail_transfer=reader_fail, huge_pages="never")
        self.reader.register_kv_caches(allocate(config, self.kv_cache_config))
        self.writer_groups, self.reader_groups = self.groups, []
        for lane in self.reader.lanes:
            for binding in lane.bindings:
                group = make_group()
                self.reader.bind_index_group(group, binding)
                self.reader_groups.append((group, lane, binding))
        self.role = _Ranks(self.writer, self.reader)

    def write_kv(self, rid, row, start, end):
        for role in self.role.roles:  # each rank computes the same (replicated) KV
            self.role.current = role
            super().write_kv(rid, row, start, end)
        self.role.current = self.writer

    def attend(self, ranges, decode, block_stride_mode):
        for role, groups in ((self.writer, self.writer_groups), (self.reader, self.reader_groups)):
            self.role.current, self.groups = role, groups
            super().attend(ranges, decode, block_stride_mode)
        self.role.current, self.groups = self.writer, self.writer_groups


def run_two_ranks(model_dir, caplog=None, **kw):
    if caplog is None:
        rig = TwoRankRig(model_dir, num_blocks=200, policy_blocks=44, **kw)
    else:  # INFO capture only while binding: logging every step slows the loop down 4x
        with caplog.at_level(logging.INFO, logger="vllm_hisparse"):
            rig = TwoRankRig(model_dir, num_blocks=200, policy_blocks=44, **kw)
    writer, reader = rig.writer, rig.reader
    assert writer.writes_host and not reader.writes_host
    assert writer.host_pool.creates_segment and not reader.host_pool.creates_segment
    assert reader.host_pool.segment_path == writer.host_pool.segment_path
    assert writer.host_num_blocks == reader.host_num_blocks  # one copy: the whole budget
    run_decode_loop(rig, steps=60)
    assert int(Residency.MIXED) in rig.residency_seen, "the loop never exercised residency"
    assert rig.reads_checked > 0
    assert_nothing_leaked(rig)
    for lane in reader.lanes:
        assert lane.engine.num_in_flight == 0 and lane.engine.num_skipped_host_writes > 0
    for lane in writer.lanes:
        assert lane.engine.num_skipped_host_writes == 0
    w, r = (role.get_stats(sync=True).reduce() for role in (writer, reader))
    assert w["bytes_to_host"] > 0 and r["bytes_to_host"] == 0, "only the writer writes"
    # The reader gathered misses from host rows only the writer wrote (checked exact).
    assert r["misses"] > 0 and r["bytes_to_device"] + r["gather_bytes"] > 0
    path = writer.host_pool.segment_path
    reader.shutdown()
    assert os.path.exists(path)
    writer.shutdown()
    assert not os.path.exists(path)
    return rig


@pytest.mark.parametrize("host_layout", ["position", "layer"])
def test_two_ranks_share_one_pool_and_only_rank0_writes(model_dir, tp2, shm_dir, caplog,
                                                        host_layout):
    tp2("mp")
    rig = run_two_ranks(model_dir, caplog, extra={"host_layout": host_layout})
    assert rig.writer.host_pool.layout == rig.reader.host_pool.layout == host_layout
    assert "shared by the 2 tensor-parallel ranks of this node" in caplog.text
    assert "TP rank 0 creates it and writes it" in caplog.text
    assert "TP rank 1 maps it and only reads it" in caplog.text
    assert "mapped by 2 ranks of this node" in caplog.text  # physical GiB: the creator's line
    assert rig.writer.host_pool.physical_gib > 0 and rig.reader.host_pool.physical_gib == 0
    assert os.listdir(shm_dir) == []


def test_two_ranks_writer_failures_keep_reads_exact(model_dir, tp2, shm_dir):
    # Only the writer's copies fail: the reader's acknowledgements of them must not make
    # the policy take the host copy as valid (any failure fails the transfer).
    tp2("mp")
    rig = run_two_ranks(model_dir, fail=lambda tid: tid % 7 == 3)
    assert rig.policy.stats.num_failed_transfers > 0


def test_segment_names_are_under_the_prefix(model_dir, tp2, shm_dir):
    tp2("mp")
    rig = Rig(model_dir, num_blocks=100)
    try:
        path = rig.role.host_pool.segment_path
        assert os.path.dirname(path) == shm_dir
        assert os.path.basename(path) == shm_segment.SEGMENT_PREFIX + segment_name(rig.vllm_config)
    finally:
        rig.role.shutdown()
