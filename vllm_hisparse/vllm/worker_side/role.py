"""The worker role of ``HiSparseResidencyConnector``: vLLM KV tensors → the worker data plane.

What it binds (``register_kv_caches``): for every sparse-MLA KV cache group of the plan
(``kv_plan.sparse_group_ids``), the uint8 **flat row views** of its layers' KV
(``worker.device_rows.flat_row_view`` over the ``[B, 1, N, C]`` views vLLM's
``allocate_kv_cache`` made; block-outermost packing puts ``block_stride_rows`` flat rows
between a layer's blocks). It builds:

* one :class:`~vllm_hisparse.worker.HostPool` holding one page of every sparse-MLA layer per
  host block, sized from ``host_pool_gib`` exactly as the planner and the scheduler size it
  (``kv_plan.planned_host_blocks``), per data-parallel replica and TP rank;
* per sparse group, a **lane**: a :class:`TransferEngine` over the group's device and host
  layers, one :class:`HotState` per index unit (IndexShare leader + followers share one;
  the lane's HotStates share one residency / host-block table), and a
  :class:`StepExecutor`;
* the attention-hook bindings of vLLM's index-group objects (when the model is built).

Device block ids on the wire are the page bundle's **lead** block; each lane rewrites the
command to its own group's blocks (``lanes.py``) from the bundle members the metadata
carries (``metadata.bundles``, every bundle new since the previous step).

Per step: ``start_load_kv`` (before the forward: the scheduler role sets
``has_sync_kv_loads`` on every step that runs one) applies the
command to every lane (tables, leases, pre-forward transfers, fence), checks that tracked
requests with prefill tokens have no host-only page (R1, ``docs/worker.md``) and rewrites
their rows of the sparse groups' batch block tables, and opens the step for the attention
hook (group method and routed direct conversion sites); the forward reads through the
hook; ``wait_for_save`` launches the post-forward spills and mirrors;
``build_worker_meta`` votes the lanes' acks (``core.ack_vote``) and reports them under
this worker's rank. Indexer pages and host-prefix loads: ``worker_side/host_prefix.py``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vllm_hisparse.core.ack_vote import AckVote
from vllm_hisparse.core.commands import Residency, StepCommand, TransferKind, WorkerAcks
from vllm_hisparse.core.host_layout import choose_host_layout
from vllm_hisparse.core.trace import TraceRecorder
from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.worker_side import score_tap
from vllm_hisparse.vllm.worker_side.read_path import (
    BINDING_ATTR,
    IndexGroupResidency,
    StepView,
    hooked_conversion,
    host_backed_positions,
    routed_direct_conversion,
)
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME, HiSparseResidencyConfig
from vllm_hisparse.vllm.setup.host_sharing import plan_host_pool_sharing
from vllm_hisparse.vllm.setup.kv_plan import (
    indexer_group_ids,
    planned_host_blocks,
    sparse_group_ids,
)
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata
from vllm_hisparse.vllm.worker_side.host_prefix import WorkerHostPrefix
from vllm_hisparse.vllm.worker_side.lanes import Lane
from vllm_hisparse.vllm.pd.reads import PDReads
from vllm_hisparse.vllm.worker_side.prefill_guard import WorkerPrefillGuard
from vllm_hisparse.vllm.metrics import HiSparseWorkerStats
from vllm_hisparse.worker import HostPool, HotState, StepExecutor, TransferEngine
from vllm_hisparse.worker.counter_reader import AsyncCounterReader
from vllm_hisparse.worker.device_rows import DeviceRowLayout, flat_row_view
from vllm_hisparse.worker.hot_counts import RowHotCounts
from vllm_hisparse.worker.indexer_pages import IndexerPageStore
from vllm_hisparse.worker.page_tables import PageTables

logger = logging.getLogger("vllm_hisparse.vllm")


def _layer_number(name: str) -> float:
    """The first dot-separated integer of a layer name (``model.layers.12.self_attn.attn``
    -> 12), or infinity when it has none."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return float("inf")


class WorkerRole(WorkerHostPrefix, PDReads, WorkerPrefillGuard):
    """Worker side of ``HiSparseResidencyConnector`` (see the module docstring).

    Args:
        vllm_config: the engine's ``VllmConfig``.
        hisparse_config: the validated connector config.
        kv_cache_config: the planned KV cache config (split by ``kv_planner``).
        num_state_rows: rows of the per-request tables; must equal the scheduler-side
            policy's ``max_num_rows`` (default ``max_num_seqs``).
        fail_transfer: fault injection passed to every lane's transfer engine (tests, drills).
        huge_pages: host pool page policy (``"auto"`` | ``"never"`` | ``"require"``).
    """

    def __init__(self, vllm_config: Any, hisparse_config: HiSparseResidencyConfig,
                 kv_cache_config: Any, *, num_state_rows: int | None = None,
                 fail_transfer: Callable[[int], bool] | None = None,
                 huge_pages: str = "auto"):
        self.vllm_config = vllm_config
        self.config = hisparse_config
        self.kv_cache_config = kv_cache_config
        self.block_size = hisparse_config.block_size
        self.sparse_group_ids = sparse_group_ids(kv_cache_config)
        self.max_model_len = vllm_config.model_config.max_model_len
        self.max_pages = cdiv(self.max_model_len, self.block_size)
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.num_state_rows = int(num_state_rows or self.max_num_seqs)
        self.host_num_blocks = planned_host_blocks(vllm_config, kv_cache_config, hisparse_config)
        # The indexer's decode scores, with score-aware eviction (vllm/worker_side/score_tap.py).
        self._scores = score_tap.TAP if hisparse_config.hot_region_eviction == "score" else None
        self._fail_transfer = fail_transfer
        self._huge_pages = huge_pages
        self.writes_host = True  # False on TP ranks that map another rank's shared host pool
        self.indexer_group_ids = indexer_group_ids(kv_cache_config)
        self.indexer_pages: IndexerPageStore | None = None
        # This step's indexer page copies (metadata), by the transfer they ride with.
        self._step_indexer_pages: dict[int, Any] = {}
        # Host-prefix loads in flight: RESTORE id -> the request it loads (vLLM waits for
        # it in WAITING_FOR_REMOTE_KVS), and which of them failed (indexer pages).
        self._prefix_loads: dict[int, str] = {}
        self._failed_load_ids: set[int] = set()
        # Loads decided since the last get_transfer_results: finished / failed requests.
        self._finished_loads: set[str] = set()
        self._failed_loads: set[str] = set()
        self._failed_indexer_saves: list[int] = []
        self._pending_acks: list[WorkerAcks] = []
        self.host_pool: HostPool | None = None
        self.lanes: list[Lane] = []
        self.step_view: StepView | None = None
        # Every transfer runs in each sparse group's executor: one vote over them.
        self._vote = AckVote(len(self.sparse_group_ids), "sparse-group executor")
        # This worker's place among the replica's workers (the scheduler votes per rank).
        pc = vllm_config.parallel_config
        self.worker_rank = int(pc.rank) % max(1, int(pc.world_size))
        # lead block id -> that page's block id in every sparse group (G > 1 only).
        self._bundles: dict[int, list[int]] = {}
        # Tracked (residency-managed) requests: id -> state row. A request is tracked from its
        # first non-FULL residency change until its row is cleared: once MIXED/NONE, its pages
        # may sit in blocks that vLLM's batch block table does not name (a restore leases a
        # new block; vLLM's worker table is append-only), even after it is FULL again.
        self._tracked: dict[str, int] = {}
        self._counter_reader: AsyncCounterReader | None = None
        self._hot_counts: RowHotCounts | None = None
        self._in_step = False
        self._stats = HiSparseWorkerStats()
        self._reported_counters = np.zeros(0, dtype=np.int64)
        self._reported_bytes = (0, 0)
        self._trace = (TraceRecorder(top_k=hisparse_config.top_k, block_size=self.block_size,
                                     source="vllm") if hisparse_config.record_trace else None)
        self._trace_ids: dict[str, int] = {}
        # leader layer name -> the trace's index group (model layer order), set at binding.
        self._trace_groups: dict[str, int] = {}
        self._row_request: dict[int, str] = {}
        self._step_id = -1
        self._closed = False
        self._init_imports(vllm_config)  # P/D host landings (pd/reads.py)

    # ================================================================== binding

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Bind the sparse-MLA layers' KV tensors; build host pool, lanes and hook bindings.

        ``kv_caches``: layer name → that layer's cache as vLLM allocated it
        (``[num_blocks, 1, block_size, C]`` per MLA layer, block-outermost)."""
        if self.lanes:
            raise RuntimeError(f"{CONNECTOR_NAME}: register_kv_caches called twice")
        groups = self.kv_cache_config.kv_cache_groups
        per_group: list[tuple[int, list[str], list[list[int]], DeviceRowLayout, list[torch.Tensor]]] = []
        row_bytes = None
        device = None
        for group_id in self.sparse_group_ids:
            names = list(groups[group_id].layer_names)
            views, strides = [], set()
            for name in names:
                if name not in kv_caches:
                    raise ValueError(f"{CONNECTOR_NAME}: register_kv_caches got no tensor for "
                                     f"sparse-MLA layer {name!r} (KV cache group {group_id})")
                rows, stride = flat_row_view(kv_caches[name], self.block_size)
                if row_bytes is None:
                    row_bytes, device = rows.shape[1], rows.device
                if rows.shape[1] != row_bytes:
                    raise ValueError(f"{CONNECTOR_NAME}: sparse-MLA layer {name!r} has "
                                     f"{rows.shape[1]} B rows, others {row_bytes} B")
                views.append(rows)
                strides.add(stride)
            if len(strides) != 1:
                raise ValueError(f"{CONNECTOR_NAME}: layers of KV cache group {group_id} have "
                                 f"different block strides {sorted(strides)}")
            layout = DeviceRowLayout(self.block_size, strides.pop())
            per_group.append((group_id, names, self._index_units(group_id, names), layout, views))
        num_layers = sum(len(names) for _, names, _, _, _ in per_group)
        # TP ranks of one node share one pool; only the writer rank copies device -> host.
        sharing = plan_host_pool_sharing(self.vllm_config)
        tp_rank = compat.tensor_parallel_rank(self.vllm_config)
        self.writes_host = sharing.writes_host(tp_rank)
        logger.info("%s worker: %s", CONNECTOR_NAME, sharing.describe(tp_rank))
        pool_layout = choose_host_layout(
            self.config.host_layout, [len(u) for _, _, units, _, _ in per_group for u in units],
            self.host_num_blocks * self.block_size * row_bytes)
        logger.info("%s worker: host pool %s", CONNECTOR_NAME, pool_layout.reason)
        self.host_pool = HostPool(num_layers, self.host_num_blocks, self.block_size, row_bytes,
                                  huge_pages=self._huge_pages, layout=pool_layout.layout,
                                  pin=device.type == "cuda", shared=sharing.segment(tp_rank))
        self._indexer_segment = sharing.segment(tp_rank, suffix="-indexer")
        self.step_view = StepView(
            self.max_num_seqs, device,
            max_num_tokens=self.vllm_config.scheduler_config.max_num_batched_tokens)
        first_host_layer = 0
        for sparse_index, (group_id, names, units, layout, views) in enumerate(per_group):
            host_layers = self.host_pool.layers[first_host_layer:first_host_layer + len(names)]
            first_host_layer += len(names)
            self.lanes.append(self._build_lane(group_id, sparse_index, names, units, layout,
                                               views, host_layers, device))
        if self._trace is not None:
            self._number_trace_groups()
        if self.config.adaptive_hot_region:
            self.enable_hot_counts()
        self._bind_indexer_pages(kv_caches, self._indexer_segment)
        self._bind_importer(kv_caches)
        patches.TOPK_CONVERSION_HOOK.install(hooked_conversion)
        patches.DIRECT_CONVERSION_ROUTING.install(routed_direct_conversion)
        if self._scores is not None:
            self._scores.enable(self.config.ops_backend)
            patches.INDEXER_SCORES.install(self._scores.record_decode_topk)
        self._counter_reader = AsyncCounterReader(
            [state.stats for lane in self.lanes for state in lane.hot_states])
        self.bind_model_index_groups(compat.static_forward_context(self.vllm_config))
        logger.info("%s worker: %d sparse-MLA layers in %d KV cache groups, %d index units, "
                    "%d host blocks, block stride %s rows", CONNECTOR_NAME, num_layers,
                    len(self.lanes), sum(len(l.units) for l in self.lanes), self.host_num_blocks,
                    [l.layout.block_stride_rows for l in self.lanes])

    def enable_hot_counts(self) -> RowHotCounts:
        """Count misses per state row and report them (rank 0) in ``hot_counts``: on with
        ``adaptive_hot_region``; the simulator turns it on to measure fixed regions too.
        Only the first index group counts: one group samples a request's rate, and counting
        in every group would add ~8 small kernels to each sparse layer."""
        if self._hot_counts is None:
            first = self.lanes[0].hot_states[0]
            self._hot_counts = first.row_counts = RowHotCounts(self.num_state_rows, first.device)
        return self._hot_counts

    def _index_units(self, group_id: int, names: list[str]) -> list[list[int]]:
        """Index units of a group: each leader with the followers after it (per-layer specs)."""
        spec = self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
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

    def _build_lane(self, group_id, sparse_index, names, units, layout, views, host_layers,
                    device) -> Lane:
        engine = TransferEngine(views, host_layers, self.block_size,
                                ops_backend=self.config.ops_backend,
                                fail_transfer=self._fail_transfer, writes_host=self.writes_host)
        # A page is resident in every layer of a group or in none: the unit states of one
        # lane share one page table (written once per step, not once per unit).
        tables = PageTables(self.num_state_rows, self.max_pages, device)
        hot_states = [HotState(self.num_state_rows, self.max_pages, self.config.hot_table_rows,
                               self.block_size, device, ops_backend=self.config.ops_backend,
                               page_tables=tables)
                      for _ in units]
        executor = StepExecutor(hot_states, engine, self.num_state_rows, self.max_pages,
                                self.block_size)
        lane = Lane(group_id, sparse_index, names, units, layout, views, list(host_layers),
                     engine, hot_states, executor)
        for unit, state in zip(units, hot_states):
            lane.bindings.append(IndexGroupResidency(
                hot_state=state,
                host_layers=[host_layers[i] for i in unit],
                device_layers=[views[i] for i in unit],
                layout=layout, step=self.step_view,
                record=(self._trace_recorder(names[unit[0]], state)
                        if self._trace is not None else None),
                gather_mode="side" if self.config.index_share_prefetch else "single",
                prefetch_max_ctas=self.config.prefetch_max_ctas,
                gather_ctas_per_sm=self.config.gather_ctas_per_sm,
                scores=self._scores))
        return lane

    def bind_model_index_groups(self, forward_context: dict[str, Any]) -> int:
        """Attach each unit's binding to vLLM's index-group object of its layers.

        ``forward_context``: layer name → attention module (vLLM's static forward
        context). Returns how many groups were bound (0 before the model exists)."""
        bound = 0
        hisparse_cls = compat.in_tree_hisparse_index_group_class()
        for lane in self.lanes:
            for unit, binding in zip(lane.units, lane.bindings):
                leader_name = lane.layer_names[unit[0]]
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
                    member = compat.layer_index_group(forward_context[lane.layer_names[i]])
                    if member is None or member[0] is not group or member[1] != pos:
                        raise ValueError(
                            f"{CONNECTOR_NAME}: layer {lane.layer_names[i]!r} is not member "
                            f"{pos} of {leader_name!r}'s index group in the model, but the KV "
                            "plan groups them so")
                self.bind_index_group(group, binding)
                for i in unit:  # direct conversion sites need to know the running layer
                    patches.LAYER_FORWARD_CONTEXT.install(forward_context[lane.layer_names[i]].impl)
                bound += 1
        return bound

    @staticmethod
    def bind_index_group(group: Any, binding: IndexGroupResidency) -> None:
        """Attach ``binding`` to one vLLM index-group object (tests bind hand-made ones)."""
        setattr(group, BINDING_ATTR, binding)

    @property
    def bindings(self) -> list[IndexGroupResidency]:
        """Every index unit's binding, lane by lane, in layer order."""
        return [b for lane in self.lanes for b in lane.bindings]

    # ================================================================== per step

    def start_load_kv(self, metadata: HiSparseConnectorMetadata, **step_inputs: Any) -> None:
        """Apply the step's command before the forward and open the step for attention.

        Optional ``step_inputs`` (vLLM MRV2 passes them to the connector's
        ``start_load_kv``; the façade forwards them): ``request_ids`` (batch order) and
        ``scheduler_output`` (for per-request token counts) and, in FULL-graph steps,
        ``attn_metadata``; eager and piecewise steps run inside the forward context, whose
        attention metadata is used instead. Steps with tracked requests need ``request_ids``.

        A tracked request with prefill tokens (more than ``max_decode_query_len``) must have
        no host-only page once the command is applied (requirement R1, ``docs/worker.md``);
        its rows of the sparse groups' batch block tables are rewritten from the worker's
        residency tables, so every vLLM prefill path (sparse MQA, dense / masked MHA,
        the fp8 upconvert workspace) reads the right blocks.
        """
        self._check_bound()
        if self._in_step:
            raise RuntimeError(f"{CONNECTOR_NAME}: start_load_kv called twice without "
                               "wait_for_save in between")
        # A resolve replayed in a CUDA graph never returns to its op wrapper, which raises
        # recorded errors at its next call: poll the record here (pinned memory, no sync).
        self.lanes[0].hot_states[0].poll_errors()
        cmd: StepCommand = metadata.command
        self._step_id = cmd.step_id
        self._apply_bundles(getattr(metadata, "bundles", None) or {})
        self._track_residency(cmd)
        request_ids = step_inputs.get("request_ids")
        batch_rows = self._batch_state_rows(request_ids, cmd, bool(step_inputs))
        self._check_rows(cmd)
        self._vote.expect(t.transfer_id for t in cmd.transfers)
        for lane in self.lanes:
            lane.executor.before_forward(lane.command(cmd, self._bundles, len(self.lanes)))
        self._step_indexer_pages = getattr(metadata, "indexer_pages", None) or {}
        self._submit_imports(metadata)  # P/D imports and prefill lease renewals
        if self._step_indexer_pages:
            self._load_indexer_pages(cmd, metadata)
        if batch_rows is not None:
            self._guard_prefills(cmd.step_id, request_ids, batch_rows, step_inputs)
        self.step_view.begin(cmd.step_id, batch_rows,
                             self._num_real_tokens(step_inputs.get("num_tokens"),
                                                   step_inputs.get("scheduler_output")))
        self._stats.add(steps=1)
        self._in_step = True

    def bind_step_metadata(self, bound: bool = True) -> None:
        """vLLM bound (``bound``) or cleared this step's connector metadata. While bound, a
        forward before ``start_load_kv`` is an error; forwards outside (graph capture, its
        warm-up, dummy batches) see an inert step view (``read_path.uses_residency_path``)."""
        if self.step_view is not None:
            self.step_view.bound = bound

    def wait_for_save(self) -> None:
        """After the forward: launch sealed-page spills and the mirror of written rows."""
        if not self._in_step:
            return  # no forward this step (vLLM may call it on idle steps)
        if self._step_indexer_pages:
            # Before the mirrors: a mirror's completion then implies its pages' saves.
            self._save_indexer_pages()
        for lane in self.lanes:
            lane.executor.after_forward()
        self.step_view.end()
        if self._scores is not None:
            self._scores.drop()
        self._in_step = False

    def build_worker_meta(self) -> HiSparseWorkerMetadata | None:
        """Transfer acks since the last call (every lane merged); None when there are none."""
        if not self.lanes:
            return None
        self._poll_acks()
        parts, self._pending_acks = self._pending_acks, []
        acks = WorkerAcks(enqueued=[t for a in parts for t in a.enqueued],
                          completed=[t for a in parts for t in a.completed],
                          failed=[t for a in parts for t in a.failed])
        failed_saves, self._failed_indexer_saves = self._failed_indexer_saves, []
        # TP ranks resolve the same selections: rank 0's counts stand for the replica.
        hot_counts = (self._hot_counts.poll()
                      if self._hot_counts is not None and self.worker_rank == 0 else {})
        if acks.is_empty() and not failed_saves and not hot_counts:
            return None
        return HiSparseWorkerMetadata(acks=acks, worker_rank=self.worker_rank,
                                      failed_indexer_saves=failed_saves, hot_counts=hot_counts)

    def _poll_acks(self) -> None:
        """Merge the lanes' acks into the pending report; note failed host-prefix loads."""
        acks = self._vote.vote([(i, lane.executor.acks()) for i, lane in enumerate(self.lanes)])
        if acks.is_empty():
            return
        self._stats.add(failed_transfers=len(acks.failed))
        if self._prefix_loads:
            self._decide_prefix_loads(acks)
        self._pending_acks.append(acks)

    def get_stats(self, *, sync: bool = False) -> HiSparseWorkerStats | None:
        """Counters since the previous call (None when nothing happened).

        vLLM calls this after every forward, so the device counters are never read
        synchronously: each call queues a copy of them into pinned host memory behind an
        event and reports the newest copy that has landed, i.e. resolve counts arrive one
        call late (``sync=True`` waits for the current values: shutdown, tests). Byte and
        step counts are host-side and current."""
        if not self.lanes or self._counter_reader is None:
            return None
        values = self._counter_reader.read_now() if sync else self._counter_reader.poll()
        per_state = values.reshape(-1, 3)
        if self._reported_counters.shape != per_state.shape:
            self._reported_counters = np.zeros_like(per_state)
        delta = per_state - self._reported_counters
        self._reported_counters = per_state.copy()
        row_bytes = self.lanes[0].device_layers[0].shape[1]
        unit_layers = np.asarray([len(u) for lane in self.lanes for u in lane.units],
                                 dtype=np.int64)
        to_host = sum(l.executor.bytes_to_host for l in self.lanes)
        to_device = sum(l.executor.bytes_to_device for l in self.lanes)
        self._stats.add(resident=int(delta[:, 0].sum()), hot_hits=int(delta[:, 1].sum()),
                        misses=int(delta[:, 2].sum()),
                        bytes_to_host=to_host - self._reported_bytes[0],
                        bytes_to_device=to_device - self._reported_bytes[1],
                        gather_bytes=int((delta[:, 2] * unit_layers).sum()) * row_bytes)
        self._reported_bytes = (to_host, to_device)
        stats, self._stats = self._stats, HiSparseWorkerStats()
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        """Drain every transfer, write the trace, unbind the model, close the host pool."""
        if self._closed:
            return
        self._closed = True
        for lane in self.lanes:
            lane.engine.wait_all()
        for binding in self.bindings:
            binding.device_layers, binding.host_layers = [], []
        if self._trace is not None:
            self._trace.trace().save(self.config.record_trace)
        for lane in self.lanes:
            lane.host_layers = []
        if self.host_pool is not None:
            self.host_pool.close()
        if self.indexer_pages is not None:
            self.indexer_pages.close()
        if self.importer is not None:
            self.importer.close()

    # ================================================================== helpers

    def _check_bound(self) -> None:
        if self._closed:
            raise RuntimeError(f"{CONNECTOR_NAME}: worker role used after shutdown")
        if not self.lanes:
            raise RuntimeError(f"{CONNECTOR_NAME}: start_load_kv before register_kv_caches")

    def _apply_bundles(self, bundles: dict[int, Sequence[int]]) -> None:
        for lead, members in bundles.items():
            if len(members) != len(self.lanes) or members[0] != lead:
                raise ValueError(f"{CONNECTOR_NAME}: bundle {lead} lists {list(members)}; "
                                 f"expected {len(self.lanes)} blocks starting with the lead")
            self._bundles[int(lead)] = [int(b) for b in members]

    def _check_rows(self, cmd: StepCommand) -> None:
        rows = [*cmd.cleared_rows, *cmd.page_rows, *(l.row for l in cmd.hot_leases)]
        if rows and not 0 <= min(rows) <= max(rows) < self.num_state_rows:
            bad = next(r for r in rows if not 0 <= r < self.num_state_rows)
            raise ValueError(f"{CONNECTOR_NAME}: step {cmd.step_id} names state row {bad}, "
                             f"outside [0, {self.num_state_rows}); the worker's tables must "
                             "have as many rows as the scheduler policy's max_num_rows")

    def _track_residency(self, cmd: StepCommand) -> None:
        cleared = set(cmd.cleared_rows)
        if cleared:
            for rid in [r for r, row in self._tracked.items() if row in cleared]:
                del self._tracked[rid]
        for change in cmd.residency_changes:
            self._row_request[change.row] = change.request_id
            if change.residency != Residency.FULL:
                self._tracked[change.request_id] = change.row

    @staticmethod
    def _num_real_tokens(num_tokens: Any, scheduler_output: Any) -> int | None:
        """Tokens before CUDA-graph padding: MRV2's ``num_tokens``, else the scheduler total."""
        if num_tokens is None:
            num_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        return None if num_tokens is None else int(num_tokens)

    def _batch_state_rows(self, request_ids: Sequence[str] | None, cmd: StepCommand,
                          has_step_inputs: bool) -> list[int] | None:
        """State row per batch row for tracked requests (-1 otherwise); None if none is."""
        if not self._tracked:
            return None
        if request_ids is None and not has_step_inputs and not any(
                t.kind == TransferKind.MIRROR and t.mirror_rows for t in cmd.transfers):
            # A step without a forward: vLLM's no_forward() passes no step inputs (every
            # scheduled request waits for a load); nothing reads or writes a row.
            return None
        if request_ids is None:
            # Without the batch order no token can be mapped to its row: refuse to guess.
            raise RuntimeError(
                f"{CONNECTOR_NAME}: requests are host-backed but start_load_kv got no "
                "request_ids; forward vLLM's start_load_kv keyword arguments to the worker role")
        rows = [self._tracked.get(rid, -1) for rid in request_ids]
        if all(r < 0 for r in rows):
            return None
        return rows

    def _number_trace_groups(self) -> None:
        """Number the index groups for the trace in model layer order (the layer number in
        each leader's name; bind order where a name has none) and name their leaders in the
        trace's meta (``index_group_leaders``)."""
        leaders = [lane.layer_names[unit[0]] for lane in self.lanes for unit in lane.units]
        order = sorted(range(len(leaders)), key=lambda i: (_layer_number(leaders[i]), i))
        self._trace_groups = {leaders[i]: group for group, i in enumerate(order)}
        self._trace.meta["index_group_leaders"] = [leaders[i] for i in order]

    def _trace_recorder(self, leader: str, state: HotState
                        ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The record callback of the index group led by ``leader``: every group records its
        own selections (cross-layer prediction reads them all; ``core.miss_prediction``)."""
        def record(token_rows: torch.Tensor, topk: torch.Tensor) -> None:
            self._record(self._trace_groups[leader], state, token_rows, topk)
        return record

    def _record(self, group: int, state: HotState, token_rows: torch.Tensor,
                topk: torch.Tensor) -> None:
        for row, positions in host_backed_positions(state, token_rows, topk).items():
            rid = self._row_request.get(row, f"row{row}")
            ident = self._trace_ids.setdefault(rid, len(self._trace_ids))
            self._trace.add(ident, self._step_id, positions, group=group)
