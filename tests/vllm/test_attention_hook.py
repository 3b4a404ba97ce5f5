"""The top-k conversion under residency on CPU tensors with hand-made inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.vllm.worker_side.read_path import (
    IndexGroupResidency,
    compact_valid_to_front,
    convert_with_residency,
    vllm_reference_conversion,
)
from vllm_hisparse.vllm.worker_side.step_view import StepView
from vllm_hisparse.worker.device_rows import DeviceRowLayout
from vllm_hisparse.worker.hot_state import HotState
from vllm_hisparse.worker.synthetic import kv_rows

BS, K, S, ROW = 4, 4, 8, 16  # block size, top-k, block stride rows (2 layers per block), bytes


def setup(gather_mode="side"):
    """Two requests: batch row 0 = state row 3 (FULL), batch row 1 = state row 1 (MIXED)."""
    state = HotState(4, 4, 2 * BS, BS, ops_backend="reference")
    layout = DeviceRowLayout(BS, S)
    dev = [torch.zeros((10 * S, ROW), dtype=torch.uint8) for _ in range(2)]
    host = [torch.zeros((8 * BS, ROW), dtype=torch.uint8) for _ in range(2)]
    # MIXED request (state row 1): page 0 host-only (host block 2), page 1 resident in device
    # block 5; hot region = device blocks 7, 8 (row-block ids scaled by S / BS = 2).
    state.set_pages([1, 1], [0, 1], [-1, 5 * 2])
    state.set_host_blocks([1, 1], [0, 1], [2, 6])
    state.lease_hot_region(1, [7 * 2, 8 * 2])
    for l in range(2):
        host[l][2 * BS:3 * BS] = kv_rows(1, torch.arange(0, 4), l, ROW)
        dev[l][5 * S:5 * S + BS] = kv_rows(1, torch.arange(4, 8), l, ROW)
    step = StepView(4, "cpu")
    # Side mode with the follower in its own launch (the default schedule would put both
    # layers of this two-layer group in the leader's launch).
    binding = IndexGroupResidency(state, host, dev, layout, step, gather_mode=gather_mode,
                                  gather_chunks=(1,) if gather_mode == "side" else None)
    return state, binding, step, dev


def test_all_full_conversion_is_vllms():
    table = torch.tensor([[2, 6], [3, 1]], dtype=torch.int32)
    topk = torch.tensor([[5, 0, -1, 7], [1, 6, 4, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    rows = vllm_reference_conversion(req, table, topk, BS, S)
    assert rows.tolist() == [[6 * S + 1, 2 * S + 0, -1, 6 * S + 3], [3 * S + 1, 1 * S + 2, 1 * S + 0, -1]]
    compacted, counts = compact_valid_to_front(rows)
    assert counts.tolist() == [3, 3] and compacted[0].tolist() == [6 * S + 1, 2 * S, 6 * S + 3, -1]


@pytest.mark.parametrize("gather_mode", ["side", "single"])
def test_mixed_batch_rows_equal_ground_truth_after_gather(gather_mode):
    state, binding, step, dev = setup(gather_mode)
    step.begin(0, [-1, 1])  # batch row 0 FULL, batch row 1 -> state row 1
    topk = torch.tensor([[1, 2, 3, 0], [6, 1, 2, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    full_table = torch.tensor([[9, 9], [0, 0]], dtype=torch.int32)  # request 0: block 9
    vllm_rows = vllm_reference_conversion(req, full_table, topk, BS, S)
    rows, counts = convert_with_residency(binding, 0, topk, req, 2, vllm_rows,
                                          block_stride_rows=S, return_valid_counts=True)
    assert rows[0].tolist() == vllm_rows[0].tolist()  # FULL token: vLLM's rows unchanged
    assert counts.tolist() == [4, 3]
    # Mixed token: resident position 6 -> block 5; host positions 1, 2 -> hot slots 0, 1
    # (hot block 7 = flat rows 56.. ).
    assert rows[1, :3].tolist() == [5 * S + 2, 7 * S + 0, 7 * S + 1]
    want = [kv_rows(1, torch.tensor([6, 1, 2]), l, ROW) for l in range(2)]
    assert torch.equal(dev[0][rows[1, :3].long()], want[0])  # the leader's rows are in place
    # The follower's misses: already copied in single mode; in side mode still queued (on CPU
    # the side stream runs at the latest moment allowed) until the follower's conversion.
    assert torch.equal(dev[1][rows[1, :3].long()], want[1]) == (gather_mode == "single")
    # A follower layer reuses the leader's rows; dense row space for page-tensor kernels.
    dense = convert_with_residency(binding, 1, topk, req, 2, vllm_rows, block_stride_rows=None,
                                   return_valid_counts=False)
    assert dense[1].tolist() == [5 * BS + 2, 7 * BS + 0, 7 * BS + 1, -1]
    assert torch.equal(dev[1][rows[1, :3].long()], want[1])
    # Next step: position 2 is a hot hit, 3 a miss; no copy of 2 again.
    step.begin(1, [1])
    topk2 = torch.tensor([[2, 3, -1, -1]], dtype=torch.int32)
    before = state.counters()
    rows2 = convert_with_residency(binding, 0, topk2, torch.tensor([0], dtype=torch.int32), 1,
                                   torch.full_like(topk2, -1), block_stride_rows=S,
                                   return_valid_counts=False)
    resident, hits, misses = (a - b for a, b in zip(state.counters(), before))
    assert (hits, misses) == (1, 1)
    assert torch.equal(dev[0][rows2[0, :2].long()], kv_rows(1, torch.tensor([2, 3]), 0, ROW))


def test_padding_tokens_keep_vllm_rows():
    state, binding, step, dev = setup()
    step.begin(0, [1])
    topk = torch.tensor([[6, -1, -1, -1], [1, 2, -1, -1]], dtype=torch.int32)
    req = torch.tensor([0, 0], dtype=torch.int32)
    vllm_rows = torch.full_like(topk, -1)
    rows = convert_with_residency(binding, 0, topk, req, 1, vllm_rows, block_stride_rows=S,
                                  return_valid_counts=False)
    assert rows[0, 0].item() == 5 * S + 2 and rows[1].tolist() == [-1, -1, -1, -1]


def test_next_resolve_fences_followers_that_did_not_convert():
    """Step 0's follower never converts (its side-stream copy stays queued); step 1 hits a slot
    that copy fills. The resolve of step 1 must run it first, or the follower reads stale."""
    state, binding, step, dev = setup("side")
    req = torch.tensor([0], dtype=torch.int32)
    step.begin(0, [1])
    topk = torch.tensor([[1, 2, -1, -1]], dtype=torch.int32)  # misses 1, 2 -> slots 0, 1
    convert_with_residency(binding, 0, topk, req, 1, torch.full_like(topk, -1),
                           block_stride_rows=S, return_valid_counts=False)
    step.begin(1, [1])
    topk2 = torch.tensor([[2, 3, -1, -1]], dtype=torch.int32)  # hit 2, miss 3
    rows = None
    for layer in range(2):
        rows = convert_with_residency(binding, layer, topk2, req, 1, torch.full_like(topk2, -1),
                                      block_stride_rows=S, return_valid_counts=False)
        assert torch.equal(dev[layer][rows[0, :2].long()],
                           kv_rows(1, torch.tensor([2, 3]), layer, ROW)), f"layer {layer}"
    assert state.side_work is None  # the follower's wait joined the side work


def test_all_full_step_adds_no_work():
    """A step without tracked requests takes vLLM's conversion as is: no resolve, no gather
    launch, no wait, whatever the layer."""
    from vllm_hisparse.vllm.worker_side.read_path import BINDING_ATTR, hooked_conversion

    state, binding, step, dev = setup("side")
    group = SimpleNamespace(**{BINDING_ATTR: binding})
    calls = []

    def original(layer_index, topk, md, *, block_stride_rows, return_valid_counts):
        calls.append(layer_index)
        return "vllm"

    resolves = []
    state.resolve = lambda *a, **k: resolves.append(a)
    step.begin(0, None)
    md = SimpleNamespace(req_id_per_token=torch.zeros(1, dtype=torch.int32), num_actual_tokens=1)
    topk = torch.zeros((1, K), dtype=torch.int32)
    for layer in range(2):
        assert hooked_conversion(group, original, layer, topk, md, block_stride_rows=S,
                                 return_valid_counts=True) == "vllm"
    assert calls == [0, 1] and resolves == [] and binding.gather.launches == 0


def test_gather_mode_is_checked_at_bind_time():
    state = HotState(4, 4, 2 * BS, BS, ops_backend="reference")
    layers = [torch.zeros((8 * BS, ROW), dtype=torch.uint8) for _ in range(2)]
    step = StepView(4, "cpu")
    with pytest.raises(ValueError, match="mode must be one of side, single; got 'eager'"):
        IndexGroupResidency(state, layers, layers, DeviceRowLayout(BS, BS), step,
                            gather_mode="eager")
    default = IndexGroupResidency(state, layers, layers, DeviceRowLayout(BS, BS), step)
    # Side mode by default; its schedule puts a 2-layer group in one launch (no side work).
    assert default.gather.mode == "side" and default.gather.chunks == (2,)
    assert default.gather.side_launches == 0
    binding = IndexGroupResidency(state, layers, layers, DeviceRowLayout(BS, BS), step,
                                  gather_mode="side", gather_chunks=(1,))
    assert binding.gather.chunks == (1, 1)
    with pytest.raises(RuntimeError, match="layer 2 of an index group bound with 2 layers"):
        binding.wait_for_layer(2)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (64, 2048), (5, 0), (0, 4)])
@pytest.mark.parametrize("invalid", [0.0, 0.3, 1.0])
def test_compaction_is_a_stable_partition(shape, invalid):
    """compact_valid_to_front (prefix sums) equals the stable sort it replaced: valid rows in
    their order, then -1, and per-token counts."""
    g = torch.Generator().manual_seed(hash((shape, invalid)) % 1000)
    rows = torch.randint(0, 10**6, shape, generator=g, dtype=torch.int32)
    rows[torch.rand(shape, generator=g) < invalid] = -1
    got, counts = compact_valid_to_front(rows)
    valid = rows >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    assert torch.equal(got, torch.gather(rows, 1, order)) and got.dtype == torch.int32
    assert torch.equal(counts, valid.sum(dim=1, dtype=torch.int32))


@pytest.mark.parametrize("return_valid_counts", [False, True])
def test_decode_direct_conversion_computes_vllms_rows_without_vllms_kernel(return_valid_counts):
    """At a direct conversion site without a prefill workspace the merge computes vLLM's rows
    from the block table itself (``ops.merge_table_rows``): vLLM's function is not called,
    and the rows are the ones the path through vLLM's rows gives, token for token (a FULL
    token, a tracked one, a padding token past the real count)."""
    import functools

    from vllm_hisparse.vllm.simulation.synthetic_attention import cpu_direct_conversion
    from vllm_hisparse.vllm.worker_side.read_path import BINDING_ATTR, routed_direct_conversion

    calls = []

    @functools.wraps(cpu_direct_conversion)  # the routing binds arguments by vLLM's signature
    def vllm_function(*args, **kwargs):
        calls.append(kwargs)
        return cpu_direct_conversion(*args, **kwargs)

    table = torch.tensor([[9, 3], [0, 0], [9, 3]], dtype=torch.int32)  # batch row 0 FULL
    topk = torch.tensor([[1, 6, -1, 4], [6, 1, 2, -1], [2, 7, -1, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1, 0], dtype=torch.int32)
    md = SimpleNamespace(num_actual_tokens=2)  # token 2 is padding

    def run(direct: bool):
        state, binding, step, dev = setup()
        step.begin(0, [-1, 1])
        if not direct:
            vllm_rows = cpu_direct_conversion(req, table, topk, BLOCK_SIZE=BS,
                                              BLOCK_STRIDE_ROWS=S, NUM_TOPK_TOKENS=K)
            return convert_with_residency(binding, 0, topk, req, 2, vllm_rows,
                                          block_stride_rows=S,
                                          return_valid_counts=return_valid_counts)
        group = SimpleNamespace(**{BINDING_ATTR: binding})
        return routed_direct_conversion((group, 0, md), vllm_function, req, table, topk,
                                        BLOCK_SIZE=BS, BLOCK_STRIDE_ROWS=S, NUM_TOPK_TOKENS=K,
                                        return_valid_counts=return_valid_counts)

    got, want = run(direct=True), run(direct=False)
    assert calls == []
    if return_valid_counts:
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()
        got = got[0]
    else:
        assert got.tolist() == want.tolist()
    # The FULL and padding tokens' rows are vLLM's own; the tracked token's are resolve's.
    vllm_rows = cpu_direct_conversion(req, table, topk, BLOCK_SIZE=BS, BLOCK_STRIDE_ROWS=S,
                                      NUM_TOPK_TOKENS=K, return_valid_counts=return_valid_counts)
    vllm_rows = vllm_rows[0] if return_valid_counts else vllm_rows
    assert got[0].tolist() == vllm_rows[0].tolist() and got[2].tolist() == vllm_rows[2].tolist()
    assert got[1].tolist() != vllm_rows[1].tolist()


def test_conversion_takes_vllms_rows_or_its_block_table_not_both():
    state, binding, step, dev = setup()
    step.begin(0, [1])
    topk = torch.tensor([[1, 2, -1, -1]], dtype=torch.int32)
    req = torch.tensor([0], dtype=torch.int32)
    table = (torch.zeros((1, 2), dtype=torch.int32), BS)
    kw = dict(block_stride_rows=S, return_valid_counts=False)
    with pytest.raises(ValueError, match="not both"):
        convert_with_residency(binding, 0, topk, req, 1, torch.full_like(topk, -1),
                               vllm_table=table, **kw)
    with pytest.raises(ValueError, match="not neither"):
        convert_with_residency(binding, 0, topk, req, 1, None, **kw)
    with pytest.raises(ValueError, match="need vLLM's rows"):
        convert_with_residency(binding, 0, topk, req, 1, None, vllm_table=table,
                               keep_vllm=torch.zeros(1, dtype=torch.bool), **kw)
    # int64 batch rows (what the step view also takes) are converted, not refused
    rows = convert_with_residency(binding, 0, topk, req.long(), 1, None, vllm_table=table, **kw)
    assert rows.dtype == torch.int32 and rows.shape == topk.shape
