"""Applies the scheduler's :class:`~vllm_hisparse.core.StepCommand` on the worker, step by step.

The contract (``core/commands.py``), per command:

1. ``cleared_rows``, then the page-table updates, then ``hot_leases`` go into every index
   group's :class:`HotState` (and into a host-side copy of the page tables, used to turn
   mirrored positions into rows without reading GPU memory);
2. :meth:`StepExecutor.before_forward` launches the transfers marked ``after_forward=False``
   and fences the compute stream behind those the forward reads (``forward_reads``) and
   behind earlier spills;
3. the model's forward runs (and reads KV through ``HotState.resolve`` + ``gather``);
4. :meth:`StepExecutor.after_forward` launches the spills of sealed pages and the mirror of
   the rows the forward wrote;
5. :meth:`StepExecutor.acks` reports transfer ids as enqueued / completed / failed.

Independent of vLLM: the connector's worker role is a thin adapter over this class, and the
simulator and the GPU decode loop drive it directly.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from vllm_hisparse.core.commands import StepCommand, TransferKind, TransferSpec, WorkerAcks
from vllm_hisparse.worker.hot_state import HotState
from vllm_hisparse.worker.transfer import TransferEngine


class StepExecutor:
    """Executes step commands against hot states and one transfer engine.

    Args:
        hot_states: one :class:`HotState` per index group (they share the page tables'
            content: a page is resident in all sparse layers or in none).
        engine: copies between the sparse-MLA device layers and the host pool.
        num_state_rows, max_pages, block_size: geometry of the page tables.
    """

    def __init__(self, hot_states: Sequence[HotState], engine: TransferEngine,
                 num_state_rows: int, max_pages: int, block_size: int):
        self.hot_states = list(hot_states)
        self.engine = engine
        self.block_size = block_size
        # Host-side copies of the page tables: mirrors and checks read these, never the GPU.
        self.residency = np.full((num_state_rows, max_pages), -1, dtype=np.int64)
        self.host_blocks = np.full((num_state_rows, max_pages), -1, dtype=np.int64)
        self._after_forward: list[TransferSpec] = []
        self._failed_at_launch: list[int] = []
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self.steps = 0

    # ---------------------------------------------------------------- 1. tables

    def apply_tables(self, cmd: StepCommand) -> None:
        """Cleared rows, page updates and hot leases (new regions, resizes, releases), in
        that order."""
        # Gathers of the last step still on a side stream write hot rows of blocks this
        # command may hand to someone else (and the transfers below may overwrite).
        for state in self.hot_states:
            state.fence_side_work()
        # One write per lane's page tables, however many index groups read them.
        tables = list({id(s.page_tables): s.page_tables for s in self.hot_states}.values())
        if cmd.cleared_rows:
            self.residency[cmd.cleared_rows] = -1
            self.host_blocks[cmd.cleared_rows] = -1
            for t in tables:
                t.clear_rows(cmd.cleared_rows)
            for row in cmd.cleared_rows:
                for state in self.hot_states:
                    state.release_hot_region(row)
        if cmd.page_rows:
            rows = np.asarray(cmd.page_rows, dtype=np.int64)
            pages = np.asarray(cmd.page_indices, dtype=np.int64)
            if pages.size and (pages.max() >= self.residency.shape[1] or pages.min() < 0):
                raise ValueError(f"step {cmd.step_id}: page index outside [0, "
                                 f"{self.residency.shape[1]})")
            self.residency[rows, pages] = cmd.page_device_blocks
            self.host_blocks[rows, pages] = cmd.page_host_blocks
            for t in tables:
                t.update(cmd.page_rows, cmd.page_indices, cmd.page_device_blocks,
                         cmd.page_host_blocks)
        for lease in cmd.hot_leases:
            for state in self.hot_states:
                if lease.resize:
                    state.resize_hot_region(lease.row, lease.block_ids)
                elif lease.block_ids:
                    state.lease_hot_region(lease.row, lease.block_ids)
                else:
                    state.release_hot_region(lease.row)

    # ---------------------------------------------------------------- 2. / 4. transfers

    def before_forward(self, cmd: StepCommand) -> None:
        """Apply the tables and launch the transfers the forward depends on."""
        self.apply_tables(cmd)
        self._after_forward = [t for t in cmd.transfers if t.after_forward]
        for spec in cmd.transfers:
            if not spec.after_forward:
                self._launch(spec)
        self.engine.fence()
        self.steps += 1

    def after_forward(self) -> None:
        """Launch the spills and mirrors of what the forward just wrote."""
        pending, self._after_forward = self._after_forward, []
        for spec in pending:
            self._launch(spec)

    def _launch(self, spec: TransferSpec) -> None:
        kind = TransferKind(spec.kind)
        if kind is TransferKind.SPILL:
            self.engine.spill(spec.transfer_id, spec.device_blocks, spec.host_blocks)
        elif kind is TransferKind.RESTORE:
            self.engine.restore(spec.transfer_id, spec.host_blocks, spec.device_blocks,
                                fenced=spec.forward_reads)
        else:
            try:
                device_rows, host_rows = self._mirror_rows(spec)
            except ValueError:
                self._failed_at_launch.append(spec.transfer_id)
                return
            self.engine.mirror(spec.transfer_id, device_rows, host_rows)

    def _mirror_rows(self, spec: TransferSpec) -> tuple[list[int], list[int]]:
        """Device and host rows of the positions a MIRROR names, via the page tables."""
        bs = self.block_size
        rows = np.asarray(spec.mirror_rows, dtype=np.int64)
        starts = np.asarray(spec.mirror_starts, dtype=np.int64)
        ends = np.asarray(spec.mirror_ends, dtype=np.int64)
        counts = ends - starts
        if (counts < 0).any() or not (rows.size == starts.size == ends.size):
            raise ValueError(f"mirror {spec.transfer_id}: malformed position ranges")
        total = int(counts.sum())
        if total == 0:
            return [], []
        row_of = np.repeat(rows, counts)
        before = np.concatenate([[0], np.cumsum(counts)[:-1]])
        pos = np.repeat(starts, counts) + np.arange(total) - np.repeat(before, counts)
        pages = pos // bs
        if (pages >= self.residency.shape[1]).any():
            raise ValueError(f"mirror {spec.transfer_id}: position past the page table")
        dev_block = self.residency[row_of, pages]
        host_block = self.host_blocks[row_of, pages]
        if (dev_block < 0).any() or (host_block < 0).any():
            raise ValueError(f"mirror {spec.transfer_id} names positions of pages without a "
                             f"device or host block")
        return (dev_block * bs + pos % bs).tolist(), (host_block * bs + pos % bs).tolist()

    # ---------------------------------------------------------------- 5. acks

    def acks(self) -> WorkerAcks:
        """Transfer outcomes since the last call (never blocks)."""
        report = self.engine.poll()
        self.bytes_to_host += report.bytes_to_host
        self.bytes_to_device += report.bytes_to_device
        failed = [tid for tid, _ in report.failed] + self._failed_at_launch
        self._failed_at_launch = []
        return WorkerAcks(enqueued=list(report.enqueued), completed=list(report.completed),
                          failed=failed)

    def drain(self) -> WorkerAcks:
        """Wait for every launched copy, then report (shutdown, tests)."""
        self.engine.wait_all()
        return self.acks()
