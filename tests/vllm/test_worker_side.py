"""The connector's worker role on CPU: vLLM's own KV allocation for a planned DSA config,
the reference ops, and step commands from the core ``ResidencyPolicy`` (driven directly: the
scheduler-side connector is not available yet).

A fake forward writes ``synthetic.kv_rows`` into the device rows the worker's tables name;
attention reads go through the installed hook on real ``SparseMLAIndexGroup`` objects and
every row they name must hold the ground-truth KV of the selected position, for every layer.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hisparse.vllm.simulation.model import (
    DSV32_TINY,
    dsa_layer_specs,
    kv_transfer_config,
    make_vllm_config,
)
from vllm_hisparse.core import (
    HostBlockPool,
    InMemoryDevicePool,
    Outcome,
    PolicyConfig,
    Residency,
    ResidencyPolicy,
)
from vllm_hisparse.worker.hot_state import DEFAULT_LEADER_CTAS_PER_SM
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.worker_side.read_path import (
    BINDING_ATTR,
    compact_valid_to_front,
    hooked_conversion,
    vllm_reference_conversion,
)
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata
from vllm_hisparse.vllm.worker_side.role import WorkerRole
from vllm_hisparse.worker.synthetic import TopkGenerator, describe_row, kv_rows

BS = 64
TOP_K = 64
NUM_LAYERS = 6
LEADERS = {0, 3}  # two index units of three layers (IndexShare followers 1, 2, 4, 5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dsa_small_topk")
    config = dict(DSV32_TINY, index_topk=TOP_K, num_hidden_layers=NUM_LAYERS)
    (root / "config.json").write_text(json.dumps(config))
    return root


def planned(model_dir: Path, num_blocks: int, *, max_model_len: int = 1024, extra=None,
            num_speculative_tokens: int = 0):
    """A VllmConfig and vLLM's FULL (per-layer) KV cache config planned by our builder."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    extra = {"host_pool_gib": 0.02, **(extra or {})}
    vllm_config = make_vllm_config(model_dir, kv_transfer=kv_transfer_config(extra),
                                   max_model_len=max_model_len,
                                   num_speculative_tokens=num_speculative_tokens)
    specs = dsa_layer_specs(NUM_LAYERS, leaders=LEADERS, block_size=BS)
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    try:
        (kv_cache_config,) = get_kv_cache_configs(vllm_config, [specs], [1 << 40], groups)
    finally:
        vllm_config.cache_config.num_gpu_blocks_override = None
    return vllm_config, kv_cache_config


def allocate(vllm_config, kv_cache_config):
    """The per-layer tensors vLLM's worker allocates for this plan (CPU)."""
    layout = compat.resolved_kv_cache_layout(vllm_config)
    return compat.allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout)


@pytest.fixture(autouse=True)
def _unhook():
    yield
    patches.TOPK_CONVERSION_HOOK.remove()


def make_group(num_tokens_max: int = 64):
    """A real vLLM SparseMLAIndexGroup on CPU whose Triton conversion is replaced by its
    pure-torch twin (the Triton kernel and CUDA streams do not run on CPU)."""
    cls = compat.sparse_mla_index_group_class()
    topk = torch.zeros((num_tokens_max, TOP_K), dtype=torch.int32)
    group = cls(logical_topk_indices=topk, physical_topk_indices=torch.zeros_like(topk),
                valid_topk_counts=torch.zeros(num_tokens_max, dtype=torch.int32),
                side_stream=None, logical_topk_ready=None, physical_topk_ready=None,
                has_indexer=True)

    def convert_once(layer_index, logical, req_id, block_table, block_size, *,
                     block_stride_rows, return_valid_counts, idx_mapping=None):
        rows = vllm_reference_conversion(req_id, block_table, logical, block_size,
                                         block_stride_rows)
        return compact_valid_to_front(rows) if return_valid_counts else rows

    group._convert_once = convert_once
    return group


class Rig:
    """Policy + worker role + fake forward over vLLM-allocated CPU KV tensors."""

    def __init__(self, model_dir, *, num_blocks=200, policy_blocks=None, fail=None, seed=0,
                 extra=None, pad_to=None, num_speculative_tokens=0, hot_sizing=None):
        # pad_to: decode batches padded to this many tokens as a FULL CUDA graph pads them
        # (padding tokens map to batch row 0, the metadata counts them as actual tokens).
        self.pad_to = pad_to
        self.vllm_config, self.kv_cache_config = planned(
            model_dir, num_blocks, extra=extra, num_speculative_tokens=num_speculative_tokens)
        self.hs_config = resolve_config(self.vllm_config)
        self.kv = allocate(self.vllm_config, self.kv_cache_config)
        self.role = WorkerRole(self.vllm_config, self.hs_config, self.kv_cache_config,
                                       fail_transfer=fail, huge_pages="never")
        self.role.register_kv_caches(self.kv)
        self.num_groups = len(self.role.lanes)
        # Policy blocks are page bundles: lead b -> b + g * M in sparse group g (block 0 of
        # vLLM's pool is its null block, so leads start at 1).
        self.M = policy_blocks or (num_blocks - 1) // self.num_groups
        cfg = PolicyConfig(block_size=BS, max_num_rows=self.role.num_state_rows,
                           max_pages_per_request=self.role.max_pages,
                           device_buffer_size_rows=self.hs_config.device_buffer_size,
                           min_steps_between_transitions=0, hot_sizing=hot_sizing)
        self.policy = ResidencyPolicy(cfg, InMemoryDevicePool(self.M),
                                      HostBlockPool(self.role.host_num_blocks))
        self.bundles = {b + 1: [b + 1 + g * self.M for g in range(self.num_groups)]
                        for b in range(self.M)}
        self.groups = []  # (vLLM index group object, lane, binding)
        for lane in self.role.lanes:
            for binding in lane.bindings:
                group = make_group()
                self.role.bind_index_group(group, binding)
                self.groups.append((group, lane, binding))
        self.serial: dict[str, int] = {}
        self.gen: dict[str, TopkGenerator] = {}
        self.layer_ids = {}
        first = 0
        for lane in self.role.lanes:
            for i, name in enumerate(lane.layer_names):
                self.layer_ids[(lane.group_id, i)] = int(name.split(".")[2])
            first += len(lane.layer_names)
        self.held_acks = []
        self.rng = random.Random(seed)
        self.reads_checked = 0
        self.residency_seen = set()

    # policy block ids are 0-based; shift by one so vLLM's null block 0 is never used
    def lead(self, b: int) -> int:
        return b + 1 if b >= 0 else b

    def add(self, rid: str):
        self.serial[rid] = len(self.serial) + 1
        self.gen[rid] = TopkGenerator(TOP_K, seed=self.serial[rid], recent=8, drift_tokens=4)
        return self.policy.add_request(rid)

    def step(self, scheduled: dict[str, int], *, attend=True, block_stride_mode="flat"):
        ranges = []
        for rid, n in scheduled.items():
            row = self.policy.row_of(rid)
            start = int(self.policy.tables.num_tokens[row])
            if self.policy.schedule(rid, n) == Outcome.OK:
                ranges.append((rid, row, start, start + n))
        cmd = self.policy.build_step()
        cmd = shift_blocks(cmd, self.lead)
        meta = HiSparseConnectorMetadata(command=cmd, bundles=self.bundles)
        batch = [r[0] for r in ranges]
        out = SimpleNamespace(num_scheduled_tokens={r[0]: r[3] - r[2] for r in ranges})
        # MRV2 passes the batch's token count before padding (num_tokens).
        self.role.start_load_kv(meta, request_ids=batch, scheduler_output=out,
                                num_tokens=sum(r[3] - r[2] for r in ranges))
        for rid, row, start, end in ranges:
            self.write_kv(rid, row, start, end)
        if attend:
            decode = [(i, r) for i, r in enumerate(ranges) if r[3] - r[2] == 1]
            if decode:
                self.attend(ranges, decode, block_stride_mode)
        self.role.wait_for_save()
        for rid in scheduled:
            self.residency_seen.add(int(self.policy.residency(rid)))
        self.deliver_acks()
        self.policy.check_invariants()

    def write_kv(self, rid, row, start, end, serial=None):
        """The forward's KV of positions ``[start, end)``: request ``rid``'s (or, with
        ``serial``, that of another token sequence)."""
        pos = torch.arange(start, end)
        for lane in self.role.lanes:
            res = lane.executor.residency[row, (pos // BS).numpy()]
            assert (res >= 0).all(), "the forward writes into resident tail pages only"
            dev_rows = torch.as_tensor(res) * BS + pos % BS
            for i, view in enumerate(lane.device_layers):
                view[dev_rows] = kv_rows(self.serial[rid] if serial is None else serial, pos,
                                         self.layer_ids[(lane.group_id, i)], view.shape[1])

    def attend(self, ranges, decode, block_stride_mode):
        """Decode tokens only (one per request), batch rows = positions in ``ranges``."""
        req_id = torch.tensor([i for i, _ in decode], dtype=torch.int32)
        topk = torch.stack([self.gen[r[0]].select(r[3]) for _, r in decode]).to(torch.int32)
        if self.pad_to:  # padding tokens: batch row 0, positions no request has
            pad = self.pad_to - len(decode)
            req_id = torch.cat([req_id, torch.zeros(pad, dtype=torch.int32)])
            topk = torch.cat([topk, torch.full((pad, TOP_K), 1 << 20, dtype=torch.int32)])
        for group, lane, binding in self.groups:
            # vLLM's block table for this group: batch row -> this group's block per page
            # (valid for FULL requests; host-only pages hold whatever vLLM keeps there).
            table = torch.zeros((len(ranges), self.role.max_pages), dtype=torch.int32)
            for b, (rid, row, start, end) in enumerate(ranges):
                res = lane.executor.residency[row] // lane.layout.block_scale
                table[b] = torch.as_tensor(np.where(res >= 0, res, 0))
            md = SimpleNamespace(req_id_per_token=req_id, block_table=table, block_size=BS,
                                 num_actual_tokens=topk.shape[0])
            stride = lane.layout.block_stride_rows if block_stride_mode == "flat" else None
            for layer_index, i in enumerate(lane.units[lane.bindings.index(binding)]):
                rows, counts = group.convert_logical_to_physical_topk(
                    layer_index, topk, md, block_stride_rows=stride, return_valid_counts=True)
                self.check_rows(lane, i, rows, counts, topk, decode, stride)

    def check_rows(self, lane, i, rows, counts, topk, decode, stride):
        view = lane.device_layers[i]
        for t, (_, (rid, *_)) in enumerate(decode):
            want_pos = topk[t][topk[t] >= 0]
            n = int(counts[t])
            assert n == want_pos.numel()
            got_rows = rows[t, :n].to(torch.int64)
            if stride is None:  # dense page rows -> flat rows of this layout
                got_rows = (got_rows // BS) * lane.layout.block_stride_rows + got_rows % BS
            got = view[got_rows]
            want = kv_rows(self.serial[rid], want_pos, self.layer_ids[(lane.group_id, i)],
                           view.shape[1])
            bad = (got != want).any(dim=1).nonzero().flatten()
            assert bad.numel() == 0, (
                f"{rid} layer {self.layer_ids[(lane.group_id, i)]}: position "
                f"{int(want_pos[bad[0]])} read {describe_row(got[bad[0]])}")
            self.reads_checked += n

    def deliver_acks(self):
        meta = self.role.build_worker_meta()
        if meta is not None:
            self.held_acks.append(meta.acks)
            if meta.hot_counts:
                self.policy.observe_hot_counts(meta.hot_counts)
        # Out of order: deliver a random subset of the held reports, each list shuffled.
        keep = []
        for acks in self.held_acks:
            if self.rng.random() < 0.5:
                keep.append(acks)
                continue
            for lst in (acks.enqueued, acks.completed, acks.failed):
                self.rng.shuffle(lst)
            self.policy.apply_acks(acks)
        self.held_acks = keep

    def drain(self):
        while self.held_acks or not self.policy.is_idle():
            for acks in self.held_acks:
                self.policy.apply_acks(acks)
            self.held_acks = []
            self.step({}, attend=False)
            if self.policy.is_idle() and not self.held_acks:
                break


def shift_blocks(cmd, lead):
    import dataclasses

    from vllm_hisparse.core.commands import TransferKind

    return dataclasses.replace(
        cmd,
        page_device_blocks=[lead(b) for b in cmd.page_device_blocks],
        hot_leases=[dataclasses.replace(l, block_ids=[lead(b) for b in l.block_ids])
                    for l in cmd.hot_leases],
        transfers=[t if TransferKind(t.kind) is TransferKind.MIRROR
                   else dataclasses.replace(t, device_blocks=[lead(b) for b in t.device_blocks])
                   for t in cmd.transfers])


# ------------------------------------------------------------------------------ binding


def test_binds_vllm_allocated_packed_tensors(model_dir):
    vllm_config, kv_cache_config = planned(model_dir, 100)
    kv = allocate(vllm_config, kv_cache_config)
    role = WorkerRole(vllm_config, resolve_config(vllm_config), kv_cache_config,
                              huge_pages="never")
    role.register_kv_caches(kv)
    assert len(role.lanes) >= 1
    assert sum(len(l.layer_names) for l in role.lanes) == NUM_LAYERS
    assert [len(u) for l in role.lanes for u in l.units] == [3, 3]
    for lane in role.lanes:
        for name, view in zip(lane.layer_names, lane.device_layers):
            # Writing flat row b * S + o lands in vLLM's view of block b, offset o.
            cache = kv[name]
            b, o = 7, 5
            view[b * lane.layout.block_stride_rows + o] = 0xAB
            assert (cache[b, 0, o].view(torch.uint8) == 0xAB).all()
            cache.view(torch.uint8)[b, 0, o] = 0
            assert (view == 0).all()
    assert role.host_pool.num_layers == NUM_LAYERS
    assert patches.TOPK_CONVERSION_HOOK.installed()
    role.shutdown()
    assert role.host_pool.closed


@pytest.mark.parametrize("extra, mode, max_ctas, leader_ctas", [
    (None, "side", 16, DEFAULT_LEADER_CTAS_PER_SM),
    ({"index_share_prefetch": False, "prefetch_max_ctas": 4, "gather_ctas_per_sm": 3},
     "single", 4, 3),
])
def test_prefetch_keys_reach_every_index_group_binding(model_dir, extra, mode, max_ctas,
                                                       leader_ctas):
    vllm_config, kv_cache_config = planned(model_dir, 100, extra=extra)
    role = WorkerRole(vllm_config, resolve_config(vllm_config), kv_cache_config,
                              huge_pages="never")
    role.register_kv_caches(allocate(vllm_config, kv_cache_config))
    bindings = [b for lane in role.lanes for b in lane.bindings]
    assert bindings and all(b.gather.mode == mode and b.gather.side_max_ctas == max_ctas
                            for b in bindings)
    assert {b.gather.leader_ops.tuning.copy_ctas_per_sm for b in bindings} == {leader_ctas}
    # Groups of 3 layers: side mode copies the leader and its first follower at the leader,
    # the third layer on the side stream; single mode copies all 3 at once.
    assert {b.gather.chunks for b in bindings} == {(2, 1) if mode == "side" else (3,)}
    role.shutdown()


def test_decode_loop_without_index_share_prefetch(model_dir):
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44, seed=5,
              extra={"index_share_prefetch": False})
    run_decode_loop(rig, steps=60)
    assert int(Residency.MIXED) in rig.residency_seen and rig.reads_checked > 0
    assert_nothing_leaked(rig)
    rig.role.shutdown()


def test_register_rejects_missing_layer(model_dir):
    vllm_config, kv_cache_config = planned(model_dir, 100)
    kv = allocate(vllm_config, kv_cache_config)
    kv.pop(next(iter(kv_cache_config.kv_cache_groups[0].layer_names)))
    role = WorkerRole(vllm_config, resolve_config(vllm_config), kv_cache_config,
                              huge_pages="never")
    with pytest.raises(ValueError, match="no tensor for sparse-MLA layer"):
        role.register_kv_caches(kv)


# ------------------------------------------------------------------------------ decode loop


def run_decode_loop(rig: Rig, *, num_requests=6, prompt=384, steps=120, mode="flat"):
    ids = [f"r{i}" for i in range(num_requests)]
    for rid in ids:
        rig.add(rid)
    for rid in ids:  # prefill one request per step (all FULL while prefilling)
        rig.step({rid: prompt}, attend=False)
    live = list(ids)
    for s in range(steps):
        rig.step({rid: 1 for rid in live}, block_stride_mode=mode if s % 2 else "flat")
        if s == steps // 2:  # one request finishes mid-way: its row is cleared
            rig.policy.finish(live.pop(0))
    for rid in live:
        rig.policy.finish(rid)
    rig.drain()


def assert_nothing_leaked(rig: Rig):
    rig.policy.check_invariants()
    assert rig.policy.is_idle()
    assert rig.policy.device_pool.get_num_free_blocks() == rig.M
    assert rig.policy.host_pool.num_free_blocks + rig.policy.host_pool.num_cached_blocks \
        == rig.policy.host_pool.num_blocks
    for lane in rig.role.lanes:
        assert lane.engine.num_in_flight == 0
    assert rig.role._vote.num_open == 0


@pytest.mark.parametrize("host_layout, expected", [("auto", "position"), ("layer", "layer")])
def test_decode_loop_reads_ground_truth_under_pressure(model_dir, host_layout, expected, caplog):
    # Few policy blocks: 6 requests of 6+ pages do not all fit, so some go MIXED and read
    # released pages through their hot regions. Both host pool layouts (auto: IndexShare
    # units of 3 layers here, so position-major) mirror, spill and gather exactly.
    with caplog.at_level(logging.INFO, logger="vllm_hisparse"):
        rig = Rig(model_dir, num_blocks=200, policy_blocks=44, extra={"host_layout": host_layout})
    assert rig.role.host_pool.layout == expected
    assert f"host pool {expected}-major: " in caplog.text
    run_decode_loop(rig)
    assert int(Residency.MIXED) in rig.residency_seen, "the loop never exercised residency"
    assert rig.reads_checked > 0
    stats = rig.role.get_stats(sync=True)
    assert stats is not None
    reduced = stats.reduce()
    assert reduced["hot_hits"] + reduced["misses"] > 0
    assert reduced["misses"] > 0 and reduced["bytes_to_host"] > 0 and reduced["gather_bytes"] > 0
    assert_nothing_leaked(rig)
    rig.role.shutdown()


def test_decode_loop_dense_row_space(model_dir):
    """Kernels that index pages through their stride (block_stride_rows=None) get dense rows."""
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44, seed=3)
    run_decode_loop(rig, steps=60, mode="dense")
    assert int(Residency.MIXED) in rig.residency_seen
    assert_nothing_leaked(rig)


def test_failed_transfers_fail_cleanly(model_dir):
    # Every 7th transfer fails (spills, mirrors, restores alike): the policy keeps the
    # source copy, reads stay exact, and at the end nothing is leaked.
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44, fail=lambda tid: tid % 7 == 3)
    run_decode_loop(rig, steps=80)
    assert rig.policy.stats.num_failed_transfers > 0
    assert_nothing_leaked(rig)


def test_all_full_batches_take_vllms_conversion_unchanged(model_dir):
    rig = Rig(model_dir, num_blocks=200)  # plenty of blocks: every request stays FULL
    calls = []
    for group, _, _ in rig.groups:
        original = group._convert_once

        def spy(*a, _orig=original, **k):
            calls.append(k["return_valid_counts"])
            return _orig(*a, **k)
        group._convert_once = spy
    rig.add("a")
    rig.step({"a": 200}, attend=False)
    for _ in range(5):
        rig.step({"a": 1})
    assert rig.residency_seen == {int(Residency.FULL)}
    # Only vLLM's conversion ran, with the caller's own arguments (compaction included).
    assert calls and all(calls)
    assert rig.role.get_stats(sync=True).data["misses"] == 0


def test_host_backed_step_without_request_ids_is_refused(model_dir):
    """A forward (the step's mirror writes rows) with host-backed requests needs the batch
    order; a façade that drops vLLM's keyword arguments is refused by name."""
    rig = Rig(model_dir, num_blocks=200)
    rig.role.tracked.track("x", 0)
    from vllm_hisparse.core.commands import StepCommand, TransferKind, TransferSpec

    mirror = TransferSpec(transfer_id=1, kind=int(TransferKind.MIRROR), after_forward=True,
                          mirror_rows=[0], mirror_starts=[5], mirror_ends=[6])
    with pytest.raises(RuntimeError, match="request_ids"):
        rig.role.start_load_kv(HiSparseConnectorMetadata(command=StepCommand(step_id=0, transfers=[mirror])))
    with pytest.raises(RuntimeError, match="request_ids"):  # step inputs without the batch order
        rig.role.start_load_kv(HiSparseConnectorMetadata(command=StepCommand(step_id=0)),
                               scheduler_output=SimpleNamespace(num_scheduled_tokens={"x": 1}))


def test_a_step_without_a_forward_needs_no_request_ids(model_dir):
    """vLLM's no_forward() (every scheduled request waits for a load) calls start_load_kv
    with no step inputs. With host-backed requests alive that is not an error: nothing is
    read (``vllm-hisparse simulate`` stopped on it: 16 requests of 4096 + 512 tokens on
    280 blocks with a small host pool)."""
    rig = Rig(model_dir, num_blocks=200)
    rig.role.tracked.track("x", 0)
    from vllm_hisparse.core.commands import StepCommand

    rig.role.start_load_kv(HiSparseConnectorMetadata(command=StepCommand(step_id=0)))
    assert rig.role.step_view.ready and not rig.role.step_view.uses_residency
    rig.role.wait_for_save()


def test_prefill_of_host_only_context_is_refused(model_dir):
    """R1: prefill tokens of a request with host-only pages are refused with a clear error
    (a FULL request's prefill beside host-backed decodes is fine: tests/vllm/test_worker_prefill.py)."""
    rig = Rig(model_dir, num_blocks=200)
    rig.role.tracked.track("x", 0)
    executor = rig.role.lanes[0].executor
    executor.host_blocks[0, :3] = [5, 6, 7]
    executor.residency[0, :3] = [-1, 4, 8]
    from vllm_hisparse.core.commands import StepCommand

    out = SimpleNamespace(num_scheduled_tokens={"x": 300, "y": 1})
    with pytest.raises(RuntimeError, match=r"request 'x'.*host-only \(pages 0\).*R1"):
        rig.role.start_load_kv(HiSparseConnectorMetadata(command=StepCommand(step_id=0)),
                               request_ids=["x", "y"], scheduler_output=out)


def test_padded_batches_resolve_like_unpadded_ones(model_dir):
    """A FULL CUDA graph pads the batch: padding tokens map to batch row 0 (a real, maybe
    host-backed request) with whatever top-k, and the metadata counts them as actual tokens.
    The step's real token count (MRV2's ``num_tokens``, in the step view's buffer) keeps them
    out of the resolver (the reference would raise on their positions): reads exact, and every
    counter equals that of the same run unpadded."""
    counters = []
    for pad_to in (None, 8):
        rig = Rig(model_dir, num_blocks=200, policy_blocks=44, pad_to=pad_to)
        run_decode_loop(rig, steps=40)
        assert int(Residency.MIXED) in rig.residency_seen and rig.reads_checked > 0
        counters.append([s.counters() for lane in rig.role.lanes for s in lane.hot_states])
        rig.role.shutdown()
    assert counters[0] == counters[1] and counters[0][0][2] > 0


def test_forward_outside_a_step_changes_nothing(model_dir):
    """vLLM's graph capture, the warm-up before it and its dummy batches run the model with no
    step open. The conversion then takes the residency path (so that a capture records it)
    with an inert step view: vLLM's rows for every token, no hot-state or counter change. With
    the step's metadata bound but start_load_kv not run, attention is an error."""
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44)
    ids = [f"r{i}" for i in range(6)]
    for rid in ids:
        rig.add(rid)
    for rid in ids:
        rig.step({rid: 384}, attend=False)
    while int(Residency.MIXED) not in rig.residency_seen:
        rig.step({rid: 1 for rid in ids})
    group, lane, binding = rig.groups[0]
    state = binding.hot_state
    before = [t.clone() for t in (state.slot_pos, state.lru, state.stats, state.residency)]
    launches = binding.gather.launches
    table = torch.arange(len(ids) * 4, dtype=torch.int32).reshape(len(ids), 4)
    md = SimpleNamespace(req_id_per_token=torch.arange(len(ids), dtype=torch.int32),
                         block_table=table, block_size=BS, num_actual_tokens=len(ids))
    topk = torch.stack([rig.gen[r].select(256) for r in ids]).to(torch.int32)
    rows = group.convert_logical_to_physical_topk(0, topk, md, block_stride_rows=None,
                                                  return_valid_counts=False)
    assert torch.equal(rows, vllm_reference_conversion(md.req_id_per_token, table, topk, BS))
    assert all(torch.equal(a, b) for a, b in zip(before, (state.slot_pos, state.lru,
                                                          state.stats, state.residency)))
    assert binding.gather.launches > launches  # the residency path ran (a capture records it)
    rig.role.bind_step_metadata()  # vLLM bound the step's metadata: its forward is next
    with pytest.raises(RuntimeError, match="has_sync_kv_loads"):
        group.convert_logical_to_physical_topk(0, topk, md, block_stride_rows=None,
                                               return_valid_counts=False)
    rig.role.bind_step_metadata(False)
    rig.role.shutdown()


def test_unbound_groups_are_untouched(model_dir):
    Rig(model_dir, num_blocks=200)  # installs the hook
    group = make_group()
    assert getattr(group, BINDING_ATTR, None) is None
    md = SimpleNamespace(req_id_per_token=torch.tensor([0], dtype=torch.int32),
                         block_table=torch.tensor([[4, 9]], dtype=torch.int32), block_size=BS)
    topk = torch.full((1, TOP_K), -1, dtype=torch.int32)
    topk[0, :3] = torch.tensor([70, 3, -1])
    rows = group.convert_logical_to_physical_topk(0, topk, md, block_stride_rows=None,
                                                  return_valid_counts=False)
    assert rows[0, :3].tolist() == [9 * BS + 6, 4 * BS + 3, -1]
    assert hooked_conversion is not None


def test_record_trace_writes_host_backed_selections(model_dir, tmp_path):
    from vllm_hisparse.core.trace import SelectionTrace

    path = str(tmp_path / "trace.npz")
    rig = Rig(model_dir, num_blocks=200, policy_blocks=44, extra={"record_trace": path})
    run_decode_loop(rig, steps=60)
    rig.role.shutdown()
    trace = SelectionTrace.load(path)
    assert trace.num_records > 0 and trace.positions.size > 0
    assert trace.meta["top_k"] == TOP_K
    # Every index group is recorded (cross-layer prediction reads them all), numbered in
    # model layer order, at the same (request, step)s: each leader resolves the same tokens.
    assert trace.index_groups == (0, 1) and trace.meta["version"] == 2
    leaders = trace.meta["index_group_leaders"]
    assert [int(name.split(".")[2]) for name in leaders] == sorted(LEADERS)
    keys = [{(rid, step) for rid, steps, _ in trace.stepped_requests(g) for step in steps}
            for g in (0, 1)]
    assert keys[0] == keys[1] and keys[0]
