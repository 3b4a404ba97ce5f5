"""The simulator engine: vLLM's real scheduler and connector around a synthetic DSA model.

What is real:

* vLLM 0.33's ``VllmConfig`` (over a generated tiny DSA ``config.json``), its KV planning
  (``get_global_kv_cache_groups`` / ``get_kv_cache_configs``, so with the connector configured
  the package's own split), ``Scheduler`` with its ``KVCacheManager`` and ``BlockPool``, and its
  ``Request`` / ``SchedulerOutput`` / ``ModelRunnerOutput`` objects;
* ``HiSparseResidencyConnector`` in **both roles**, constructed by vLLM's
  ``KVConnectorFactory``: the scheduler role inside the ``Scheduler``, the worker role bound
  (``register_kv_caches``) to the per-layer KV tensors that vLLM's own ``allocate_kv_cache``
  makes for the plan, with the host pool, transfer engines, hot states and the ops
  (reference twins on CPU, CUDA kernels on a GPU);
* vLLM's ``SparseMLAIndexGroup`` objects (one per index unit), found by the worker role through
  the static forward context and converted through the installed top-k hook, exactly as the
  sparse-MLA attention backends call it.

What is synthetic: the model runner's per-request block tables, rebuilt here from each
``SchedulerOutput`` as vLLM's model runner does (new requests' block ids, appended
``new_block_ids``, replaced on resume), and the model
(:class:`~.synthetic_attention.SyntheticModel`), which writes the ground-truth KV, draws top-k
selections, converts them through every sparse layer's index group and checks every row
(:mod:`.ground_truth`). The engine samples one fixed token per request whose prompt is
complete.

Any mismatch raises :class:`~.ground_truth.SimulationMismatch` naming the request, step, layer
and position and what the row held instead; any other failure inside a step raises
:class:`~.ground_truth.SimulationFailure` with the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import torch

from vllm_hisparse.core.capacity import host_memory_limit
from vllm_hisparse.core.errors import ProtocolError
from vllm_hisparse.core.units import GIB, cdiv
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.compat import (KVConnectorOutput, ModelRunnerOutput, Request, SamplingParams,
                                       generate_scheduler_kv_cache_config)
from vllm_hisparse.vllm.plugin import register
from vllm_hisparse.vllm.setup.kv_plan import host_page_bytes, indexer_group_ids, sparse_group_ids
from vllm_hisparse.vllm.simulation.ground_truth import SimulationFailure, SimulationMismatch
from vllm_hisparse.vllm.simulation.model import dsa_layer_specs, kv_transfer_config, make_vllm_config, write_model_dir
from vllm_hisparse.vllm.simulation.probe import ProbeRun, StepInfo, StepProbe
from vllm_hisparse.vllm.simulation.ranks import RankThreads
from vllm_hisparse.vllm.simulation.results import Progress, RunResult
from vllm_hisparse.vllm.simulation.scheduler_driver import make_scheduler, plan_kv_cache
from vllm_hisparse.vllm.simulation.scored_indexer import decodes_first
from vllm_hisparse.vllm.simulation.spec import (SAMPLED_TOKEN, RequestPlan, SimulationSpec, make_workload,
                                                prompt_token_ids, token_ids)
from vllm_hisparse.vllm.simulation.synthetic_attention import BatchEntry, RequestState, SyntheticModel, cpu_direct_twin
from vllm_hisparse.vllm.worker_side.read_path import BINDING_ATTR

__all__ = ["SimulationEngine", "SimulationFailure", "SimulationMismatch", "SimulationSpec"]


def _probe_host_gib() -> float:
    """A host pool the config check accepts on this machine (its RAM / cgroup limit)."""
    limit = host_memory_limit().limit_bytes
    return 1024.0 if limit is None else math.floor(limit / GIB * 64) / 64


@contextlib.contextmanager
def _worker_patches_restored() -> Iterator[None]:
    """The worker role patches vLLM process-wide when it binds (top-k hook, direct conversion
    routing); a run removes what it installed."""
    kept = [p for p in (patches.TOPK_CONVERSION_HOOK, patches.DIRECT_CONVERSION_ROUTING)
            if p.installed()]
    try:
        yield
    finally:
        for patch in (patches.TOPK_CONVERSION_HOOK, patches.DIRECT_CONVERSION_ROUTING):
            if patch not in kept:
                patch.remove()


class SimulationEngine:
    """Runs one :class:`SimulationSpec` with and without the connector.

    Args:
        spec: the simulation.
        workdir: where the generated model config goes (default: a temporary directory).
        progress: called after every step with a :class:`Progress`.
        probe: told about every run, step and layer (:mod:`.probe`; timing benchmarks).
    """

    def __init__(self, spec: SimulationSpec, *, workdir: Path | None = None,
                 progress: Callable[[Progress], None] | None = None,
                 probe: StepProbe | None = None):
        spec.validate()
        self.spec = spec
        self.progress = progress
        self.probe = probe
        #: The host pool of the last run, GiB (``spec.host_pool_gib`` or the sized default).
        self.host_pool_gib_used: float | None = None
        self.workload = make_workload(spec)
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="vllm-hisparse-sim-")
            workdir = Path(self._tmp.name)
        self.model_dir = write_model_dir(Path(workdir) / "dsa-tiny", index_topk=spec.top_k,
                                         num_hidden_layers=spec.num_layers,
                                         max_position_embeddings=spec.max_model_len)
        register()  # what vLLM's plugin loader does in every process

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # ------------------------------------------------------------------ building

    def host_pool_gib(self, full_config: Any) -> float:
        """The configured host pool, or one that backs every request of the workload at once
        (plus one spare request), rounded up to 1/64 GiB."""
        if self.spec.host_pool_gib is not None:
            return self.spec.host_pool_gib
        spec = self.spec
        per_block = sum(host_page_bytes(full_config))
        pages = sum(cdiv(p.prompt_len + p.output_len, spec.block_size) for p in self.workload)
        pages += cdiv(spec.max_model_len, spec.block_size)
        return math.ceil(pages * per_block * 1.05 / GIB * 64) / 64

    def _config(self, host_gib: float):
        spec = self.spec
        extra: dict[str, Any] = {**(spec.connector_extra or {}), "host_pool_gib": host_gib,
                                 "ops_backend": spec.ops_backend}
        if spec.device_buffer_size is not None:
            extra["device_buffer_size"] = spec.device_buffer_size
        return make_vllm_config(
            self.model_dir, kv_transfer=kv_transfer_config(extra),
            max_model_len=spec.max_model_len, block_size=spec.block_size,
            max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
            device=("cuda" if spec.device.startswith("cuda") else "cpu"),
            tensor_parallel_size=spec.tensor_parallel_size)

    def _plan(self, vllm_config, num_blocks: int | None = None):
        spec = self.spec
        num_blocks = spec.device_blocks if num_blocks is None else num_blocks
        specs = dsa_layer_specs(spec.num_layers, leaders=spec.leaders, block_size=spec.block_size,
                                row_bytes=spec.mla_row_bytes)
        full = plan_kv_cache(vllm_config, specs, num_blocks)
        # The engine core hands the scheduler each group collapsed to its first layer's spec.
        return full, generate_scheduler_kv_cache_config([full])

    def device_plan(self) -> dict[str, int]:
        """The plan both runs use, from planning alone (nothing allocated):
        ``bytes_per_block`` (device bytes of one block id: its share of the one backing
        allocation every KV cache group overlays),
        ``num_groups``, ``num_sparse_groups``, ``num_indexer_groups`` and
        ``host_block_bytes`` (one page of every sparse-MLA and indexer layer)."""
        # Enough blocks for vLLM's max_model_len check whatever spec.device_blocks says.
        blocks = 16 * cdiv(self.spec.max_model_len, self.spec.block_size)
        full, _ = self._plan(self._config(self.spec.host_pool_gib or _probe_host_gib()), blocks)
        # Every KVCacheTensor is a view of one backing allocation (the groups overlay it), so
        # a block id costs one tensor's share, not the sum over the tensors.
        return dict(bytes_per_block=max(t.size for t in full.kv_cache_tensors) // full.num_blocks,
                    num_groups=len(full.kv_cache_groups),
                    num_sparse_groups=len(sparse_group_ids(full)),
                    num_indexer_groups=len(indexer_group_ids(full)),
                    host_block_bytes=sum(host_page_bytes(full)))

    def run(self, with_connector: bool) -> RunResult:
        """One run of the workload; raises :class:`SimulationFailure` on any failure."""
        spec = self.spec
        label = "with connector" if with_connector else "without connector"
        # Planning only (sizes nothing): the largest pool the config check accepts here.
        probe = self._config(spec.host_pool_gib or _probe_host_gib())
        try:
            full, _ = self._plan(probe)
        except ValueError as exc:
            if "max seq len" not in str(exc):
                raise
            raise ValueError(
                f"--device-blocks={spec.device_blocks} cannot hold one request of the workload's "
                f"longest length ({spec.max_model_len} tokens, "
                f"{spec.max_model_len // spec.block_size} pages in every KV cache group); "
                "accepted: more blocks or shorter "
                f"--prompt-len / --output-len (vLLM: {exc})") from exc
        host_gib = self.host_pool_gib(full)
        self.host_pool_gib_used = host_gib  # the CLI says so when it replaced a file's value
        vllm_config = self._config(host_gib)
        full, sched_config = self._plan(vllm_config)
        if not with_connector:
            # Same plan and pool; vLLM's stock managers, no connector.
            vllm_config.kv_transfer_config = None
        with contextlib.ExitStack() as stack:
            # A run leaves the process as it found it.
            stack.enter_context(_worker_patches_restored())
            if not spec.device.startswith("cuda"):
                stack.enter_context(cpu_direct_twin())
            if spec.tensor_parallel_size == 1:
                runner = _Run(self, label, vllm_config, full, sched_config, with_connector)
            else:  # one model runner + worker per rank, each on its device and thread
                runner = RankThreads(spec, vllm_config, lambda rank, device, config, leader: _Run(
                    self, label, config, full, sched_config, with_connector, rank=rank,
                    device=device, leader=leader))
            try:
                return runner.execute()
            finally:
                runner.close()


class _Run:
    """One run: scheduler, optional worker connector, model runner tables, synthetic model,
    counters."""

    def __init__(self, engine: SimulationEngine, label: str, vllm_config, full_config,
                 sched_config, with_connector: bool, *, rank: int = 0,
                 device: torch.device | None = None, leader: _Run | None = None):
        # A tensor-parallel rank r > 0 (``leader`` given) is a model runner only: it shares
        # rank 0's scheduler and runs the same steps on its own device (ranks.py).
        spec = engine.spec if device is None else dataclasses.replace(engine.spec,
                                                                       device=str(device))
        self.engine, self.spec, self.label, self.rank = engine, spec, label, rank
        self.vllm_config = vllm_config
        self.with_connector = with_connector
        self.device = torch.device(spec.device)
        self.block_size = spec.block_size
        self.result = RunResult(with_connector=with_connector)
        self.num_groups = len(sched_config.kv_cache_groups)
        #: Every rank's model runner (``_add``/``_release`` keep their request tables).
        self.model_runners: list[_Run] = [self]
        #: Runs one engine step's model execution; RankThreads replaces it on rank 0.
        self.execute_model = self._forward
        if leader is None:
            scheduler_cls, _ = compat.scheduler_classes()
            self.scheduler, self._hasher = make_scheduler(scheduler_cls, vllm_config,
                                                          sched_config, self.block_size)
        else:
            self.scheduler = leader.scheduler

        # The per-layer KV tensors vLLM's worker allocates for this plan, and the model.
        layout = compat.resolved_kv_cache_layout(vllm_config)
        kv = compat.allocate_kv_cache(full_config, self.device, layout)
        sequences = {p.serial: token_ids(spec, p) for p in engine.workload}
        self.model = SyntheticModel(spec, full_config, kv,
                                    compat.static_forward_context(vllm_config), sequences)

        self.worker = None
        if with_connector:
            self.worker = compat.KVConnectorFactory.create_connector(
                config=vllm_config, role=compat.KVConnectorRole.WORKER,
                kv_cache_config=full_config)
            self.worker.register_kv_caches(kv)
            unbound = [names[0] for _, names, group in self.model.units
                       if getattr(group, BINDING_ATTR, None) is None]
            if unbound:
                raise SimulationFailure(f"the worker role did not bind the index groups of "
                                        f"{unbound} through the static forward context")
            self.residency = self.scheduler.connector.scheduler_role
            if spec.count_request_misses:
                # Per-request miss rates of fixed regions too (the policy ignores the counts).
                self.worker.worker_role.enable_hot_counts()
            self._request_counts: dict[str, list[int]] = {}
        self.requests: dict[str, RequestState] = {}
        self.step = 0
        self.probe = engine.probe if rank == 0 else None  # it times rank 0's steps
        if self.probe is not None:
            bindings = tuple(getattr(group, BINDING_ATTR) for *_, group in self.model.units
                             ) if with_connector else ()
            self.probe.start_run(ProbeRun(label, with_connector, self.model, bindings,
                                          self.worker.worker_role if with_connector else None,
                                          self.scheduler))

    def close(self) -> None:
        if self.probe is not None:
            self.probe.end_run()
        if self.worker is not None:
            self.worker.shutdown()
        self.model = None

    # ------------------------------------------------------------------ main loop

    def execute(self) -> RunResult:
        spec, result = self.spec, self.result
        started = time.perf_counter()
        pending = sorted(self.engine.workload, key=lambda p: p.arrival_step)
        arrival_clock = 0
        running_sum = 0
        while pending or self.scheduler.has_requests():
            if not self.scheduler.has_requests() and pending:
                arrival_clock = max(arrival_clock, pending[0].arrival_step)  # idle: fast-forward
            while pending and pending[0].arrival_step <= arrival_clock:
                self._add(pending.pop(0))
            if self.step >= spec.max_steps:
                raise SimulationFailure(
                    f"{self.label}: not finished after --max-steps={spec.max_steps} steps "
                    f"({len(self.scheduler.running)} running, {len(self.scheduler.waiting)} "
                    "waiting)")
            self.step += 1
            arrival_clock += 1
            output = self.scheduler.schedule()
            running = len(self.scheduler.running)
            result.peak_running = max(result.peak_running, running)
            running_sum += running
            result.preemptions += len(output.preempted_req_ids or ())
            try:
                runner_output = self.execute_model(output)
            except SimulationFailure:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure names its step
                raise SimulationFailure(f"{self.label}, step {self.step}: {type(exc).__name__}: "
                                        f"{exc}") from exc
            engine_outputs = self.scheduler.update_from_output(output, runner_output)
            for outputs in engine_outputs.values():
                if self.probe is not None and outputs.scheduler_stats is not None:
                    self.probe.scheduler_stats(self.step, outputs.scheduler_stats)
                for out in outputs.outputs:
                    result.generated_tokens += len(out.new_token_ids)
                    if out.finish_reason is not None:
                        result.finished += 1
                        self._release(out.request_id)
            self._account_blocks()
            if self.engine.progress is not None:
                self.engine.progress(Progress(
                    self.label, self.step, running, len(self.scheduler.waiting),
                    result.finished, len(self.engine.workload),
                    self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                    result.resident, result.hot_hits, result.misses))
        result.steps = self.step
        result.mean_running = running_sum / max(1, self.step)
        if result.finished != len(self.engine.workload):
            raise SimulationFailure(f"{self.label}: {result.finished} of "
                                    f"{len(self.engine.workload)} requests finished")
        self._check_no_leaks()
        if self.worker is not None:
            self._collect_policy_stats()
        result.wall_s = time.perf_counter() - started
        return result

    def _add(self, plan: RequestPlan) -> None:
        request = Request(request_id=plan.request_id,
                          prompt_token_ids=prompt_token_ids(self.spec, plan),
                          sampling_params=SamplingParams(max_tokens=plan.output_len,
                                                         ignore_eos=True),
                          pooling_params=None, block_hasher=self._hasher)
        for runner in self.model_runners:
            runner.requests[plan.request_id] = RequestState(plan)
        self.scheduler.add_request(request)

    def _release(self, rid: str) -> None:
        for runner in self.model_runners:
            state = runner.requests.pop(rid, None)
            if state is not None and runner.model.truth is not None:
                runner.model.truth.release(state.plan.serial)

    # ------------------------------------------------------------------ the model runner

    def _update_tables(self, so) -> None:
        """The model runner's per-request block tables, from the scheduler output only."""
        sparse_groups, indexer_groups = self.model.sparse_groups, self.model.indexer_groups
        for rid in so.finished_req_ids or ():
            state = self.requests.get(rid)
            if state is not None:
                state.block_ids = None
        for rid in so.preempted_req_ids or ():
            state = self.requests.get(rid)
            if state is not None:
                state.block_ids = None
        for new in so.scheduled_new_reqs:
            state = self.requests[new.req_id]
            state.block_ids = [list(new.block_ids[g]) for g in sparse_groups]
            state.indexer_block_ids = [list(new.block_ids[g]) for g in indexer_groups]
            state.next_pos = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = [list(new_ids[g]) for g in sparse_groups]
                state.indexer_block_ids = [list(new_ids[g]) for g in indexer_groups]
                state.next_pos = cached.num_computed_tokens[i]
            else:
                if state.block_ids is None:
                    raise SimulationFailure(f"step {self.step}: {rid} scheduled as a running "
                                            "request the model runner does not hold")
                if new_ids is not None:
                    for g, table in zip(sparse_groups, state.block_ids):
                        table.extend(new_ids[g])
                    for g, table in zip(indexer_groups, state.indexer_block_ids):
                        table.extend(new_ids[g])
                if cached.num_computed_tokens[i] != state.next_pos:
                    raise SimulationFailure(
                        f"step {self.step}: {rid} resumes at position "
                        f"{cached.num_computed_tokens[i]}, the model runner expected "
                        f"{state.next_pos}")

    def _forward(self, so) -> ModelRunnerOutput:
        """One engine step's model execution, in the order vLLM's GPU model runner runs it."""
        self._update_tables(so)
        req_ids = list(so.num_scheduled_tokens)
        batch: list[BatchEntry] = []
        for rid in req_ids:
            state = self.requests[rid]
            batch.append((rid, state, state.next_pos, so.num_scheduled_tokens[rid]))
        if self.model.scored is not None:  # logits row i is batch row i (model runner order)
            batch = decodes_first(batch)
            req_ids = [rid for rid, *_ in batch]
        model = self.model
        metadata = model.attention_metadata(batch) if batch else {}
        info = StepInfo(self.step, len(batch), sum(n for *_, n in batch),
                        bool(batch) and all(n == 1 and start >= state.plan.prompt_len
                                            for _, state, start, n in batch),
                        len(self.scheduler.running))
        probe = self.probe
        attend = bool(batch) and (probe is None or probe.wants_attention(info))
        # The indexers' output and (without a ground truth) the slot mapping, before the
        # forward (a probe times from here on).
        topk, spans = model.selections(batch) if attend else (None, [])
        slots = model.slot_mapping(batch, self.step) if batch and model.truth is None else None
        if probe is not None:
            probe.before_forward(info)
        worker = self.worker
        if worker is not None:
            # KVConnector.pre_forward: bind the metadata, then (has_sync_kv_loads) the load
            # with MRV2's keyword arguments.
            worker.bind_connector_metadata(so.kv_connector_metadata)
            kwargs = {}
            if batch:
                kwargs = dict(scheduler_output=so, request_ids=req_ids,
                              num_tokens=sum(n for *_, n in batch), attn_metadata=metadata)
            worker.start_load_kv(None, **kwargs)
        if batch and probe is not None:
            probe.write_kv(info, lambda: model.write_kv(batch, self.step, slots))
        elif batch:
            model.write_kv(batch, self.step, slots)
        # After the writes: vLLM's prefix cache may hand a request blocks that another
        # request of this very step computes.
        if self.spec.check and model.indexer_layers:
            self._check_indexer_prefixes(so)
        if attend and probe is not None and probe.replaces_attention(info):
            probe.attend(info, metadata, topk)  # a timing probe's own forward (no checks)
        elif attend:
            after_layer = None if probe is None else (
                lambda name, rows, counts: probe.after_layer(info, name, rows, counts))
            rows, tokens = model.attend(batch, metadata, topk, spans, fail=self._fail,
                                        request_note=self._residency_note,
                                        after_layer=after_layer)
            self.result.rows_checked += rows
            self.result.tokens_checked += tokens
        for _, state, start, n in batch:
            state.next_pos = start + n
        connector_output = None
        if worker is not None:
            worker.wait_for_save()
        if probe is not None:
            probe.after_forward(info)
        if worker is not None:
            loads = worker.get_transfer_results(set())
            meta = worker.build_connector_worker_meta()
            if meta is not None and meta.hot_counts:
                self._count_requests(meta.hot_counts)
            stats = worker.get_kv_connector_stats()
            if stats is not None:
                self._add_worker_stats(stats)
            worker.clear_connector_metadata()
            # The worker's counters ride to the scheduler as vLLM's model runner sends them,
            # which folds them into its own connector's report (Scheduler.update_from_output).
            connector_output = KVConnectorOutput(
                kv_connector_worker_meta=meta, finished_recving=loads.finished_recving or None,
                failed_recving=loads.failed_recving, kv_connector_stats=stats)
        sampled = []
        for rid, state, start, n in batch:
            sampled.append([SAMPLED_TOKEN] if start + n >= state.plan.prompt_len else [])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled,
                                 kv_connector_output=connector_output)

    def _check_indexer_prefixes(self, so) -> None:
        """Requests that start this step with computed tokens (a prefix hit, local or from
        the host tier, or a resume) must find their indexer KV in place for all of them."""
        starts = [(new.req_id, new.num_computed_tokens) for new in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        starts += [(rid, cached.num_computed_tokens[i]) for i, rid in enumerate(cached.req_ids)
                   if rid in cached.resumed_req_ids]
        for rid, computed in starts:
            if computed <= 0:
                continue
            wrong = self.model.indexer_prefix_mismatch(self.requests[rid], computed)
            if wrong is not None:
                layer, p, got, want = wrong
                raise SimulationMismatch(
                    f"{self.label}, step {self.step}: {rid} starts with {computed} computed "
                    f"tokens but indexer layer {layer} holds wrong KV at position {p} "
                    f"(got {got}, want {want})",
                    request=rid, step=self.step, layer=layer, position=p)
            self.result.indexer_rows_checked += computed * len(self.model.indexer_layers)

    def _residency_note(self, rid: str) -> str:
        if self.worker is None:
            return ""
        try:
            return f" [request residency {self.residency.policy.residency(rid).name}]"
        except ProtocolError:  # the policy no longer tracks the request
            return ""

    def _fail(self, rid: str, layer: int, token_pos: int, what: str) -> None:
        raise SimulationMismatch(
            f"MISMATCH {self.label}: request {rid}, step {self.step}, layer {layer}, token at "
            f"position {token_pos}: {what}", request=rid, step=self.step, layer=layer,
            position=token_pos)

    # ------------------------------------------------------------------ accounting

    def _add_worker_stats(self, stats) -> None:
        d = stats.reduce()
        r = self.result
        r.resident += int(d["resident"])
        r.hot_hits += int(d["hot_hits"])
        r.misses += int(d["misses"])
        r.gather_bytes += int(d["gather_bytes"])
        r.restore_bytes += int(d["bytes_to_device"])
        r.bytes_h2d += int(d["bytes_to_device"]) + int(d["gather_bytes"])
        r.bytes_d2h += int(d["bytes_to_host"])

    def _count_requests(self, hot_counts: dict[int, tuple[int, int]]) -> None:
        """Per-request (misses, host-backed selections), by the request now in each row (a
        row's first counts after it changed hands, one step late, may be its last owner's;
        counts of a row nobody holds are dropped). The worst rate is over requests with at
        least 8 * top_k selections counted (one sizing window of decode steps)."""
        policy = self.residency.policy
        rid_of = {policy.row_of(rid): rid for rid in policy.request_ids()}
        for row, (misses, refs) in hot_counts.items():
            if row in rid_of:
                acc = self._request_counts.setdefault(rid_of[row], [0, 0])
                acc[0] += misses
                acc[1] += refs
        floor = 8 * self.spec.top_k
        rates = [m / r for m, r in self._request_counts.values() if r >= floor]
        self.result.worst_request_miss_rate = max(rates, default=0.0)

    def _account_blocks(self) -> None:
        if self.worker is not None:
            policy = self.residency.policy
            held = [n for n in map(len, map(policy.hot_block_ids, policy.request_ids())) if n]
            self.result.hot_block_steps += sum(held)
            self.result.hot_request_steps += len(held)
        pool = self.scheduler.kv_cache_manager.block_pool
        in_use = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        r = self.result
        r.peak_blocks_in_use = max(r.peak_blocks_in_use, in_use)
        # What full residency would hold for the same running requests: every page of every
        # group for the tokens computed so far.
        need = sum(cdiv(req.num_computed_tokens, self.block_size) for req in self.scheduler.running)
        saved = need * self.num_groups - in_use
        r.peak_blocks_saved = max(r.peak_blocks_saved, saved)

    def _collect_policy_stats(self) -> None:
        s = self.residency.policy.stats
        r = self.result
        r.demotions = int(s.num_demotions)
        r.promotions = int(s.num_promotions)
        r.released_pages = int(s.num_pages_released)
        r.host_prefix_hit_tokens = int(s.num_prefix_load_pages) * self.block_size
        r.published_pages = int(s.num_published_pages)
        r.hot_grows, r.hot_shrinks = int(s.num_hot_grows), int(s.num_hot_shrinks)

    def _check_no_leaks(self) -> None:
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        problems = []
        if sched.requests:
            problems.append(f"requests left in the scheduler: {sorted(sched.requests)[:4]}")
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
            problems.append(f"{pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()} device "
                            "blocks still in use")
        if self.worker is not None:
            residency = self.residency
            if not residency.is_idle():
                problems.append(f"the residency policy is not idle ({residency.policy.num_requests}"
                                f" requests, {residency.policy.num_open_transfers} transfers)")
            host = residency.host_pool
            if host.num_free_blocks + host.num_cached_blocks != host.num_blocks:
                problems.append("host blocks still referenced")
        if problems:
            raise SimulationFailure(f"{self.label}: leaks after the run: " + "; ".join(problems))
