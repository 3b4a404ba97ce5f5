"""Mixed prefill + decode batches and prefill of residency-managed requests (CPU).

vLLM's sparse backends convert top-k either through the index group (hooked) or directly
with ``triton_convert_req_index_to_global_index`` from the batch block table
(``compat.DIRECT_CONVERSION_SITES``). Here the direct sites are driven as the backends call
them, inside the layer context ``patches.LAYER_FORWARD_CONTEXT`` sets, over vLLM's real KV
allocation and the core policy's commands. The Triton function is replaced by a pure-torch
twin with its exact signature (no Triton on CPU), as the simulator puts it in place:
``synthetic_attention.cpu_direct_twin``.

vLLM's worker block table is append-only: a page keeps the first block it was given even
after a restore moved it. :class:`PrefillRig` models that table, so a read that trusted it
for a residency-managed request would be caught.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from tests.vllm.test_worker_side import BS, TOP_K, Rig, model_dir  # noqa: F401 (fixture)
from vllm_hisparse.core import Residency
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.worker_side.read_path import vllm_reference_conversion
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata
from vllm_hisparse.vllm.simulation.synthetic_attention import cpu_direct_conversion, cpu_direct_twin
from vllm_hisparse.worker.synthetic import describe_row, kv_rows


@pytest.fixture(autouse=True)
def _cpu_direct_conversion():
    """The worker captures vLLM's function when it installs the routing: it wraps the twin,
    put in place as the simulator does for a CPU run."""
    from vllm.v1.attention.backends.mla import sparse_utils

    real = sparse_utils.triton_convert_req_index_to_global_index
    assert list(inspect.signature(cpu_direct_conversion).parameters) == \
        list(inspect.signature(real).parameters)
    with cpu_direct_twin():
        yield
    patches.TOPK_CONVERSION_HOOK.remove()


def _site(module_key: str):
    """The name a backend module calls (our wrapper once routed)."""
    import importlib

    module = next(m for m in compat.DIRECT_CONVERSION_SITES if m.endswith(module_key))
    return getattr(importlib.import_module(module), compat.DIRECT_CONVERSION_NAME)


class FakeSparseImpl:
    """Stands in for a bound layer's ``SparseMLACommonImpl``: its ``forward_mqa`` converts at
    a direct site exactly as ``FlashMLASparseImpl._forward_bf16_kv`` does for a batch with
    prefill tokens (``flashmla_sparse.py:914``)."""

    def __init__(self, group, index):
        self.index_group, self.index_group_index = group, index

    def forward_mqa(self, topk, stride, attn_metadata, layer):
        convert = _site("flashmla_sparse")
        return convert(attn_metadata.req_id_per_token[: topk.shape[0]],
                       attn_metadata.block_table, topk, BLOCK_SIZE=attn_metadata.block_size,
                       BLOCK_STRIDE_ROWS=stride, NUM_TOPK_TOKENS=topk.shape[1],
                       return_valid_counts=True)


class PrefillRig(Rig):
    """Rig with vLLM's append-only batch block table and mixed-batch attention."""

    def __init__(self, model_dir, **kw):
        super().__init__(model_dir, **kw)
        self.first_block: dict[tuple[str, int], int] = {}  # (rid, page) -> first lead block
        self.impls = [[FakeSparseImpl(group, i) for i in range(len(lane.units[lane.bindings.index(b)]))]
                      for group, lane, b in self.groups]
        for impls in self.impls:
            for impl in impls:
                assert patches.LAYER_FORWARD_CONTEXT.install(impl)
                assert not patches.LAYER_FORWARD_CONTEXT.install(impl)
        self.checked = {"decode": 0, "prefill": 0}
        self.divergent_reads = 0

    def vllm_table(self, lane, ranges):
        """vLLM's batch block table of ``lane``: the block each page was first given."""
        table = torch.zeros((len(ranges), self.role.max_pages), dtype=torch.int32)
        for b, (rid, *_rest) in enumerate(ranges):
            for page in range(self.role.max_pages):
                lead = self.first_block.get((rid, page))
                if lead is not None:
                    table[b, page] = self.bundles[lead][lane.sparse_index]
        return table

    def step_mixed(self, scheduled: dict[str, int], *, modes=("bf16",)):
        """Schedule, build vLLM's attention metadata, apply the step, write KV, attend.

        ``scheduled`` must list decode requests (1 token) first, as vLLM orders a batch."""
        ranges = []
        for rid, n in scheduled.items():
            row = self.policy.row_of(rid)
            start = int(self.policy.tables.num_tokens[row])
            assert self.policy.schedule(rid, n) == 0
            ranges.append((rid, row, start, start + n))
        cmd = self.policy.build_step()
        from tests.vllm.test_worker_side import shift_blocks

        cmd = shift_blocks(cmd, self.lead)
        # vLLM allocates new pages before the step: they enter its table with their block.
        for rid, row, start, end in ranges:
            for page in range(end // BS + 1):
                if (rid, page) not in self.first_block:
                    lead = self._policy_lead(row, page)
                    if lead is not None:
                        self.first_block[(rid, page)] = lead
        per_lane_md = {}
        metadata_by_layer = {}
        req_id = torch.cat([torch.full((e - s,), b, dtype=torch.int32)
                            for b, (_, _, s, e) in enumerate(ranges)])
        for lane in self.role.lanes:
            md = SimpleNamespace(req_id_per_token=req_id, block_table=self.vllm_table(lane, ranges),
                                 block_size=BS, num_actual_tokens=int(req_id.numel()),
                                 num_decode_tokens=sum(e - s == 1 for _, _, s, e in ranges))
            per_lane_md[lane.group_id] = md
            for name in lane.layer_names:
                metadata_by_layer[name] = md
        out = SimpleNamespace(num_scheduled_tokens=dict(scheduled))
        self.role.start_load_kv(HiSparseConnectorMetadata(command=cmd, bundles=self.bundles),
                                request_ids=[r[0] for r in ranges], scheduler_output=out,
                                attn_metadata=metadata_by_layer)
        for rid, row, start, end in ranges:
            self.write_kv(rid, row, start, end)
        topk = torch.cat([torch.stack([self.gen[rid].select(p + 1) for p in range(s, e)])
                          for rid, _, s, e in ranges]).to(torch.int32)
        for mode in modes:
            self.attend_direct(ranges, topk, per_lane_md, mode)
        self.role.wait_for_save()
        for rid in scheduled:
            self.residency_seen.add(int(self.policy.residency(rid)))
        self.deliver_acks()
        self.policy.check_invariants()
        return ranges, topk, per_lane_md

    def _policy_lead(self, row, page):
        block = int(self.policy.tables.device_block[row, page])
        return self.lead(block) if block >= 0 else None

    def attend_direct(self, ranges, topk, per_lane_md, mode):
        """Every layer converts at a direct site, as the chosen backend path does."""
        owner = [(rid, p, "decode" if e - s == 1 else "prefill")
                 for rid, _, s, e in ranges for p in range(s, e)]
        for (group, lane, binding), impls in zip(self.groups, self.impls):
            md = per_lane_md[lane.group_id]
            stride = lane.layout.block_stride_rows
            unit = lane.units[lane.bindings.index(binding)]
            for layer_index, (i, impl) in enumerate(zip(unit, impls)):
                if mode == "bf16":  # flashmla_sparse.py:914, through the routed forward_mqa
                    rows, counts = impl.forward_mqa(topk, stride, md, None)
                elif mode == "fp8_mixed":  # flashmla_sparse.py:1250 (uncompacted)
                    with patches.sparse_layer_context(group, layer_index, md):
                        rows = _site("flashmla_sparse")(
                            md.req_id_per_token[: topk.shape[0]], md.block_table, topk,
                            BLOCK_SIZE=BS, BLOCK_STRIDE_ROWS=stride,
                            NUM_TOPK_TOKENS=topk.shape[1])
                    rows, counts = _compact(rows)
                elif mode == "common":  # sparse_mla_attention.py:773 (FlashInfer/FA sparse)
                    with patches.sparse_layer_context(group, layer_index, md):
                        rows, counts = _site("sparse_mla_attention")(
                            md.req_id_per_token[: topk.shape[0]], md.block_table, topk,
                            BLOCK_SIZE=BS, BLOCK_STRIDE_ROWS=stride,
                            NUM_TOPK_TOKENS=topk.shape[1], return_valid_counts=True)
                else:
                    raise AssertionError(mode)
                self.check(lane, i, rows, counts, topk, owner)

    def check(self, lane, i, rows, counts, topk, owner):
        view = lane.device_layers[i]
        layer = self.layer_ids[(lane.group_id, i)]
        for t, (rid, pos, kind) in enumerate(owner):
            want_pos = topk[t][topk[t] >= 0]
            n = int(counts[t])
            assert n == want_pos.numel()
            got = view[rows[t, :n].to(torch.int64)]
            want = kv_rows(self.serial[rid], want_pos, layer, view.shape[1])
            bad = (got != want).any(dim=1).nonzero().flatten()
            assert bad.numel() == 0, (f"{rid} token {pos} layer {layer}: position "
                                      f"{int(want_pos[bad[0]])} read {describe_row(got[bad[0]])}")
            self.checked[kind] += n


def _compact(rows):
    valid = rows >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    return torch.gather(rows, 1, order), valid.sum(dim=1, dtype=torch.int32)


def warm_up(rig, ids, prompt=384):
    for rid in ids:
        rig.add(rid)
    for rid in ids:
        rig.step_mixed({rid: prompt}, modes=())


def pressure_until_mixed(rig, live, steps=40):
    """Decode steps until some request is MIXED (policy pressure)."""
    for _ in range(steps):
        rig.step_mixed({rid: 1 for rid in live})
        mixed = [r for r in live if rig.policy.residency(r) != Residency.FULL]
        if mixed:
            return mixed
    raise AssertionError("pressure never made a request MIXED")


# ------------------------------------------------------------------------------ tests


def test_mixed_batch_host_backed_decodes_beside_full_prefills(model_dir):  # noqa: F811
    """Decode tokens of MIXED requests resolve through the hot state while FULL requests
    prefill in the same batch, at every direct site (bf16, fp8 mixed, generic)."""
    rig = PrefillRig(model_dir, num_blocks=200, policy_blocks=44)
    ids = [f"r{i}" for i in range(6)]
    warm_up(rig, ids)
    mixed = pressure_until_mixed(rig, ids)
    rig.add("p")
    rig.role.get_stats(sync=True)
    for mode in ("bf16", "fp8_mixed", "common"):
        rig.step_mixed({**{rid: 1 for rid in ids}, "p": 48}, modes=(mode,))
        assert rig.policy.residency("p") == Residency.FULL
    assert any(rig.policy.residency(r) != Residency.FULL for r in mixed)
    assert rig.checked["decode"] > 0 and rig.checked["prefill"] > 0
    stats = rig.role.get_stats(sync=True)
    assert stats is not None and stats.data["hot_hits"] + stats.data["misses"] > 0


def test_prefill_of_previously_mixed_request_reads_its_context(model_dir):  # noqa: F811
    """A request that went MIXED and was promoted back (restores into new blocks, which
    vLLM's append-only table does not know) prefills a chunk: the routed conversion and
    the rewritten batch block table both name the right rows."""
    rig = PrefillRig(model_dir, num_blocks=200, policy_blocks=44)
    ids = [f"r{i}" for i in range(6)]
    warm_up(rig, ids)
    mixed = pressure_until_mixed(rig, ids)
    target = mixed[0]
    live = [r for r in ids if r != target]
    for rid in live[:3]:  # relieve the pressure: the policy promotes `target` again
        rig.policy.finish(rid)
    live = live[3:]
    for _ in range(60):
        rig.step_mixed({rid: 1 for rid in [*live, target]})
        if rig.policy.residency(target) == Residency.FULL:
            break
    assert rig.policy.residency(target) == Residency.FULL
    assert target in rig.role.tracked  # still residency-managed
    ranges, topk, per_lane_md = rig.step_mixed({**{rid: 1 for rid in live}, target: 100},
                                               modes=("bf16", "common"))
    b = [r[0] for r in ranges].index(target)
    _, row, start, end = ranges[b]
    # The batch block table row was rewritten from the worker's residency: a kernel that
    # reads the table (dense / masked MHA, the fp8 upconvert workspace) gets the right KV.
    diverged = 0
    for lane in rig.role.lanes:
        md = per_lane_md[lane.group_id]
        res = lane.executor.residency[row, : (end - 1) // BS + 1]
        assert (res >= 0).all()
        assert md.block_table[b, : res.size].tolist() == (res // lane.layout.block_scale).tolist()
        first = torch.as_tensor([rig.bundles[rig.first_block[(target, p)]][lane.sparse_index]
                                 for p in range(res.size)])
        diverged += int((first != md.block_table[b, : res.size]).sum())
        t0 = sum(r[3] - r[2] for r in ranges[:b])
        tok = topk[t0:t0 + end - start]
        rows = vllm_reference_conversion(torch.zeros(tok.shape[0], dtype=torch.int32),
                                         md.block_table[b:b + 1], tok, BS,
                                         lane.layout.block_stride_rows)
        for i, view in enumerate(lane.device_layers):
            for t in range(tok.shape[0]):
                sel = tok[t] >= 0
                got = view[rows[t][sel].to(torch.int64)]
                want = kv_rows(rig.serial[target], tok[t][sel], rig.layer_ids[(lane.group_id, i)],
                               view.shape[1])
                assert torch.equal(got, want)
    assert diverged > 0, "the promotion never moved a page: the test proves nothing"
    assert rig.checked["prefill"] > 0


def test_prefill_of_host_backed_request_is_refused_by_r1(model_dir):  # noqa: F811
    """R1 violated (prefill tokens for a request with host-only pages): a clear error
    before the forward instead of attention reading null or reused blocks."""
    rig = PrefillRig(model_dir, num_blocks=200, policy_blocks=44)
    ids = [f"r{i}" for i in range(6)]
    warm_up(rig, ids)
    pressure_until_mixed(rig, ids)
    executor = rig.role.lanes[0].executor

    def host_only(rid):
        row = rig.policy.row_of(rid)
        return bool(((executor.host_blocks[row] >= 0) & (executor.residency[row] < 0)).any())

    for _ in range(40):
        if any(host_only(r) for r in ids):
            break
        rig.step_mixed({r: 1 for r in ids})
    target = next(r for r in ids if host_only(r))
    with pytest.raises(RuntimeError, match=rf"request '{target}'.*host-only.*R1"):
        rig.step_mixed({**{r: 1 for r in ids if r != target}, target: 50})


def test_workspace_tokens_keep_vllms_offsets(model_dir):  # noqa: F811
    """fp8 separate prefill/decode (``flashmla_sparse.py:1047``): prefill tokens map into
    vLLM's upconvert workspace and keep vLLM's offsets; tracked decodes get resolved rows."""
    rig = PrefillRig(model_dir, num_blocks=200, policy_blocks=44)
    ids = [f"r{i}" for i in range(6)]
    warm_up(rig, ids)
    pressure_until_mixed(rig, ids)
    rig.add("p")
    ranges, topk, per_lane_md = rig.step_mixed({**{r: 1 for r in ids}, "p": 40}, modes=("bf16",))
    # Re-run a layer's conversion at the workspace site within the same step view.
    group, lane, binding = rig.groups[0]
    md = per_lane_md[lane.group_id]
    n_dec = len(ids)
    ws_ids = torch.tensor([-1] * n_dec + [0] * 40, dtype=torch.int32)
    starts = torch.tensor([1000], dtype=torch.int32)
    rig.role.step_view.ready = True  # the step is over; reopen its view for a follower call
    try:
        with patches.sparse_layer_context(group, 1, md):
            rows, counts = _site("flashmla_sparse")(
                md.req_id_per_token[: topk.shape[0]], md.block_table, topk, BLOCK_SIZE=BS,
                BLOCK_STRIDE_ROWS=lane.layout.block_stride_rows, NUM_TOPK_TOKENS=TOP_K,
                HAS_PREFILL_WORKSPACE=True, prefill_workspace_request_ids=ws_ids,
                prefill_workspace_starts=starts, return_valid_counts=True)
    finally:
        rig.role.step_view.ready = False
    want = 1000 + topk[n_dec:]
    assert rows[n_dec:].tolist() == torch.where(want >= 1000, want, -1).tolist()
    leader_rows, token_rows = binding.leader_rows(topk.shape[0])
    vllm_rows = cpu_direct_conversion(md.req_id_per_token[: topk.shape[0]], md.block_table,
                                        topk, BLOCK_SIZE=BS,
                                        BLOCK_STRIDE_ROWS=lane.layout.block_stride_rows,
                                        NUM_TOPK_TOKENS=TOP_K, return_valid_counts=True)[0]
    tracked = token_rows[:n_dec] >= 0
    assert tracked.any() and not tracked.all()
    for t in range(n_dec):
        want_t = _compact(leader_rows[t:t + 1])[0][0] if tracked[t] else vllm_rows[t]
        assert rows[t].tolist() == want_t.tolist()


def test_full_only_batches_take_vllms_direct_conversion_unchanged(model_dir):  # noqa: F811
    rig = PrefillRig(model_dir, num_blocks=200)  # no pressure: everything stays FULL
    resolves = []
    for _, _, binding in rig.groups:
        original = binding.hot_state.resolve
        binding.hot_state.resolve = lambda *a, _o=original, **k: resolves.append(1) or _o(*a, **k)
    warm_up(rig, ["a", "b"], prompt=200)
    rig.add("c")
    ranges, topk, per_lane_md = rig.step_mixed({"a": 1, "b": 1, "c": 64},
                                               modes=("bf16", "fp8_mixed", "common"))
    assert not rig.role.step_view.uses_residency and not resolves
    assert rig.residency_seen == {int(Residency.FULL)}
    # And the direct site's result is vLLM's, out/valid_counts_out included.
    group, lane, _ = rig.groups[0]
    md = per_lane_md[lane.group_id]
    out = torch.empty_like(topk)
    cnt = torch.empty(topk.shape[0], dtype=torch.int32)
    rig.role.step_view.ready = True
    try:
        with patches.sparse_layer_context(group, 0, md):
            got = _site("flashmla_sparse")(md.req_id_per_token[: topk.shape[0]], md.block_table,
                                           topk, BLOCK_SIZE=BS, NUM_TOPK_TOKENS=TOP_K,
                                           return_valid_counts=True, out=out,
                                           valid_counts_out=cnt)
    finally:
        rig.role.step_view.ready = False
    want = cpu_direct_conversion(md.req_id_per_token[: topk.shape[0]], md.block_table, topk,
                                   BLOCK_SIZE=BS, NUM_TOPK_TOKENS=TOP_K, return_valid_counts=True)
    assert got[0] is out and got[1] is cnt
    assert torch.equal(out, want[0]) and torch.equal(cnt, want[1])


def test_unbound_layers_and_no_context_call_vllm(model_dir):  # noqa: F811
    PrefillRig(model_dir, num_blocks=200)
    assert patches.DIRECT_CONVERSION_ROUTING.installed()
    req = torch.tensor([0], dtype=torch.int32)
    table = torch.tensor([[4, 9]], dtype=torch.int32)
    topk = torch.full((1, TOP_K), -1, dtype=torch.int32)
    topk[0, :2] = torch.tensor([70, 3])
    convert = _site("flashinfer_mla_sparse_sm90")
    want = cpu_direct_conversion(req, table, topk, BLOCK_SIZE=BS, NUM_TOPK_TOKENS=TOP_K)
    assert torch.equal(convert(req, table, topk, BLOCK_SIZE=BS, NUM_TOPK_TOKENS=TOP_K), want)
    unbound = SimpleNamespace()  # an index group without a binding
    with patches.sparse_layer_context(unbound, 0, SimpleNamespace(num_actual_tokens=1)):
        assert torch.equal(convert(req, table, topk, BLOCK_SIZE=BS, NUM_TOPK_TOKENS=TOP_K), want)


def test_get_stats_never_reads_counters_synchronously(model_dir):  # noqa: F811
    rig = PrefillRig(model_dir, num_blocks=200, policy_blocks=44)
    ids = [f"r{i}" for i in range(6)]
    warm_up(rig, ids)
    pressure_until_mixed(rig, ids)
    rig.role.get_stats(sync=True)
    states = [s for lane in rig.role.lanes for s in lane.hot_states]
    baseline = sum(int(s.stats.sum()) for s in states)
    reader = rig.role._counter_reader
    calls = []
    for state in states:
        orig = state.counters
        state.counters = lambda _o=orig: calls.append(1) or _o()
    rig.step_mixed({r: 1 for r in ids})
    first = rig.role.get_stats()  # queues a snapshot; this step's resolves are not in yet
    rig.step_mixed({r: 1 for r in ids})
    second = rig.role.get_stats()  # reports the first snapshot
    assert not calls  # HotState.counters() (a sync on CUDA) is never called
    assert reader.num_snapshots >= 2

    def lookups(stats):
        return 0 if stats is None else sum(stats.data[k] for k in ("resident", "hot_hits", "misses"))

    assert lookups(first) == 0 and lookups(second) > 0
    rest = rig.role.get_stats(sync=True)
    assert lookups(second) + lookups(rest) == sum(int(s.stats.sum()) for s in states) - baseline
