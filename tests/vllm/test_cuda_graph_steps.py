"""Decode steps through the attention hook under CUDA-graph capture and replay
(``cudagraph_mode`` FULL_AND_PIECEWISE / FULL), on the harness of ``vllm-hisparse bench graphs``
(``vllm_hisparse/cli/benchmarks/graphs.py``: fixed input buffers, padded batches, the worker's
step view, hot states and bindings, a stand-in index group whose own conversion is the torch
twin of vLLM's).

On CPU: the capture-safety contract (fixed buffer addresses, padding inert, no state change
outside a step). With ``-m gpu``: one graph captured outside any step and replayed step after
step resolves exactly what eager steps resolve, and a kernel error in a replay is raised by the
next poll. This module imports no vLLM, so it runs on the GPU machine
(``python3 -m pytest --noconftest -m gpu tests/vllm/test_cuda_graph_steps.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_hisparse.cli.benchmarks.graphs import GraphStepSpec, HookedDecodeStep
from vllm_hisparse.ops import ResolveError, ResolveErrorCode
from vllm_hisparse.vllm.worker_side.read_path import BINDING_ATTR
from vllm_hisparse.worker.hot_state import HotState

CPU_SPEC = GraphStepSpec(batch=6, requests=4, topk=32, hot_rows=64, block_size=16, context=512,
                         layers=4, index_group_layers=2, row_bytes=32, resident_every=4,
                         full_every=3, steps=10)
GPU_SPEC = GraphStepSpec(batch=16, requests=12, topk=256, hot_rows=512, block_size=64,
                         context=4096, layers=4, index_group_layers=2, resident_every=4,
                         full_every=4, steps=12)


def step_buffers(rig: HookedDecodeStep) -> dict[str, int]:
    """Addresses of every buffer a captured step reads or writes."""
    named = {"step_table": rig.step_view._table, "token_index": rig.step_view._token_index,
             "topk": rig.topk, "req_id": rig.req_id, "block_table": rig.block_table}
    for g, state in enumerate(rig.states):
        for name in ("residency", "host_blocks", "hot_blocks", "slot_pos", "lru", "stats"):
            named[f"{name}{g}"] = getattr(state, name)
        for field in dataclasses.fields(state._result):
            named[f"{field.name}{g}"] = getattr(state._result, field.name)
    return {name: t.data_ptr() for name, t in named.items()}


def hot_state(rig: HookedDecodeStep) -> list[torch.Tensor]:
    return [t.clone() for s in rig.states for t in (s.slot_pos, s.lru, s.stats)]


def test_steps_keep_every_buffer_in_place_and_read_ground_truth():
    """Batches of 2-4 real requests in random order, padded to 6 tokens: every row read is the
    ground truth, every buffer keeps its address from the warm-up on, one result buffer set
    per index group (the graph's shape)."""
    rig = HookedDecodeStep(CPU_SPEC, "cpu")
    try:
        rig.forward()  # what vLLM runs before a capture: outside a step
        before = step_buffers(rig)
        for step in range(len(rig.plan)):
            rig.load(step)
            rig.forward()
            rig.step_view.end()
            assert rig.check_reads(step) > 0
        assert step_buffers(rig) == before
        assert all(not s._retired for s in rig.states)
        resident, hits, misses = rig.states[0].counters()
        assert resident > 0 and hits > 0 and misses > 0
    finally:
        rig.close()


def test_one_output_storage_serves_every_batch_size():
    """vLLM warms up and captures its graphs largest batch first: resolve's outputs for a
    smaller batch are the first rows of the same storage. A larger batch later gets a new
    storage; the old one is kept (graphs captured on it still write it)."""
    state = HotState(2, 4, 16, 4)
    topk = torch.full((8, 4), -1, dtype=torch.int32)
    rows = torch.full((8,), -1, dtype=torch.int32)
    big = state.resolve(topk, rows)
    small = state.resolve(topk[:3], rows[:3])
    assert small.out_rows.data_ptr() == big.out_rows.data_ptr() and small.out_rows.shape[0] == 3
    assert small.miss_count.data_ptr() == big.miss_count.data_ptr() and not state._retired
    grown = state.resolve(torch.full((9, 4), -1, dtype=torch.int32),
                          torch.full((9,), -1, dtype=torch.int32))
    assert grown.out_rows.data_ptr() != big.out_rows.data_ptr()
    assert state._retired[0].out_rows.data_ptr() == big.out_rows.data_ptr()


def test_forward_outside_a_step_is_inert():
    """Between steps the view is inert: a forward (capture, warm-up, dummy batch) returns
    vLLM's rows, copies nothing, changes no hot state or counter."""
    rig = HookedDecodeStep(CPU_SPEC, "cpu")
    try:
        for step in range(4):
            rig.load(step)
            rig.forward()
            rig.step_view.end()
        before = hot_state(rig)
        kv = [t.clone() for t in rig.kv]
        rig.forward()
        assert all(torch.equal(a, b) for a, b in zip(before, hot_state(rig)))
        assert all(torch.equal(a, b) for a, b in zip(kv, rig.kv))
        for group, _ in rig.groups:  # nothing resolved: every token took vLLM's row
            assert (getattr(group, BINDING_ATTR).leader_rows(CPU_SPEC.batch)[0] == -1).all()
        assert not rig.step_view.ready and (rig.step_view._table == -1).all()
    finally:
        rig.close()


def test_padding_is_what_the_real_token_count_keeps_out():
    """The same step without the real token count: the padding tokens (batch row 0, a
    position no request has) reach the resolver, which rejects them. So the inertness above
    is the count's doing, not an accident of the inputs."""
    rig = HookedDecodeStep(CPU_SPEC, "cpu", vary_batch=False)
    try:
        inputs = rig.plan[0]
        assert len(inputs.order) < CPU_SPEC.batch and inputs.state_rows[0] >= 0
        rig.load(0)
        rig.step_view.begin(0, inputs.state_rows, None)
        with pytest.raises(ResolveError, match="POSITION_OUT_OF_RANGE|NOT_CONTIGUOUS"):
            rig.forward()
    finally:
        rig.close()


def capture(rig: HookedDecodeStep) -> "torch.cuda.CUDAGraph":
    """One forward captured outside any step, after the eager warm-up (what vLLM does)."""
    rig.forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rig.forward()
    return graph


@pytest.mark.gpu
@pytest.mark.parametrize("group_layers,scores,inline", [
    (2, False, False), (1, False, False), (2, True, False), (2, False, True)],
    ids=["groups-of-2", "groups-of-1", "score-eviction", "inline-conversion"])
def test_graph_replay_resolves_exactly_what_eager_steps_resolve(group_layers, scores, inline):
    """Eager steps, then the same steps as one graph captured outside any step (after the
    warm-up) and replayed: identical rows every step, every read row the ground truth,
    identical hot state and counters at the end; a step (inputs, view, replay) allocates
    nothing. With score eviction the slot classes are computed inside the graph too. The
    leaders convert on their groups' side streams (or inline): the side streams are joined
    inside the graph."""
    spec = dataclasses.replace(GPU_SPEC, index_group_layers=group_layers, score_eviction=scores,
                               hot_rows=GPU_SPEC.hot_rows // 2 if scores else GPU_SPEC.hot_rows,
                               inline_conversion=inline)
    rig = HookedDecodeStep(spec, "cuda")
    try:
        eager, _ = rig.run("eager", check=True)
        eager_state = hot_state(rig)
        graph, _ = rig.run("graph", check=True)
        for step, (a, b) in enumerate(zip(eager, graph)):
            for g, (x, y) in enumerate(zip(a, b)):
                assert torch.equal(x, y), f"step {step} index group {g}"
        assert all(torch.equal(a, b) for a, b in zip(eager_state, hot_state(rig)))
        _, hits, misses = rig.states[0].counters()
        assert hits > 0 and misses > 0
        if scores:  # the classes were used: some slot is above class 0
            assert all(int(s.slot_class.max()) > 0 for s in rig.states)
        assert all(s.side_work is None for s in rig.states)  # joined inside the graph
        assert all((b.conversion is None) == inline for b in rig.bindings)
        if not inline:
            assert all(b.conversion.conversions > 0 for b in rig.bindings)
        replay = capture(rig)
        allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
        for step in range(3):
            rig.load(step)
            replay.replay()
            rig.step_view.end()
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    finally:
        rig.close()


@pytest.mark.gpu
def test_kernel_error_in_a_replay_is_raised_by_the_next_poll():
    """A replay never returns to the op wrapper that raises recorded kernel errors: the worker
    polls the record at its next start_load_kv (HotState.poll_errors), without a sync."""
    rig = HookedDecodeStep(dataclasses.replace(GPU_SPEC, steps=2), "cuda", vary_batch=False)
    try:
        graph = capture(rig)
        inputs = rig.plan[0]
        bad = inputs.topk.clone()
        t = next(i for i, r in enumerate(inputs.state_rows) if r >= 0)
        bad[t, 0] = GPU_SPEC.context  # one past the request's last position
        rig.plan[0] = dataclasses.replace(inputs, topk=bad)
        rig.load(0)
        graph.replay()
        rig.step_view.end()
        torch.cuda.synchronize()
        with pytest.raises(ResolveError) as err:
            rig.states[0].poll_errors()
        assert err.value.code == ResolveErrorCode.POSITION_OUT_OF_RANGE
        assert err.value.state_row == inputs.state_rows[t]
        assert err.value.detail_a == GPU_SPEC.context
        rig.states[0].poll_errors()  # raised once
    finally:
        rig.close()
