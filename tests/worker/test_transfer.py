"""TransferEngine on CPU tensors: byte-exact spills, restores and mirrors; progress reports;
failures reported and nothing written."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.worker.transfer import TransferEngine

BS = 4


def make(num_layers=2, device_blocks=6, host_blocks=8, row_bytes=32, **kw):
    g = torch.Generator().manual_seed(0)
    dev = [torch.randint(0, 256, (device_blocks * BS, row_bytes), dtype=torch.uint8, generator=g)
           for _ in range(num_layers)]
    host = [torch.zeros((host_blocks * BS, row_bytes), dtype=torch.uint8)
            for _ in range(num_layers)]
    return dev, host, TransferEngine(dev, host, BS, **kw)


def test_spill_restore_roundtrip_and_reports():
    dev, host, engine = make()
    original = [d.clone() for d in dev]
    engine.spill(1, [2, 5], [7, 0])
    report = engine.poll()
    assert report.enqueued == [1] and report.completed == [1] and not report.failed
    assert report.bytes_to_host == 2 * 2 * BS * 32
    for l in range(2):
        assert torch.equal(host[l][7 * BS:8 * BS], original[l][2 * BS:3 * BS])
        assert torch.equal(host[l][0:BS], original[l][5 * BS:6 * BS])
        dev[l][2 * BS:3 * BS] = 0
    engine.restore(2, [7], [2])
    report = engine.poll()
    assert report.completed == [2] and report.bytes_to_device == 2 * BS * 32
    for l in range(2):
        assert torch.equal(dev[l], original[l])
    assert not engine.poll()  # nothing new


def test_mirror_copies_rows():
    dev, host, engine = make()
    engine.mirror(3, [0, 23], [31, 1])
    assert engine.poll().completed == [3]
    for l in range(2):
        assert torch.equal(host[l][31], dev[l][0]) and torch.equal(host[l][1], dev[l][23])


def test_failed_transfer_is_reported_and_writes_nothing():
    dev, host, engine = make(fail_transfer=lambda tid: tid == 9)
    engine.spill(9, [1], [1])
    engine.spill(10, [2], [2])
    report = engine.poll()
    assert [tid for tid, _ in report.failed] == [9] and "injected failure" in report.failed[0][1]
    assert report.enqueued == [10] and report.completed == [10]
    for l in range(2):
        assert bool((host[l][BS:2 * BS] == 0).all())


def test_out_of_range_block_fails_the_transfer_not_the_engine():
    dev, host, engine = make()
    engine.spill(4, [99], [0])
    report = engine.poll()
    assert report.failed and report.failed[0][0] == 4 and "outside" in report.failed[0][1]


def test_mismatched_lengths_and_reused_ids_are_errors():
    dev, host, engine = make()
    with pytest.raises(ValueError, match="1 sources but 2 destinations"):
        engine.spill(1, [0], [0, 1])
    engine.spill(1, [0], [0])
    with pytest.raises(ValueError, match="already in flight"):
        engine.mirror(1, [0], [0])
    engine.poll()
    engine.mirror(1, [0], [0])  # reusable once completed


def test_layer_count_mismatch():
    with pytest.raises(ValueError, match="2 device layers but 1 host layers"):
        TransferEngine([torch.zeros((4, 16), dtype=torch.uint8)] * 2,
                       [torch.zeros((4, 16), dtype=torch.uint8)], BS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fence_covers_a_spill_submitted_before_a_mirror():
    """Mirrors run on the compute stream, spills on the copy stream: the fence must still
    order the compute stream after the spill when a mirror was submitted last (a device
    block reused right after its spill must reach the host unchanged)."""
    bs, row_bytes, blocks = 64, 4096, 512
    dev = [torch.randint(0, 255, (blocks * bs, row_bytes), dtype=torch.uint8, device="cuda")]
    host = [torch.zeros((blocks * bs, row_bytes), dtype=torch.uint8).pin_memory()]
    before = dev[0].clone()
    engine = TransferEngine(dev, host, bs)
    engine.spill(1, list(range(blocks)), list(range(blocks)))
    engine.mirror(2, [0, 1], [0, 1])
    engine.fence()
    dev[0].zero_()  # reuse the spilled blocks on the compute stream
    engine.wait_all()
    torch.cuda.synchronize()
    assert torch.equal(host[0], before.cpu())


def test_an_unfenced_restore_on_cpu_copies_and_reports_as_a_fenced_one():
    dev, host, engine = make()
    host[0][7 * BS:8 * BS] = 9
    engine.restore(4, [7], [1], fenced=False)
    report = engine.poll()
    assert report.enqueued == [4] and report.completed == [4]
    assert bool((dev[0][BS:2 * BS] == 9).all())


def gpu_engine(blocks, row_bytes=1024, bs=64):
    dev = [torch.zeros((blocks * bs, row_bytes), dtype=torch.uint8, device="cuda")
           for _ in range(2)]
    host = [torch.randint(0, 256, (blocks * bs, row_bytes), dtype=torch.uint8).pin_memory()
            for _ in range(2)]
    return dev, host, TransferEngine(dev, host, bs)


@pytest.mark.gpu
def test_the_fence_waits_for_a_fenced_restore_only():
    """A restore the forward reads is fenced: the compute stream is past the fence only once
    the copy is done. A restore it does not read (a promotion's) holds nothing back: 512 MiB
    of copy is still running when the compute stream's next work has finished; it reports
    enqueued and completed together, its bytes exact."""
    blocks = 4096
    dev, host, engine = gpu_engine(blocks)
    ids = list(range(blocks))
    mark = torch.cuda.Event()
    engine.restore(1, ids, ids, fenced=False)
    engine.fence()
    mark.record()
    mark.synchronize()
    assert engine.poll().completed == []  # the compute stream did not wait
    report = engine.wait_all()
    assert report.enqueued == [1] and report.completed == [1]
    assert all(torch.equal(d.cpu(), h) for d, h in zip(dev, host))
    for d in dev:
        d.zero_()
    engine.restore(2, ids, ids)
    engine.fence()
    mark.record()
    mark.synchronize()
    assert engine.poll().completed == [2]  # past the fence: the copy is done
    assert all(torch.equal(d.cpu(), h) for d, h in zip(dev, host))


@pytest.mark.gpu
def test_an_unfenced_restore_starts_after_the_spills_before_it():
    """A spill's source block may be handed to a restore as soon as the spill is enqueued:
    the unfenced restore's stream waits for the copy stream, so the spill reads the old
    bytes first."""
    blocks = 2048
    dev, host, engine = gpu_engine(blocks)
    for d in dev:
        d.random_(0, 256)
    old = [d.clone() for d in dev]
    half = list(range(blocks // 2))
    engine.spill(1, half, half)  # device blocks 0.. -> host blocks 0..
    engine.restore(2, [b + blocks // 2 for b in half], half, fenced=False)
    engine.wait_all()
    for d, h, o in zip(dev, host, old):
        rows = len(half) * engine.block_size
        assert torch.equal(h[:rows], o[:rows].cpu())  # the spill read the old bytes
        assert torch.equal(d[:rows].cpu(), h[rows:2 * rows])  # then the restore landed
