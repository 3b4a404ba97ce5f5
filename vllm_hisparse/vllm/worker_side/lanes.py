"""A lane: one sparse-MLA KV cache group's share of the worker's data plane, and the step
command in that group's block ids.

Device block ids on the wire are the page bundle's **lead** block (sparse group 0's block,
``scheduler_side.block_pool``). Lane ``g`` needs its own group's block: with more than one
sparse group the command comes with the bundle members (``metadata.bundles``: lead id → one
block id per sparse group), which the worker role keeps; :meth:`Lane.command` rewrites the
command's ids to this lane's blocks and scales them to flat-row blocks (``DeviceRowLayout``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from vllm_hisparse.core.commands import StepCommand, TransferKind
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME
from vllm_hisparse.vllm.worker_side.read_path import IndexGroupResidency
from vllm_hisparse.worker import HotState, StepExecutor, TransferEngine
from vllm_hisparse.worker.device_rows import DeviceRowLayout


@dataclass
class Lane:
    """One sparse-MLA KV cache group's share of the data plane."""

    group_id: int
    sparse_index: int  # position among the sparse groups (0 = the bundle's lead group)
    layer_names: list[str]
    units: list[list[int]]  # index units as positions into layer_names, leader first
    layout: DeviceRowLayout
    device_layers: list[torch.Tensor]
    host_layers: list[torch.Tensor]
    engine: TransferEngine
    hot_states: list[HotState]
    executor: StepExecutor
    bindings: list[IndexGroupResidency] = field(default_factory=list)

    def member_block(self, lead: int, bundles: Mapping[int, Sequence[int]], num_lanes: int) -> int:
        """This lane's block of the bundle led by ``lead`` (``lead`` itself for the lead
        group and for a negative sentinel). Raises ``ValueError`` when ``bundles`` lacks it."""
        if lead < 0 or self.sparse_index == 0:
            return lead
        members = bundles.get(lead)
        if members is None:
            raise ValueError(
                f"{CONNECTOR_NAME}: device block {lead} has no bundle members for sparse group "
                f"{self.group_id}; with {num_lanes} sparse-MLA KV cache groups the "
                "connector metadata must carry bundles (lead block -> one block per "
                "sparse group) for every page bundle the command names")
        return members[self.sparse_index]

    def command(self, cmd: StepCommand, bundles: Mapping[int, Sequence[int]],
                num_lanes: int) -> StepCommand:
        """``cmd`` in this lane's block ids, scaled to flat-row blocks."""
        if num_lanes > 1 and self.sparse_index > 0:

            def member(blocks):
                return [self.member_block(b, bundles, num_lanes) for b in blocks]

            cmd = dataclasses.replace(
                cmd,
                page_device_blocks=member(cmd.page_device_blocks),
                hot_leases=[dataclasses.replace(l, block_ids=member(l.block_ids))
                            for l in cmd.hot_leases],
                transfers=[t if TransferKind(t.kind) is TransferKind.MIRROR
                           else dataclasses.replace(t, device_blocks=member(t.device_blocks))
                           for t in cmd.transfers])
        return self.layout.scale_command(cmd)
