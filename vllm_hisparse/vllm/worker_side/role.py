"""The worker role of ``HiSparseResidencyConnector``: vLLM KV tensors → the worker data plane.

What it binds (``register_kv_caches``): for every sparse-MLA KV cache group of the plan
(``kv_plan.sparse_group_ids``), the uint8 **flat row views** of its layers' KV
(``lanes.GroupRows``). It builds:

* one :class:`~vllm_hisparse.worker.HostPool` holding one page of every sparse-MLA layer per
  host block, sized from ``host_pool_gib`` exactly as the planner and the scheduler size it
  (``kv_plan.planned_host_blocks``), per data-parallel replica and TP rank;
* per sparse group, a **lane** (``lanes.Lane.build``): transfer engine, hot states,
  step executor and one read-path binding per index unit;
* the attention-hook bindings of vLLM's index-group objects (when the model is built).

Device block ids on the wire are the page bundle's **lead** block; each lane rewrites the
command to its own group's blocks (``lanes.py``) from the bundle members the metadata
carries (``metadata.bundles``, every bundle new since the previous step).

Per step: ``start_load_kv`` (before the forward: the scheduler role sets
``has_sync_kv_loads`` on every step that runs one) applies the command to every lane
(tables, leases, pre-forward transfers, fence), lets the prefill guard check R1 and rewrite
the tracked prefills' block-table rows, and opens the step for the attention hook (group
method and routed direct conversion sites); the forward reads through the hook;
``wait_for_save`` launches the post-forward spills and mirrors; ``build_worker_meta`` votes
the lanes' acks (``core.ack_vote``) and reports them under this worker's rank.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vllm_hisparse.core.ack_vote import AckVote
from vllm_hisparse.core.commands import StepCommand, WorkerAcks
from vllm_hisparse.core.host_layout import choose_host_layout
from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata
from vllm_hisparse.vllm.metrics import HiSparseWorkerStats
from vllm_hisparse.vllm.pd.reads import PDReads, pd_reads_for, refuse_imports
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME, HiSparseResidencyConfig
from vllm_hisparse.vllm.setup.host_sharing import plan_host_pool_sharing
from vllm_hisparse.vllm.setup.kv_plan import (
    indexer_group_ids,
    planned_host_blocks,
    sparse_group_ids,
)
from vllm_hisparse.vllm.worker_side import score_tap
from vllm_hisparse.vllm.worker_side.lanes import GroupRows, Lane
from vllm_hisparse.vllm.worker_side.prefill_guard import PrefillGuard
from vllm_hisparse.vllm.worker_side.prefix_loads import PrefixLoads
from vllm_hisparse.vllm.worker_side.read_path import (
    IndexGroupResidency,
    hooked_conversion,
    routed_direct_conversion,
)
from vllm_hisparse.vllm.worker_side.step_view import StepView
from vllm_hisparse.vllm.worker_side.trace_recording import TraceRecording
from vllm_hisparse.vllm.worker_side.tracked import TrackedRequests
from vllm_hisparse.worker import HostPool
from vllm_hisparse.worker.counter_reader import AsyncCounterReader
from vllm_hisparse.worker.hot_counts import RowHotCounts

logger = logging.getLogger("vllm_hisparse.vllm")


class WorkerRole:
    """Worker side of ``HiSparseResidencyConnector`` (see the module docstring).

    Its parts, each called by name:

    * ``lanes`` (:class:`~.lanes.Lane`, one per sparse-MLA group, built at
      ``register_kv_caches``): the data plane; the role hands each its share of the command
      and votes their acks;
    * ``tracked`` (:class:`~.tracked.TrackedRequests`): which requests are residency-managed,
      and the batch's state rows;
    * ``prefill_guard`` (:class:`~.prefill_guard.PrefillGuard`, with the lanes): R1 and the
      block-table rewrite of tracked prefills;
    * ``prefix_loads`` (:class:`~.prefix_loads.PrefixLoads`): indexer page saves and loads,
      host-prefix load outcomes;
    * ``pd_reads`` (:class:`~vllm_hisparse.vllm.pd.reads.PDReads`, None when this instance
      reads no P/D imports): P/D host landings;
    * ``trace`` (:class:`~.trace_recording.TraceRecording`, None unless ``record_trace``);
    * ``host_pool`` and ``step_view`` (the read path's per-step view), shared by the lanes.

    Verbs it answers (the connector façade's): ``register_kv_caches``,
    ``bind_step_metadata``, ``start_load_kv``, ``wait_for_save``, ``build_worker_meta``,
    ``get_transfer_results``, ``get_stats``, ``shutdown``; for tests and tools also
    ``bind_model_index_groups``, ``bind_index_group`` and ``enable_hot_counts``.

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
        # This worker's place among the replica's workers (the scheduler votes per rank).
        pc = vllm_config.parallel_config
        self.worker_rank = int(pc.rank) % max(1, int(pc.world_size))
        self.writes_host = True  # False on TP ranks that map another rank's shared host pool
        self.indexer_group_ids = indexer_group_ids(kv_cache_config)
        self._fail_transfer = fail_transfer
        self._huge_pages = huge_pages
        # The indexer's decode scores, with score-aware eviction (vllm/worker_side/score_tap.py).
        self._scores = score_tap.TAP if hisparse_config.hot_region_eviction == "score" else None

        # Parts; the lanes and what reads them exist once the KV caches are bound.
        self.host_pool: HostPool | None = None
        self.step_view: StepView | None = None
        self.lanes: list[Lane] = []
        self.prefill_guard: PrefillGuard | None = None
        self.tracked = TrackedRequests()
        self.prefix_loads = PrefixLoads()
        self.pd_reads: PDReads | None
        self.pd_reads, self._pd_off_reason = pd_reads_for(vllm_config)
        self.trace = (TraceRecording(top_k=hisparse_config.top_k, block_size=self.block_size,
                                     path=hisparse_config.record_trace, tracked=self.tracked)
                      if hisparse_config.record_trace else None)

        # Every transfer runs in each sparse group's executor: one vote over them.
        self._vote = AckVote(len(self.sparse_group_ids), "sparse-group executor")
        self._pending_acks: list[WorkerAcks] = []
        # lead block id -> that page's block id in every sparse group (G > 1 only).
        self._bundles: dict[int, list[int]] = {}
        self._counter_reader: AsyncCounterReader | None = None
        self._hot_counts: RowHotCounts | None = None
        self._stats = HiSparseWorkerStats()
        self._reported_counters = np.zeros(0, dtype=np.int64)
        self._reported_bytes = (0, 0)
        self._in_step = False
        self._closed = False

    # ================================================================== binding

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Bind the sparse-MLA layers' KV tensors; build host pool, lanes and hook bindings.

        ``kv_caches``: layer name → that layer's cache as vLLM allocated it
        (``[num_blocks, 1, block_size, C]`` per MLA layer, block-outermost)."""
        if self.lanes:
            raise RuntimeError(f"{CONNECTOR_NAME}: register_kv_caches called twice")
        groups: list[GroupRows] = []
        for group_id in self.sparse_group_ids:  # every sparse-MLA layer has the same rows
            groups.append(GroupRows.of_group(self.kv_cache_config, group_id, kv_caches,
                                             self.block_size,
                                             groups[0].row_bytes if groups else None))
        row_bytes = groups[0].row_bytes
        device = groups[0].device_layers[0].device
        num_layers = sum(len(g.layer_names) for g in groups)
        indexer_segment = self._bind_host_pool(groups, num_layers, row_bytes, device)
        self.step_view = StepView(
            self.max_num_seqs, device,
            max_num_tokens=self.vllm_config.scheduler_config.max_num_batched_tokens,
            current_forward=compat.current_forward_context)
        self._build_lanes(groups)
        self.prefill_guard = PrefillGuard(self.lanes, self.config.max_decode_query_len)
        if self.trace is not None:
            self.trace.number_groups([name for lane in self.lanes for name in lane.leader_names])
        if self.config.adaptive_hot_region:
            self.enable_hot_counts()
        self.prefix_loads.bind(kv_caches, self.kv_cache_config, self.indexer_group_ids,
                               host_num_blocks=self.host_num_blocks,
                               ops_backend=self.config.ops_backend, huge_pages=self._huge_pages,
                               segment=indexer_segment, writes_host=self.writes_host)
        if self.pd_reads is not None:
            self.pd_reads.bind(self.vllm_config, self.kv_cache_config, kv_caches, self.lanes,
                               self.host_pool.layers, indexer_group_ids=self.indexer_group_ids,
                               block_size=self.block_size, rank=self.worker_rank,
                               writes_host=self.writes_host, ops_backend=self.config.ops_backend)
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

    def _bind_host_pool(self, groups: list[GroupRows], num_layers: int, row_bytes: int,
                        device: torch.device) -> Any:
        """The sparse-MLA host pool. TP ranks of one node share one pool; only the writer
        rank copies device -> host. Returns the shared segment of the indexer page store."""
        sharing = plan_host_pool_sharing(self.vllm_config)
        tp_rank = compat.tensor_parallel_rank(self.vllm_config)
        self.writes_host = sharing.writes_host(tp_rank)
        logger.info("%s worker: %s", CONNECTOR_NAME, sharing.describe(tp_rank))
        pool_layout = choose_host_layout(
            self.config.host_layout, [len(u) for g in groups for u in g.units],
            self.host_num_blocks * self.block_size * row_bytes)
        logger.info("%s worker: host pool %s", CONNECTOR_NAME, pool_layout.reason)
        self.host_pool = HostPool(num_layers, self.host_num_blocks, self.block_size, row_bytes,
                                  huge_pages=self._huge_pages, layout=pool_layout.layout,
                                  pin=device.type == "cuda", shared=sharing.segment(tp_rank))
        return sharing.segment(tp_rank, suffix="-indexer")

    def _build_lanes(self, groups: list[GroupRows]) -> None:
        """One lane per sparse group, over its slice of the host pool's layers."""
        recorder = self.trace.callback if self.trace is not None else None
        first_host_layer = 0
        for sparse_index, rows in enumerate(groups):
            end = first_host_layer + len(rows.layer_names)
            host_layers = self.host_pool.layers[first_host_layer:end]
            first_host_layer = end
            self.lanes.append(Lane.build(
                rows, sparse_index, host_layers, config=self.config,
                num_state_rows=self.num_state_rows, max_pages=self.max_pages,
                step=self.step_view, writes_host=self.writes_host,
                fail_transfer=self._fail_transfer, scores=self._scores, recorder=recorder))

    def enable_hot_counts(self) -> RowHotCounts:
        """Count misses per state row and report them (rank 0) in ``hot_counts``: on with
        ``adaptive_hot_region``; the simulator turns it on to measure fixed regions too (not
        in timing runs: ``SimulationSpec.count_request_misses``).
        Only the first index group counts: one group samples a request's rate, and counting
        in every group would add several small kernels to each sparse layer."""
        if self._hot_counts is None:
            self._hot_counts = self.lanes[0].count_row_misses(self.num_state_rows)
        return self._hot_counts

    @property
    def hot_counts(self) -> RowHotCounts | None:
        """The per-row miss counters :meth:`enable_hot_counts` turned on, or None."""
        return self._hot_counts

    def bind_model_index_groups(self, forward_context: dict[str, Any]) -> int:
        """Attach each unit's binding to vLLM's index-group object of its layers.

        ``forward_context``: layer name → attention module (vLLM's static forward
        context). Returns how many groups were bound (0 before the model exists)."""
        return sum(lane.bind_model_index_groups(forward_context) for lane in self.lanes)

    @staticmethod
    def bind_index_group(group: Any, binding: IndexGroupResidency) -> None:
        """Attach ``binding`` to one vLLM index-group object (tests bind hand-made ones)."""
        binding.attach(group)

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
        the fp8 upconvert workspace) reads the right blocks (``prefill_guard``).
        """
        self._check_bound()
        if self._in_step:
            raise RuntimeError(f"{CONNECTOR_NAME}: start_load_kv called twice without "
                               "wait_for_save in between")
        # A resolve replayed in a CUDA graph never returns to its op wrapper, which raises
        # recorded errors at its next call: poll the record here (pinned memory, no sync).
        self.lanes[0].poll_errors()
        cmd: StepCommand = metadata.command
        if self.trace is not None:
            self.trace.begin_step(cmd.step_id)
        self._apply_bundles(getattr(metadata, "bundles", None) or {})
        self.tracked.apply(cmd)
        request_ids = step_inputs.get("request_ids")
        batch_rows = self.tracked.batch_state_rows(request_ids, cmd, bool(step_inputs))
        self._check_rows(cmd)
        self._vote.expect(t.transfer_id for t in cmd.transfers)
        for lane in self.lanes:
            lane.before_forward(cmd, self._bundles, len(self.lanes))
        if self.pd_reads is not None:  # P/D imports and prefill lease renewals
            self.pd_reads.submit(metadata)
        else:
            refuse_imports(metadata, self._pd_off_reason)
        self.prefix_loads.begin_step(cmd, metadata)
        if batch_rows is not None:
            self.prefill_guard.guard(cmd.step_id, request_ids, batch_rows, step_inputs)
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
        self.prefix_loads.after_forward()  # indexer page saves, ahead of the mirrors
        for lane in self.lanes:
            lane.after_forward()
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
        failed_saves = self.prefix_loads.take_failed_saves()
        # TP ranks resolve the same selections: rank 0's counts stand for the replica.
        hot_counts = (self._hot_counts.poll()
                      if self._hot_counts is not None and self.worker_rank == 0 else {})
        if acks.is_empty() and not failed_saves and not hot_counts:
            return None
        return HiSparseWorkerMetadata(acks=acks, worker_rank=self.worker_rank,
                                      failed_indexer_saves=failed_saves, hot_counts=hot_counts)

    def get_transfer_results(self) -> Any:
        """Loads decided since the last call, per request (vLLM's
        ``KVConnectorTransferResults``): every decided load in ``finished_recving``, the
        failed ones also in ``failed_recving`` (vLLM then fails or recomputes the request
        alone; block-level ``invalid_block_ids`` are refused with several KV cache
        groups). Host-prefix loads (``prefix_loads``) are decided once every sparse group's
        copy is (``AckVote``); P/D host landings (``pd_reads``) are reported the same way."""
        if self.lanes:
            self._poll_acks()
        finished, failed = self.prefix_loads.take_decided()
        if self.pd_reads is not None:
            imported, import_failed = self.pd_reads.poll()
            finished |= imported
            failed |= import_failed
        return compat.KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def _poll_acks(self) -> None:
        """Merge the lanes' acks into the pending report; decide host-prefix loads."""
        acks = self._vote.vote([(i, lane.acks()) for i, lane in enumerate(self.lanes)])
        if acks.is_empty():
            return
        self._stats.add(failed_transfers=len(acks.failed))
        self.prefix_loads.decide(acks)
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
        to_host = sum(l.bytes_moved[0] for l in self.lanes)
        to_device = sum(l.bytes_moved[1] for l in self.lanes)
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
            lane.drain()
        for lane in self.lanes:
            lane.release_layers()
        if self.trace is not None:
            self.trace.save()
        if self.host_pool is not None:
            self.host_pool.close()
        self.prefix_loads.close()
        if self.pd_reads is not None:
            self.pd_reads.close()

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

    @staticmethod
    def _num_real_tokens(num_tokens: Any, scheduler_output: Any) -> int | None:
        """Tokens before CUDA-graph padding: MRV2's ``num_tokens``, else the scheduler total."""
        if num_tokens is None:
            num_tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
        return None if num_tokens is None else int(num_tokens)
