"""A lane: one sparse-MLA KV cache group's share of the worker's data plane, and the step
command in that group's block ids.

:meth:`Lane.build` makes one from the group's layers: a :class:`TransferEngine` over its
device and host layers, one :class:`HotState` per index unit (IndexShare leader + followers
share one; the lane's HotStates share one residency / host-block table, ``PageTables``), a
:class:`StepExecutor`, and one :class:`IndexGroupResidency` binding per unit, which
:meth:`Lane.bind_model_index_groups` attaches to vLLM's index-group objects.

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
from typing import Any, Callable

import torch

from vllm_hisparse.core.commands import StepCommand, TransferKind, WorkerAcks
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME, HiSparseResidencyConfig
from vllm_hisparse.vllm.worker_side.conversion_stream import ConversionStream
from vllm_hisparse.vllm.worker_side.read_path import IndexGroupResidency
from vllm_hisparse.vllm.worker_side.score_tap import ScoreTap
from vllm_hisparse.vllm.worker_side.step_view import StepView
from vllm_hisparse.worker import HotState, StepExecutor, TransferEngine
from vllm_hisparse.worker.device_rows import DeviceRowLayout, flat_row_view
from vllm_hisparse.worker.hot_counts import RowHotCounts
from vllm_hisparse.worker.page_tables import PageTables

#: ``(leader layer name, its unit's HotState) -> record callback``: the trace's recorder
#: (``trace_recording.TraceRecording.callback``).
RecorderFactory = Callable[[str, HotState], Callable[[torch.Tensor, torch.Tensor], None]]


@dataclass
class GroupRows:
    """One sparse-MLA KV cache group's layers as the worker addresses them."""

    group_id: int
    layer_names: list[str]
    units: list[list[int]]  # index units as positions into layer_names, leader first
    layout: DeviceRowLayout
    device_layers: list[torch.Tensor]  # uint8 flat row views, one per layer

    @property
    def row_bytes(self) -> int:
        return int(self.device_layers[0].shape[1])

    @classmethod
    def of_group(cls, kv_cache_config: Any, group_id: int, kv_caches: Mapping[str, torch.Tensor],
                 block_size: int, row_bytes: int | None = None) -> "GroupRows":
        """The flat row views of ``group_id``'s layers (``[B, 1, N, C]`` views vLLM's
        ``allocate_kv_cache`` made, block-outermost: ``block_stride_rows`` flat rows between
        a layer's blocks) and its index units. Raises ``ValueError`` on a missing tensor,
        rows other than ``row_bytes`` (the other groups'; None: the group's first layer's)
        or layers whose block strides differ."""
        names = list(kv_cache_config.kv_cache_groups[group_id].layer_names)
        views, strides = [], set()
        for name in names:
            if name not in kv_caches:
                raise ValueError(f"{CONNECTOR_NAME}: register_kv_caches got no tensor for "
                                 f"sparse-MLA layer {name!r} (KV cache group {group_id})")
            rows, stride = flat_row_view(kv_caches[name], block_size)
            if row_bytes is None:
                row_bytes = rows.shape[1]
            if rows.shape[1] != row_bytes:
                raise ValueError(f"{CONNECTOR_NAME}: sparse-MLA layer {name!r} has "
                                 f"{rows.shape[1]} B rows, others {row_bytes} B")
            views.append(rows)
            strides.add(stride)
        if len(strides) != 1:
            raise ValueError(f"{CONNECTOR_NAME}: layers of KV cache group {group_id} have "
                             f"different block strides {sorted(strides)}")
        layout = DeviceRowLayout(block_size, strides.pop())
        return cls(group_id, names, index_units(kv_cache_config, group_id, names), layout, views)


def index_units(kv_cache_config: Any, group_id: int, names: list[str]) -> list[list[int]]:
    """Index units of a group: each leader with the followers after it (per-layer specs)."""
    spec = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None) or {n: spec for n in names}
    units: list[list[int]] = []
    for i, name in enumerate(names):
        leader = bool(getattr(specs[name], "is_index_group_leader", True))
        if leader or not units:
            if not leader:
                raise ValueError(f"{CONNECTOR_NAME}: KV cache group {group_id} starts with "
                                 f"IndexShare follower {name!r} (no leader before it)")
            units.append([i])
        else:
            units[-1].append(i)
    return units


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
    #: Leaders convert on their index group's side stream (config ``overlap_conversion``).
    overlap_conversion: bool = True

    @classmethod
    def build(cls, rows: GroupRows, sparse_index: int, host_layers: Sequence[torch.Tensor], *,
              config: HiSparseResidencyConfig, num_state_rows: int, max_pages: int,
              step: StepView, writes_host: bool,
              fail_transfer: Callable[[int], bool] | None = None,
              scores: ScoreTap | None = None, recorder: RecorderFactory | None = None) -> "Lane":
        """The lane of one sparse group.

        Args:
            rows: the group's layers (:meth:`GroupRows.of_group`).
            sparse_index: the group's position among the sparse groups.
            host_layers: the host pool's views of the same layers, in the same order.
            config: the connector config (ops backend, hot table width, gather launch
                shape: ``index_share_prefetch``, ``prefetch_max_ctas``, ``gather_ctas_per_sm``).
            num_state_rows, max_pages: shape of the per-request tables.
            step: the worker's per-step view, read by every binding.
            writes_host: this rank copies device → host (one writer per shared pool).
            fail_transfer: fault injection of the transfer engine (tests, drills).
            scores: the indexer score tap with score-aware eviction, else None.
            recorder: the trace's callback factory when a trace is recorded, else None.
        """
        device = rows.device_layers[0].device
        views, units, names = rows.device_layers, rows.units, rows.layer_names
        engine = TransferEngine(views, list(host_layers), config.block_size,
                                ops_backend=config.ops_backend,
                                fail_transfer=fail_transfer, writes_host=writes_host)
        # A page is resident in every layer of a group or in none: the unit states of one
        # lane share one page table (written once per step, not once per unit).
        tables = PageTables(num_state_rows, max_pages, device)
        hot_states = [HotState(num_state_rows, max_pages, config.hot_table_rows,
                               config.block_size, device, ops_backend=config.ops_backend,
                               page_tables=tables)
                      for _ in units]
        executor = StepExecutor(hot_states, engine, num_state_rows, max_pages, config.block_size)
        bindings = [IndexGroupResidency(
            hot_state=state,
            host_layers=[host_layers[i] for i in unit],
            device_layers=[views[i] for i in unit],
            layout=rows.layout, step=step,
            record=recorder(names[unit[0]], state) if recorder is not None else None,
            gather_mode="side" if config.index_share_prefetch else "single",
            prefetch_max_ctas=config.prefetch_max_ctas,
            gather_ctas_per_sm=config.gather_ctas_per_sm,
            scores=scores) for unit, state in zip(units, hot_states)]
        return cls(rows.group_id, sparse_index, names, units, rows.layout, views,
                   list(host_layers), engine, hot_states, executor, bindings,
                   overlap_conversion=config.overlap_conversion)

    @property
    def leader_names(self) -> list[str]:
        """The leader layer of every index unit, in layer order."""
        return [self.layer_names[unit[0]] for unit in self.units]

    def bind_model_index_groups(self, forward_context: Mapping[str, Any]) -> int:
        """Attach each unit's binding to vLLM's index-group object of its layers (see the
        worker role's ``bind_model_index_groups``); returns how many were bound."""
        bound = 0
        hisparse_cls = compat.in_tree_hisparse_index_group_class()
        for unit, binding in zip(self.units, self.bindings):
            leader_name = self.layer_names[unit[0]]
            layer = forward_context.get(leader_name)
            if layer is None:
                continue
            found = compat.layer_index_group(layer)
            if found is None:
                raise ValueError(f"{CONNECTOR_NAME}: sparse-MLA layer {leader_name!r} has "
                                 "no index group (not a sparse-MLA backend?)")
            group, index = found
            if isinstance(group, hisparse_cls):
                raise ValueError(f"{CONNECTOR_NAME}: layer {leader_name!r} uses vLLM's "
                                 "in-tree HiSparse index group; the two cannot run together")
            for pos, i in enumerate(unit):
                member = compat.layer_index_group(forward_context[self.layer_names[i]])
                if member is None or member[0] is not group or member[1] != pos:
                    raise ValueError(
                        f"{CONNECTOR_NAME}: layer {self.layer_names[i]!r} is not member "
                        f"{pos} of {leader_name!r}'s index group in the model, but the KV "
                        "plan groups them so")
            binding.attach(group, conversion_stream_of(group) if self.overlap_conversion
                           else None)
            for i in unit:  # direct conversion sites need to know the running layer
                patches.LAYER_FORWARD_CONTEXT.install(forward_context[self.layer_names[i]].impl)
            bound += 1
        return bound

    def poll_errors(self) -> None:
        """Raise an error a resolve of this device recorded (``HotState.poll_errors``: the
        record is per device, so one hot state answers for all)."""
        self.hot_states[0].poll_errors()

    def count_row_misses(self, num_state_rows: int) -> RowHotCounts:
        """Count misses per state row in this lane's first index unit and return the
        counts (one index group samples a request's miss rate)."""
        first = self.hot_states[0]
        first.row_counts = RowHotCounts(num_state_rows, first.device)
        return first.row_counts

    def before_forward(self, cmd: StepCommand, bundles: Mapping[int, Sequence[int]],
                       num_lanes: int) -> None:
        """Apply this lane's share of the step's command (tables, leases, pre-forward
        transfers, fence)."""
        self.executor.before_forward(self.command(cmd, bundles, num_lanes))

    def after_forward(self) -> None:
        """Launch the post-forward spills and mirrors."""
        self.executor.after_forward()

    def acks(self) -> WorkerAcks:
        """This lane's transfer acks since the last call."""
        return self.executor.acks()

    @property
    def bytes_moved(self) -> tuple[int, int]:
        """Bytes this lane's transfers copied so far: ``(to host, to device)``."""
        return self.executor.bytes_to_host, self.executor.bytes_to_device

    def drain(self) -> None:
        """Wait for every transfer of this lane."""
        self.engine.wait_all()

    def release_layers(self) -> None:
        """Drop the lane's and its bindings' references to the KV and host tensors (at
        shutdown, before the host pool closes)."""
        for binding in self.bindings:
            binding.release_layers()
        self.host_layers = []

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


def conversion_stream_of(group: Any) -> ConversionStream | None:
    """The side stream vLLM converts ``group``'s top-k on, as a :class:`ConversionStream`;
    None where there is none (CPU)."""
    found = compat.index_group_conversion_stream(group)
    if found is None:
        return None
    stream, topk_ready = found
    return ConversionStream(stream, topk_ready, stream.device)
