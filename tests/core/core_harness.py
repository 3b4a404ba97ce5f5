"""A fake worker and helpers for the core tests.

The fake worker executes :class:`StepCommand`s on *tagged* memory: every KV row is one
int64, the tag of the token it holds (``family * 10**6 + position + 1``; 0 or negative =
garbage). Copies take effect when launched (stream order), so a transfer that will be
reported failed writes garbage into its destination at launch. A restore the forward does
not read (``forward_reads=False``: no fence waits for it) writes garbage at launch and its
bytes land at its completion ack, and no page the step's forward could read may map to its
blocks until then (checked before every forward). After a step, every
readable position of every request can be checked against its expected tag through the
worker's own tables, exactly as the resolve op would read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from vllm_hisparse.core import (
    HostBlockPool,
    InMemoryDevicePool,
    PolicyConfig,
    RequestStatus,
    ResidencyPolicy,
    StepCommand,
    TransferKind,
    WorkerAcks,
)
from vllm_hisparse.core.invariants import HeldLeases, check_pool_leases

GARBAGE = -7


def tag(family: int, position: int) -> int:
    """The content of ``position`` for a request of prompt family ``family``."""
    return family * 10**6 + position + 1


def hashes_for(family: int, num_pages: int) -> list:
    """Block hashes of the first ``num_pages`` pages of a family's prompt."""
    return [("fam", family, i) for i in range(num_pages)]


@dataclass
class Launched:
    """A transfer the fake worker launched and has not reported yet."""

    transfer_id: int
    kind: int
    will_fail: bool


class FakeWorker:
    """Executes step commands on tagged device/host memory and reports acks on demand."""

    def __init__(self, policy: ResidencyPolicy):
        cfg = policy.config
        self.block_size = cfg.block_size
        self.residency = np.full((cfg.max_num_rows, cfg.max_pages_per_request), -1, dtype=np.int64)
        self.host_blocks = np.full((cfg.max_num_rows, cfg.max_pages_per_request), -1, dtype=np.int64)
        self.device_mem = np.zeros((policy.device_pool.num_blocks, cfg.block_size), dtype=np.int64)
        self.host_mem = np.zeros((policy.host_pool.num_blocks, cfg.block_size), dtype=np.int64)
        self.hot = {}
        self.row_family: dict[int, int] = {}
        self.launched: dict[int, Launched] = {}
        self.enqueued: set[int] = set()
        self.commands: list[StepCommand] = []
        self.rejected_from: dict[int, int] = {}  # row -> first position the next forward writes wrong
        # unfenced restores in flight: transfer id -> [(device block, bytes landing at completion)]
        self.landing: dict[int, list[tuple[int, np.ndarray]]] = {}

    # -- executing a command ------------------------------------------------------------
    def run(self, cmd: StepCommand, fail_ids: frozenset[int] = frozenset()) -> None:
        """Apply tables, run before-forward copies, the forward, after-forward copies."""
        # The command must survive a JSON round trip unchanged.
        cmd = StepCommand.from_dict(cmd.to_dict())
        self.commands.append(cmd)
        bs = self.block_size
        for row in cmd.cleared_rows:
            self.residency[row] = -1
            self.host_blocks[row] = -1
            self.hot.pop(row, None)
        for row, page, dev, host in zip(cmd.page_rows, cmd.page_indices, cmd.page_device_blocks, cmd.page_host_blocks):
            self.residency[row, page] = dev
            self.host_blocks[row, page] = host
        for lease in cmd.hot_leases:
            self.hot[lease.row] = list(lease.block_ids)
            # Resolve traffic scribbles over hot rows: whatever was there is gone.
            for block in lease.block_ids:
                self.device_mem[block] = GARBAGE
        for spec in cmd.transfers:
            if not spec.after_forward:
                self._launch(spec, spec.transfer_id in fail_ids)
        landing = {dev for copies in self.landing.values() for dev, _ in copies}
        if landing:
            readable = set(self.residency[self.residency >= 0].tolist())
            assert not readable & landing, (
                f"step {cmd.step_id}: device blocks {sorted(readable & landing)} are mapped for "
                "the forward while the restore writing them is not fenced")
        # The forward writes the rows listed in the mirror (or, without a mirror, the caller
        # passes them through ``forward_rows``).
        for spec in cmd.transfers:
            if spec.kind == TransferKind.MIRROR:
                for row, start, end in zip(spec.mirror_rows, spec.mirror_starts, spec.mirror_ends):
                    self._forward(row, start, end)
        for row, start, end in getattr(self, "_pending_forward", []):
            self._forward(row, start, end)
        self._pending_forward = []
        for spec in cmd.transfers:
            if spec.after_forward:
                self._launch(spec, spec.transfer_id in fail_ids)

    def forward_rows(self, ranges: list[tuple[int, int, int]]) -> None:
        """Rows the next forward writes when no MIRROR lists them (eager mirror off)."""
        self._pending_forward = list(ranges)

    def _forward(self, row: int, start: int, end: int) -> None:
        bs = self.block_size
        family = self.row_family[row]
        # Rejected draft tokens (``rejected_from``): KV of tokens the request never had.
        rejected_from = self.rejected_from.pop(row, end)
        for pos in range(start, end):
            block = self.residency[row, pos // bs]
            assert block >= 0, f"forward writes row {row} position {pos} into a non-resident page"
            self.device_mem[block, pos % bs] = -tag(family, pos) if pos >= rejected_from else tag(family, pos)

    def _launch(self, spec, will_fail: bool) -> None:
        bs = self.block_size
        if spec.kind == TransferKind.SPILL:
            for dev, host in zip(spec.device_blocks, spec.host_blocks):
                self.host_mem[host] = GARBAGE if will_fail else self.device_mem[dev]
        elif spec.kind == TransferKind.RESTORE:
            for dev, host in zip(spec.device_blocks, spec.host_blocks):
                if not (spec.forward_reads or will_fail):  # lands at completion
                    self.landing.setdefault(spec.transfer_id, []).append(
                        (dev, self.host_mem[host].copy()))
                self.device_mem[dev] = GARBAGE if will_fail or not spec.forward_reads \
                    else self.host_mem[host]
        else:
            for row, start, end in zip(spec.mirror_rows, spec.mirror_starts, spec.mirror_ends):
                for pos in range(start, end):
                    dev = self.residency[row, pos // bs]
                    host = self.host_blocks[row, pos // bs]
                    assert host >= 0, "mirror into a page without host block"
                    self.host_mem[host, pos % bs] = GARBAGE if will_fail else self.device_mem[dev, pos % bs]
        self.launched[spec.transfer_id] = Launched(spec.transfer_id, spec.kind, will_fail)

    # -- acknowledgements -----------------------------------------------------------------
    def ack(self, ids=None, enqueue_only: bool = False) -> WorkerAcks:
        """Report ``ids`` (default: all launched) as enqueued, or as completed/failed."""
        ids = list(self.launched) if ids is None else list(ids)
        acks = WorkerAcks()
        for tid in ids:
            launched = self.launched[tid]
            if enqueue_only:
                if tid not in self.enqueued:
                    self.enqueued.add(tid)
                    acks.enqueued.append(tid)
                continue
            del self.launched[tid]
            self.enqueued.discard(tid)
            for dev, data in self.landing.pop(tid, []):
                self.device_mem[dev] = data
            (acks.failed if launched.will_fail else acks.completed).append(tid)
        return WorkerAcks.from_dict(acks.to_dict())

    # -- checking -------------------------------------------------------------------------
    def check_data(self, policy: ResidencyPolicy, families: dict[str, int]) -> None:
        """Every written position of every live request reads back its tag."""
        bs = self.block_size
        for request_id in policy.request_ids():
            if policy.status(request_id) == RequestStatus.IMPORTING:
                continue
            row = policy.row_of(request_id)
            family = families[request_id]
            num_tokens = int(policy.tables.num_tokens[row])
            for pos in range(num_tokens):
                page = pos // bs
                dev = self.residency[row, page]
                if dev >= 0:
                    got = self.device_mem[dev, pos % bs]
                    where = f"device block {dev}"
                else:
                    host = self.host_blocks[row, page]
                    assert host >= 0, f"{request_id} pos {pos}: neither resident nor host-backed"
                    got = self.host_mem[host, pos % bs]
                    where = f"host block {host}"
                assert got == tag(family, pos), (
                    f"{request_id} pos {pos} ({where}): got {got}, expected {tag(family, pos)}"
                )


def check_with_outside_leases(policy: ResidencyPolicy, device_blocks: Iterable[int] = (),
                              host_blocks: Iterable[int] = ()) -> None:
    """``policy.check_invariants()`` while someone besides the policy (a test's hog, an
    engine's tail blocks) holds one lease on each of ``device_blocks`` and ``host_blocks``."""
    held = policy.check_records()
    device, host = dict(held.device), dict(held.host)
    for leases, blocks in ((device, device_blocks), (host, host_blocks)):
        for block in blocks:
            leases[int(block)] = leases.get(int(block), 0) + 1
    check_pool_leases(policy.device_pool, policy.host_pool, HeldLeases(device, host))


def make_policy(
    *,
    num_device_blocks: int = 64,
    num_host_blocks: int = 128,
    block_size: int = 4,
    max_num_rows: int = 8,
    max_pages: int = 32,
    hot_blocks: int = 2,
    **overrides,
) -> ResidencyPolicy:
    """A small policy over in-memory pools (watermarks default to low=4, high=8)."""
    overrides.setdefault("low_watermark_blocks", 4)
    overrides.setdefault("high_watermark_blocks", 8)
    overrides.setdefault("min_steps_between_transitions", 0)
    cfg = PolicyConfig(
        block_size=block_size,
        max_num_rows=max_num_rows,
        max_pages_per_request=max_pages,
        device_buffer_size_rows=hot_blocks * block_size,
        **overrides,
    )
    return ResidencyPolicy(cfg, InMemoryDevicePool(num_device_blocks), HostBlockPool(num_host_blocks))


class Driver:
    """Drives a policy and a fake worker through steps; checks invariants and data each time."""

    def __init__(self, policy: ResidencyPolicy):
        self.policy = policy
        self.worker = FakeWorker(policy)
        self.families: dict[str, int] = {}

    def add(self, request_id: str, family: int = 0, num_hashed_pages: int = 0, **kw):
        """Add a request of prompt family ``family``; hashes cover its first pages."""
        self.families[request_id] = family
        result = self.policy.add_request(request_id, block_hashes=hashes_for(family, num_hashed_pages), **kw)
        self.worker.row_family[result.row] = family
        return result

    def step(self, scheduled: dict[str, int], *, ack: bool = True, fail_ids=frozenset(),
             check: bool = True) -> StepCommand:
        """Schedule, build the command, run it on the worker, optionally ack everything."""
        outcomes = {}
        ranges = []
        for request_id, n in scheduled.items():
            row = self.policy.row_of(request_id)
            start = int(self.policy.tables.num_tokens[row])
            outcomes[request_id] = self.policy.schedule(request_id, n)
            if outcomes[request_id] == 0:
                ranges.append((row, start, start + n))
        self.last_outcomes = outcomes
        cmd = self.policy.build_step()
        if not self.policy.config.eager_host_mirror:
            self.worker.forward_rows(ranges)
        self.worker.run(cmd, fail_ids)
        if check:
            self.check()
        if ack:
            self.ack_all()
        return cmd

    def spec_step(self, scheduled: dict[str, tuple[int, int]], *, ack: bool = True,
                  roll_back: bool = True) -> StepCommand:
        """A speculative-decoding step: ``request id -> (tokens, accepted)`` schedules
        ``tokens`` positions (the last sampled token and ``tokens - 1`` drafts), of which the
        forward writes the first ``1 + accepted`` right and the rest as rejected KV. The
        engine then rolls the request back to ``start + 1 + accepted`` (unless
        ``roll_back`` is False) before the acks are applied."""
        rows, ends = [], []
        for request_id, (n, accepted) in scheduled.items():
            row = self.policy.row_of(request_id)
            start = int(self.policy.tables.num_tokens[row])
            self.worker.rejected_from[row] = start + 1 + accepted
            rows.append(row)
            ends.append(start + 1 + accepted)
        cmd = self.step({r: n for r, (n, _) in scheduled.items()}, ack=False, check=False)
        ran = [self.last_outcomes[r] == 0 for r in scheduled]
        for row, ok in zip(rows, ran):
            if not ok:  # did not run this step (back-pressure): nothing written
                self.worker.rejected_from.pop(row, None)
        if roll_back:
            self.policy.roll_back(np.array(rows, dtype=np.int64)[ran], np.array(ends, dtype=np.int64)[ran])
        self.check()
        if ack:
            self.ack_all()
        return cmd

    def ack_all(self) -> None:
        """Report every launched transfer."""
        self.policy.apply_acks(self.worker.ack())
        self.check()

    def check(self) -> None:
        """Bookkeeping invariants and data through the worker's tables."""
        self.policy.check_invariants()
        self.worker.check_data(self.policy, self.families)

    def flush(self) -> StepCommand:
        """An empty step that delivers pending page updates to the worker."""
        return self.step({})
