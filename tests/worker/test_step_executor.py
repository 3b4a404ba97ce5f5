"""StepExecutor with hand-made step commands (CPU, reference ops)."""

from __future__ import annotations

import pytest
import torch

from vllm_hisparse.core.commands import HotLease, StepCommand, TransferKind, TransferSpec
from vllm_hisparse.worker.hot_state import HotState
from vllm_hisparse.worker.page_tables import PageTables
from vllm_hisparse.worker.step_executor import StepExecutor
from vllm_hisparse.worker.synthetic import kv_rows
from vllm_hisparse.worker.transfer import TransferEngine

BS, ROW_BYTES, LAYERS = 4, 16, 2


def setup(fail=None):
    dev = [torch.zeros((32 * BS, ROW_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    host = [torch.zeros((16 * BS, ROW_BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    engine = TransferEngine(dev, host, BS, fail_transfer=fail)
    states = [HotState(4, 8, 2 * BS, BS), HotState(4, 8, 2 * BS, BS)]
    return dev, host, StepExecutor(states, engine, 4, 8, BS)


def write_tokens(dev, row, positions, blocks):
    for p in positions:
        for l in range(LAYERS):
            dev[l][blocks[p // BS] * BS + p % BS] = kv_rows(row, torch.tensor([p]), l, ROW_BYTES)[0]


def test_tables_leases_mirror_spill_and_acks():
    dev, host, ex = setup()
    cmd = StepCommand(
        step_id=1, page_rows=[2, 2], page_indices=[0, 1], page_device_blocks=[5, 9],
        page_host_blocks=[3, 7], hot_leases=[HotLease(2, [20, 21])],
        transfers=[TransferSpec(1, int(TransferKind.MIRROR), True, mirror_rows=[2],
                                mirror_starts=[0], mirror_ends=[6])])
    ex.before_forward(cmd)
    for state in ex.hot_states:
        assert state.residency[2, :2].tolist() == [5, 9]
        assert state.host_blocks[2, :2].tolist() == [3, 7]
        assert state.hot_blocks[2].tolist() == [20, 21]
    write_tokens(dev, 2, range(6), {0: 5, 1: 9})  # the "forward"
    ex.after_forward()
    acks = ex.acks()
    assert acks.completed == [1] and not acks.failed
    for l in range(LAYERS):
        want = kv_rows(2, torch.arange(6), l, ROW_BYTES)
        got = torch.cat([host[l][3 * BS:4 * BS], host[l][7 * BS:7 * BS + 2]])
        assert torch.equal(got, want)
    # Page 0 released to host: spill is redundant here but exercises the path.
    ex.before_forward(StepCommand(step_id=2, page_rows=[2], page_indices=[0],
                                  page_device_blocks=[-1], page_host_blocks=[3],
                                  transfers=[TransferSpec(2, int(TransferKind.SPILL), False,
                                                          device_blocks=[9],
                                                          host_blocks=[8])]))
    assert ex.acks().completed == [2]
    assert ex.hot_states[0].residency[2, 0].item() == -1
    assert torch.equal(host[0][8 * BS:9 * BS], dev[0][9 * BS:10 * BS])
    # Cleared rows forget everything, in every index group.
    ex.before_forward(StepCommand(step_id=3, cleared_rows=[2]))
    for state in ex.hot_states:
        assert (state.residency[2] == -1).all() and (state.hot_blocks[2] == -1).all()


def test_mirror_of_unmapped_positions_fails_that_transfer_only():
    dev, host, ex = setup()
    ex.before_forward(StepCommand(step_id=1, transfers=[
        TransferSpec(7, int(TransferKind.MIRROR), True, mirror_rows=[1], mirror_starts=[0],
                     mirror_ends=[3])]))
    ex.after_forward()
    acks = ex.acks()
    assert acks.failed == [7] and acks.completed == []


def test_failed_copy_is_acked_as_failed():
    dev, host, ex = setup(fail=lambda tid: tid == 4)
    ex.before_forward(StepCommand(step_id=1, transfers=[
        TransferSpec(4, int(TransferKind.RESTORE), False, device_blocks=[1], host_blocks=[1]),
        TransferSpec(5, int(TransferKind.RESTORE), False, device_blocks=[2], host_blocks=[2])]))
    acks = ex.acks()
    assert acks.failed == [4] and acks.completed == [5]


def test_page_index_past_the_table_is_an_error():
    dev, host, ex = setup()
    with pytest.raises(ValueError, match="page index outside"):
        ex.before_forward(StepCommand(step_id=1, page_rows=[0], page_indices=[8],
                                      page_device_blocks=[1], page_host_blocks=[1]))


def test_shared_page_tables_are_written_once_per_step(monkeypatch):
    """The index groups of a lane share one PageTables: a step's page changes and cleared
    rows are written into it once, not once per group (each write was an H2D copy and an
    index_put per group: 48 copies per step for GLM-5.1's 8 simulated layers)."""
    tables = PageTables(4, 8)
    states = [HotState(4, 8, 2 * BS, BS, page_tables=tables) for _ in range(3)]
    separate = HotState(4, 8, 2 * BS, BS)
    engine = TransferEngine([torch.zeros((32 * BS, ROW_BYTES), dtype=torch.uint8)] * 1,
                            [torch.zeros((16 * BS, ROW_BYTES), dtype=torch.uint8)] * 1, BS)
    ex = StepExecutor([*states, separate], engine, 4, 8, BS)
    writes = []
    for t in (tables, separate.page_tables):
        for verb in ("update", "set_pages", "set_host_blocks", "clear_rows"):
            real = getattr(t, verb)
            monkeypatch.setattr(t, verb, lambda *a, _r=real, _v=verb, _t=t: (
                writes.append((id(_t), _v)), _r(*a))[1])
    ex.before_forward(StepCommand(step_id=1, page_rows=[1, 3], page_indices=[0, 2],
                                  page_device_blocks=[4, -1], page_host_blocks=[6, 2]))
    assert sorted(writes) == sorted([(id(tables), "update"),
                                     (id(separate.page_tables), "update")])
    for state in [*states, separate]:
        assert state.residency[1, 0].item() == 4 and state.residency[3, 2].item() == -1
        assert state.host_blocks[3, 2].item() == 2
    writes.clear()
    ex.before_forward(StepCommand(step_id=2, cleared_rows=[1, 3]))
    assert len(writes) == 2 and {v for _, v in writes} == {"clear_rows"}
    for state in [*states, separate]:
        assert (state.residency == -1).all() and (state.host_blocks == -1).all()


def test_page_tables_refuse_ragged_columns_and_wrong_shapes():
    tables = PageTables(2, 3)
    with pytest.raises(ValueError, match="lengths"):
        tables.update([0, 1], [0], [1, 2], [3, 4])
    with pytest.raises(ValueError, match="shape"):
        HotState(4, 8, 2 * BS, BS, page_tables=tables)


def test_a_restore_the_forward_does_not_read_is_not_fenced(monkeypatch):
    """``forward_reads`` reaches the engine: only a restore the step's forward reads (a host
    prefix load) is fenced; the others run where no step waits for them."""
    dev, host, ex = setup()
    calls = []
    restore = ex.engine.restore

    def recording(tid, host_blocks, device_blocks, *, fenced=True):
        calls.append((tid, fenced))
        restore(tid, host_blocks, device_blocks, fenced=fenced)

    monkeypatch.setattr(ex.engine, "restore", recording)
    ex.before_forward(StepCommand(step_id=1, transfers=[
        TransferSpec(1, int(TransferKind.RESTORE), False, device_blocks=[3], host_blocks=[2]),
        TransferSpec(2, int(TransferKind.RESTORE), False, device_blocks=[4], host_blocks=[5],
                     forward_reads=False)]))
    assert calls == [(1, True), (2, False)]
    assert sorted(ex.acks().completed) == [1, 2]
