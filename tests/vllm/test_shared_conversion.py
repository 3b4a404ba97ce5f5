"""An index group's conversion done once and shared, where vLLM does it: the followers take
the leader's final rows, and the leader converts on the group's side stream."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.vllm.worker_side.conversion_stream import ConversionStream
from vllm_hisparse.vllm.worker_side.read_path import (BINDING_ATTR, IndexGroupResidency,
                                                      hooked_conversion,
                                                      vllm_reference_conversion)
from vllm_hisparse.vllm.worker_side.step_view import StepView
from vllm_hisparse.worker.device_rows import DeviceRowLayout
from vllm_hisparse.worker.hot_state import HotState
from vllm_hisparse.worker.synthetic import kv_rows

BS, K, ROW, LAYERS = 4, 4, 16, 3
PAGES, REQS = 4, 3


def group_of(device="cpu", gather_mode="side"):
    """A three-layer index group of three requests: batch row 0 FULL (blocks 20..23), batch
    rows 1 and 2 tracked (state rows 1, 2) with pages 0-1 host-only and 2-3 resident."""
    state = HotState(REQS, PAGES, 2 * BS, BS, device,
                     ops_backend="reference" if device == "cpu" else "auto")
    dev = [torch.zeros((40 * BS, ROW), dtype=torch.uint8, device=device) for _ in range(LAYERS)]
    host = [torch.zeros((16 * BS, ROW), dtype=torch.uint8, device=device)
            for _ in range(LAYERS)]
    for r in (1, 2):
        state.set_pages([r] * PAGES, list(range(PAGES)), [-1, -1, 4 * r, 4 * r + 1])
        state.set_host_blocks([r] * PAGES, list(range(PAGES)), [4 * r + p for p in range(PAGES)])
        state.lease_hot_region(r, [28 + 2 * r, 29 + 2 * r])
        for l in range(LAYERS):
            host[l][4 * r * BS:(4 * r + 2) * BS] = kv_rows(r, torch.arange(0, 8), l, ROW)
            dev[l][4 * r * BS:(4 * r + 2) * BS] = kv_rows(r, torch.arange(8, 16), l, ROW)
    step = StepView(4, device)
    binding = IndexGroupResidency(state, host, dev, DeviceRowLayout(BS, BS), step,
                                  gather_mode=gather_mode,
                                  gather_chunks=(1, 1, 1) if gather_mode == "side" else None)
    group = SimpleNamespace(**{BINDING_ATTR: binding})
    i32 = dict(dtype=torch.int32, device=device)
    md = SimpleNamespace(req_id_per_token=torch.tensor([0, 1, 2], **i32),
                         block_table=torch.tensor([[20, 21, 22, 23], [0] * 4, [0] * 4], **i32),
                         block_size=BS, num_actual_tokens=3)
    return binding, group, step, dev, md


def vllm_method(layer_index, logical_topk, md, *, block_stride_rows, return_valid_counts):
    raise AssertionError("vLLM's conversion must not run in a step with tracked requests")


def convert_group(group, topk, md, strides=(None, None, None)):
    return [hooked_conversion(group, vllm_method, layer, topk, md, block_stride_rows=stride,
                              return_valid_counts=True)
            for layer, stride in zip(range(LAYERS), strides)]


def check_rows(result, topk, md, dev, layer):
    """Every selection's row holds that position's bytes in ``layer``; FULL rows are vLLM's."""
    rows, counts = result
    for t in range(3):
        want = topk[t][topk[t] >= 0]
        got = rows[t, :int(counts[t])]
        assert got.numel() == want.numel()
        if t == 0:
            vllm = vllm_reference_conversion(md.req_id_per_token, md.block_table, topk, BS)
            assert got.tolist() == vllm[0][vllm[0] >= 0].tolist()
        else:
            assert torch.equal(dev[layer][got.long()].cpu(), kv_rows(t, want.cpu(), layer, ROW))


def test_followers_share_the_leaders_rows():
    binding, group, step, dev, md = group_of()
    topk = torch.tensor([[1, 5, 9, -1], [0, 3, 9, 12], [7, 8, 14, 2]], dtype=torch.int32)
    step.begin(0, [-1, 1, 2])
    results = convert_group(group, topk, md)
    assert results[1] is results[0] and results[2] is results[0]
    for layer, result in enumerate(results):  # each layer's misses are in place by then
        check_rows(result, topk, md, dev, layer)


def test_a_follower_that_converts_otherwise_merges_itself():
    """Another row space (a dense page-tensor kernel) or another top-k tensor: its own merge,
    with its own values."""
    binding, group, step, dev, md = group_of()
    topk = torch.tensor([[1, 5, 9, -1], [0, 3, 9, 12], [7, 8, 14, 2]], dtype=torch.int32)
    step.begin(0, [-1, 1, 2])
    results = convert_group(group, topk, md, strides=(None, 2 * BS, None))
    assert results[1] is not results[0] and results[2] is results[0]
    wide = results[1][0]
    dense = torch.where(wide >= 0, wide // (2 * BS) * BS + wide % (2 * BS), -1)
    assert torch.equal(dense, results[0][0])
    step.begin(1, [-1, 1, 2])
    leader = hooked_conversion(group, vllm_method, 0, topk, md, block_stride_rows=None,
                               return_valid_counts=True)
    other = hooked_conversion(group, vllm_method, 1, topk.clone(), md, block_stride_rows=None,
                              return_valid_counts=True)
    assert other is not leader and torch.equal(other[0], leader[0])


def test_the_next_leader_conversion_replaces_the_shared_rows():
    binding, group, step, dev, md = group_of()
    step.begin(0, [-1, 1, 2])
    first = convert_group(group, torch.tensor([[1, 5, 9, -1], [0, 3, 9, 12], [7, 8, 14, 2]],
                                              dtype=torch.int32), md)
    step.begin(1, [-1, 1, 2])
    topk = torch.tensor([[2, 6, -1, -1], [4, 5, 1, 10], [6, 0, 15, -1]], dtype=torch.int32)
    second = convert_group(group, topk, md)
    assert second[0] is not first[0] and second[1] is second[0]
    for layer, result in enumerate(second):
        check_rows(result, topk, md, dev, layer)


class FakeStream:
    """Stands in for a CUDA stream on CPU: records what is asked of it, in order."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_event(self, event):
        self.log.append((self.name, "wait_event", event))

    def wait_stream(self, other):
        self.log.append((self.name, "wait_stream", other.name))

    def __enter__(self):
        self.log.append((self.name, "enter"))

    def __exit__(self, *exc):
        self.log.append((self.name, "exit"))


class FakeEvent:
    def __init__(self, log):
        self.log = log

    def record(self, stream):
        self.log.append(("done", "record", stream.name))


def fake_conversion(log, ready):
    compute, side = FakeStream("compute", log), FakeStream("side", log)
    return ConversionStream(side, lambda: ready, "cpu", compute_stream=lambda: compute,
                            done=FakeEvent(log), stream_context=lambda stream: stream)


@pytest.mark.parametrize("ready", ["topk_ready", None])
def test_conversion_stream_starts_at_the_topk_and_the_compute_stream_waits(ready):
    log = []
    conversion = fake_conversion(log, ready)
    with conversion.running():
        log.append(("body",))
    start = ("side", "wait_event", "topk_ready") if ready else ("side", "wait_stream", "compute")
    done = log[-1][2]
    assert log == [start, ("side", "enter"), ("body",), ("side", "exit"),
                   ("done", "record", "side"), ("compute", "wait_event", done)]
    assert conversion.conversions == 1


def test_conversion_stream_switches_streams_where_vllm_sees_it(monkeypatch):
    """The side stream is made current through ``torch.cuda.stream`` (whose enter and exit
    call the ``torch.cuda.set_stream`` vLLM wraps to track the current stream), not through
    the stream's own context, which vLLM does not see (module docstring; the GPU test below
    shows what went wrong)."""
    log = []

    class TrackedContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.append(("torch.cuda.stream", "enter", self.stream.name))

        def __exit__(self, *exc):
            log.append(("torch.cuda.stream", "exit", self.stream.name))

    monkeypatch.setattr(torch.cuda, "stream", TrackedContext)
    compute, side = FakeStream("compute", log), FakeStream("side", log)
    conversion = ConversionStream(side, lambda: "topk_ready", "cpu",
                                  compute_stream=lambda: compute, done=FakeEvent(log))
    with conversion.running():
        log.append(("body",))
    assert log[1:4] == [("torch.cuda.stream", "enter", "side"), ("body",),
                        ("torch.cuda.stream", "exit", "side")]


def test_conversion_stream_joins_the_compute_stream_after_an_error():
    log = []
    conversion = fake_conversion(log, "topk_ready")
    with pytest.raises(RuntimeError, match="boom"):
        with conversion.running():
            raise RuntimeError("boom")
    assert log[-2:] == [("done", "record", "side"), ("compute", "wait_event", log[-1][2])]


def test_only_the_leader_converts_on_the_side_stream():
    binding, group, step, dev, md = group_of()
    log = []
    binding.attach(group, fake_conversion(log, "topk_ready"))
    calls = []
    resolve = binding.resolve_leader
    binding.resolve_leader = lambda *a: (calls.append(len(log)), resolve(*a))[1]
    topk = torch.tensor([[1, 5, 9, -1], [0, 3, 9, 12], [7, 8, 14, 2]], dtype=torch.int32)
    step.begin(0, [-1, 1, 2])
    results = convert_group(group, topk, md)
    # the resolve ran inside the side-stream context, once; the followers added nothing
    assert calls == [2] and [e[:2] for e in log].count(("side", "enter")) == 1
    assert binding.conversion.conversions == 1
    for layer, result in enumerate(results):
        check_rows(result, topk, md, dev, layer)


@pytest.mark.gpu
@pytest.mark.parametrize("gather_mode", ["side", "single"])
def test_side_stream_conversion_equals_the_inline_one_on_cuda(gather_mode):
    """On the GPU, eagerly and replayed from a CUDA graph: the leader on its own side stream
    (started from an event the "indexer" records, as vLLM's model does) gives the rows and
    copies of the inline path, step after step, with the compute stream busy meanwhile."""
    dev_name = "cuda"
    runs = {}
    for overlap in (False, True):
        binding, group, step, dev, md = group_of(dev_name, gather_mode)
        ready = torch.Event(device=dev_name)
        if overlap:
            binding.attach(group, ConversionStream(torch.cuda.Stream(), lambda: ready,
                                                   torch.device(dev_name)))
        topk = torch.empty((3, K), dtype=torch.int32, device=dev_name)
        busy = torch.randn((2048, 2048), device=dev_name)
        g = torch.Generator().manual_seed(0)
        seen = []

        def forward():
            ready.record(torch.cuda.current_stream())
            busy.matmul(busy)  # what the compute stream does before attention
            return convert_group(group, topk, md)

        for s in range(6):
            step.begin(s, [-1, 1, 2])
            topk.copy_(torch.stack([torch.randperm(16, generator=g)[:K] for _ in range(3)])
                       .to(torch.int32))
            results = forward()
            for layer, result in enumerate(results):
                check_rows(result, topk, md, dev, layer)
            seen.append([r[0].cpu() for r in results])
        graph = torch.cuda.CUDAGraph()
        step.end()
        forward()  # warm-up, view inert
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = forward()
        for s in range(6, 10):
            step.begin(s, [-1, 1, 2])
            topk.copy_(torch.stack([torch.randperm(16, generator=g)[:K] for _ in range(3)])
                       .to(torch.int32))
            graph.replay()
            for layer, result in enumerate(out):
                check_rows(result, topk, md, dev, layer)
            seen.append([r[0].cpu() for r in out])
            step.end()
        runs[overlap] = seen
    for a, b in zip(runs[False], runs[True]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
def test_vllms_tracked_stream_survives_a_captured_side_stream_conversion(monkeypatch):
    """vLLM wraps ``torch.cuda.set_stream`` to track the current stream, and its model records
    each indexer's ready event on that stream. Under a capture the followers' gathers are
    issued inside the leader's side-stream conversion (``GroupGather.launch``). When the
    conversion was entered with the stream's own context, that issue left the tracker on the
    side stream: the next index group's ready event was recorded there, and its conversion
    ran before its indexer's top-k landed (GLM-5.2's second group resolved the previous step's
    top-k in every replay). After the conversion the tracker names the real current stream."""
    tracked = []
    real_set_stream = torch.cuda.set_stream

    def tracking_set_stream(stream):  # what vllm/utils/torch_utils.py installs
        tracked.append(stream)
        real_set_stream(stream)

    monkeypatch.setattr(torch.cuda, "set_stream", tracking_set_stream)
    binding, group, step, dev, md = group_of("cuda", "side")
    ready = torch.Event(device="cuda")
    side = torch.cuda.Stream()
    binding.attach(group, ConversionStream(side, lambda: ready, torch.device("cuda")))
    topk = torch.tensor([[1, 5, 9, -1], [0, 3, 9, 12], [7, 8, 14, 2]], dtype=torch.int32,
                        device="cuda")

    def forward():
        ready.record(torch.cuda.current_stream())
        out = convert_group(group, topk, md)
        assert tracked[-1] == torch.cuda.current_stream() != side
        return out

    forward()  # warm-up, view inert
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    assert binding.gather.launches > 0 and binding.conversion.conversions == 2
    step.begin(0, [-1, 1, 2])
    graph.replay()
    for layer, result in enumerate(out):
        check_rows(result, topk, md, dev, layer)
    step.end()
