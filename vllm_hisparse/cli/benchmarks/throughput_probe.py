"""The decode step of ``bench throughput``: every sparse layer's top-k conversion (vLLM's
index group, with the connector through our hook: ``resolve`` + the miss gathers) between the
stand-in work of a model-shaped layer (:mod:`.model_layer`), captured once per batch size as
one CUDA graph and replayed from fixed buffers, as vLLM's ``FULL_AND_PIECEWISE`` runs decode.

A :class:`GraphStepProbe` attaches to the simulator's engine (vLLM 0.33's real ``Scheduler``,
KV planning and ``BlockPool``, the connector's two roles; :mod:`vllm_hisparse.vllm.simulation`).
At the first decode-only step it sets when each running request stops (vLLM's
``max_tokens``), so that the batch steps down through the concurrency ``points``. Per
decode-only step of a batch size in ``points`` it writes the step's inputs into fixed
buffers (the indexers' selections, the batch row of each token, every KV cache group's block
table: what vLLM's model runner copies into its persistent buffers) and replays that size's
graph; the worker role's ``start_load_kv`` and ``wait_for_save`` run around it, outside the
graph, as they do in vLLM. A batch size's graphs are captured between two steps (the step
view inert, as at vLLM's startup capture) at its first decode-only step. With the connector
two graphs are captured per size: the step, and the **oracle**, the same step with the miss
copies left out (rows then stale; nothing is checked here: ``simulate`` checks this path);
timed steps alternate between them. With ``dbo_ceiling`` a third graph, the **two-micro-batch
ceiling**: the oracle step with each layer's model-shaped work run once per half of the
batch (:func:`.model_layer.split_batch`; the conversion still once over the batch), the best
step any dual-batch overlap (one half's gather under the other half's layer) could reach;
timed steps then rotate over the three. A timed step's GPU time runs between CUDA events from
before ``start_load_kv`` to after ``wait_for_save``, with the host's issue hidden: a
``GATE_US`` wait is queued on the GPU first and the start event after it, so the host queues
the whole step before the GPU reaches it (what vLLM's async scheduling gives while the host
is the faster of the two). The step after a batch's timed ones is profiled over the same span
(:mod:`.step_profile`). ``host_ms`` is the host's issue time for the same span, less the
simulator's synthetic KV writes (an op inside vLLM's forward). A step takes the larger of
the two (``ms``): GPU-bound when ``gpu_ms`` is the larger. A host that waited on the GPU
inside the step (a sync: the gate would show in ``host_ms``) is flagged ``host_waited``.

Without CUDA the same steps run eagerly (no capture): a smoke run of the plumbing.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from vllm_hisparse.cli.benchmarks.connector import NoCopyGather
from vllm_hisparse.cli.benchmarks.model_layer import ModelLayerWork, split_batch
from vllm_hisparse.cli.benchmarks.step_profile import StepProfile
from vllm_hisparse.ops import probe as ops_probe
from vllm_hisparse.vllm.simulation.probe import StepProbe

#: The wait queued ahead of a timed step (longer than any step's host issue time), busy on
#: every SM so that the GPU's clocks are up when the step starts, as under steady load.
GATE_US = 60_000
GATE_CTAS = 132
#: Decode-only steps to wait for the last requests to be admitted before the departures are
#: set without them.
STALL_STEPS = 8
#: A connector run's timed kind -> the graph it replays; the forward each graph runs.
GRAPH_OF = {"hybrid": "step", "oracle": "oracle", "dbo_ceiling": "dbo_ceiling"}
FORWARD_OF = {"step": {}, "oracle": dict(oracle=True),
              "dbo_ceiling": dict(oracle=True, micro_batches=2)}


@dataclass
class TimedStep:
    kind: str  # "full", "hybrid", "oracle" or "dbo_ceiling"
    batch: int
    ms: float  # max(gpu_ms, host_ms)
    gpu_ms: float
    host_ms: float
    host_waited: bool = False
    misses: int = 0
    selections: int = 0
    miss_bytes: int = 0
    misses_per_unit: tuple[int, ...] = ()  # each index group's (binding's) misses


@dataclass
class GraphStepProbe(StepProbe):
    """Replays each point's graph and times ``timed_steps`` steps per point after
    ``warmup_steps`` (see the module docstring). ``work``: the stand-ins, shared by the runs of
    one geometry and context (its ``kv_rows`` are set per run)."""

    work: ModelLayerWork
    warmup_steps: int
    timed_steps: int
    min_point: int = 8  # the smallest concurrency point
    points: tuple[int, ...] = ()  # set at the first decode-only step (_plan_departures)
    split_at: int | None = None  # batch size whose step is split by component and profiled
    trace_path: str | None = None  # where the profiled step's chrome trace is kept
    dbo_ceiling: bool = False  # with the connector: time the two-micro-batch ceiling too
    steps: list[TimedStep] = field(default_factory=list)
    split: dict = field(default_factory=dict)
    graphs_captured: int = 0

    # -- departures

    def _plan_departures(self, first_window: int, window: int) -> None:
        """At the first decode-only step: the running requests (by id) leave in cohorts so
        that the batch steps down through ``points`` (from the running count), each held
        for ``window`` steps (``first_window`` for the first)."""
        from vllm_hisparse.cli.benchmarks.model_layer import log_points
        from vllm_hisparse.vllm import compat

        scheduler = self._run.scheduler
        running = sorted(scheduler.running, key=lambda r: r.request_id)
        for request in scheduler.waiting:  # what the pool could not admit: one token, gone
            compat.set_request_max_tokens(request, 1)
        self.points = tuple(log_points(len(running), min(self.min_point, len(running))))
        self.split_at = self.points[0]
        ends = [first_window + j * window for j in range(len(self.points))]
        for rank, request in enumerate(running):
            j = max(k for k, p in enumerate(self.points) if rank < p)
            compat.set_request_max_tokens(request, request.num_output_tokens + ends[j])

    # -- StepProbe
    def start_run(self, run) -> None:
        self._run = run
        model = run.model
        self._cuda = model.device.type == "cuda"
        self._model = model
        names = sorted(model.layers, key=lambda n: model.layers[n][1])
        self._layer_of = {n: i for i, n in enumerate(names)}
        self.work.kv_rows = [model.layers[n][2] for n in names]
        G, K = self.work.max_batch, model.spec.top_k
        pages = -(-model.spec.max_model_len // model.block_size)
        i32 = dict(dtype=torch.int32, device=model.device)
        self._topk = torch.full((G, K), -1, **i32)
        self._req = torch.zeros(G, **i32)
        self._tables = {g: torch.zeros((G, pages), **i32) for g in model.sparse_groups}
        self._q = torch.empty((G, 1), device=model.device)
        self._md: dict[int, dict[str, SimpleNamespace]] = {}
        self._graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if self._cuda else None
        self._seen: dict[int, int] = {}
        self._kind: str | None = None
        self._rows: dict[int, torch.Tensor] = {}
        self._profiling: StepProfile | None = None
        self.steps, self.split, self.graphs_captured = [], {}, 0
        self.points, self.split_at, self._stalled, self._kv_write_s = (), None, 0, 0.0

    def wants_attention(self, step) -> bool:
        return step.decode_only  # prefill steps skip attention (nothing timed there)

    def replaces_attention(self, step) -> bool:
        return True

    def before_forward(self, step) -> None:
        self._kind, self._graph_kind = None, "step"
        if not step.decode_only:
            return
        if not self.points:
            # once every request is in, or decode-only steps keep coming with some waiting
            self._stalled += 1
            if self._run.scheduler.waiting and self._stalled <= STALL_STEPS:
                return
            window = self.warmup_steps + self.timed_steps + 2
            self._plan_departures(window + 1, window)
        n = step.num_requests
        if self._cuda and n in self.points and (n, "step") not in self._graphs:
            self._capture(n)
        index = self._seen.get(n, 0)
        self._seen[n] = index + 1
        timed = index - self.warmup_steps
        if n in self.points and 0 <= timed < self.timed_steps:
            if not self._run.with_connector:
                self._kind = "full"
            else:
                kinds = self.connector_kinds
                self._kind = kinds[timed % len(kinds)]
                self._graph_kind = GRAPH_OF[self._kind]
                self._stats_before = self._counters()
        elif (self._cuda and n == self.split_at and timed == self.timed_steps
              and "kernel_ms" not in self.split):
            # the step after the timed ones, profiled over a timed step's span, gated alike
            self._profiling = StepProfile(GATE_US, self.trace_path)
            self._profiling.start()
            if ops_probe.available():
                ops_probe.spin(GATE_US, ctas=GATE_CTAS, busy=True)
        if self._kind is not None:
            self._watch_syncs = (self._cuda and n == self.split_at and timed == 0
                                 and "syncs" not in self.split)
            if self._watch_syncs:  # name what makes the host wait inside one step
                torch.cuda.set_sync_debug_mode("warn")
                self._sync_log = warnings.catch_warnings(record=True)
                self._sync_records = self._sync_log.__enter__()
                warnings.simplefilter("always")
            self._gated = self._cuda and ops_probe.available()
            if self._cuda:
                if self._gated:
                    ops_probe.spin(GATE_US, ctas=GATE_CTAS, busy=True)
                self._start = torch.cuda.Event(enable_timing=True)
                self._start.record()
            self._kv_write_s = 0.0
            self._host_start = time.perf_counter()

    def write_kv(self, step, write) -> None:
        t0 = time.perf_counter()
        write()
        self._kv_write_s += time.perf_counter() - t0

    def attend(self, step, metadata, topk) -> None:
        n = topk.shape[0]
        self._topk[:n].copy_(topk)
        seen: set[int] = set()
        for name, md in metadata.items():
            g = self._model.layers[name][0]
            if g in seen:
                continue
            if not seen:  # every group's metadata has the same batch rows
                self._req[:n].copy_(md.req_id_per_token[:n])
            seen.add(g)
            self._tables[g][:n, :md.block_table.shape[1]].copy_(md.block_table)
        graph = self._graphs.get((n, self._graph_kind))
        if graph is None:
            self._forward(n, **FORWARD_OF[self._graph_kind])
        else:
            graph.replay()

    def after_forward(self, step) -> None:
        if self._profiling is not None:
            profiling, self._profiling = self._profiling, None
            self.split.update(profiled_batch=step.num_requests, **profiling.stop())
        if self._kind is None:
            return
        issue_ms = (time.perf_counter() - self._host_start) * 1e3
        host_ms = issue_ms - self._kv_write_s * 1e3
        if self._watch_syncs:
            torch.cuda.set_sync_debug_mode("default")
            self._sync_log.__exit__(None, None, None)
            self.split["syncs"] = [_where(w) for w in self._sync_records][:12]
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            gpu_ms = self._start.elapsed_time(end)
        else:
            gpu_ms = host_ms
        timed = TimedStep(self._kind, step.num_requests, max(gpu_ms, host_ms), gpu_ms, host_ms,
                          host_waited=self._gated and issue_ms * 1e3 >= GATE_US)
        if self._run.with_connector:
            after, before = self._counters(), self._stats_before
            d = [a - b for a, b in zip(after[0], before[0])]
            timed.selections, timed.misses = d[0] + d[1] + d[2], d[2]
            timed.miss_bytes = d[3] * self._model.row_bytes
            timed.misses_per_unit = tuple(a - b for a, b in zip(after[1], before[1]))
        self.steps.append(timed)
        if (step.num_requests == self.split_at and "alone_ms" not in self.split
                and self._seen[step.num_requests] == self.warmup_steps + self.timed_steps):
            self.split["alone_ms"] = self._components_alone(step.num_requests)

    def end_run(self) -> None:
        self._graphs.clear()
        self._md.clear()

    @property
    def connector_kinds(self) -> tuple[str, ...]:
        """The kinds a connector run's timed steps rotate over, in order."""
        return ("hybrid", "oracle") + (("dbo_ceiling",) if self.dbo_ceiling else ())

    # -- the forward

    def _metadata(self, n: int) -> dict[str, SimpleNamespace]:
        """Layer name -> fixed-buffer metadata of a batch of ``n`` decode tokens."""
        if n not in self._md:
            per_group = {g: SimpleNamespace(req_id_per_token=self._req[:n],
                                            block_table=table[:n],
                                            block_size=self._model.block_size,
                                            num_actual_tokens=n, num_decode_tokens=n)
                         for g, table in self._tables.items()}
            self._md[n] = {name: per_group[g] for name, (g, *_r) in self._model.layers.items()}
        return self._md[n]

    def _forward(self, n: int, *, oracle: bool = False, micro_batches: int = 1,
                 components=None, convert: bool = True) -> None:
        """Every layer at batch ``n``: the leader's indexer, the layer's KV write and query
        projection, the conversion (unless not ``convert``: the last converted rows are read
        again; vLLM's and ours run beside that projection on the index group's side
        stream, from the event the leader records after its indexer), attention, MLP. With
        ``micro_batches`` > 1 the stand-ins run once per micro-batch (indexer, attention and
        MLP each over its tokens: the weights read once per micro-batch), the conversion
        still once over the batch."""
        model, work = self._model, self.work
        md = self._metadata(n)
        saved = work.components
        if components is not None:
            work.components = components
        spans = split_batch(n, micro_batches)
        gathers = []
        if oracle:
            gathers = [b.swap_gather(NoCopyGather()) for b in self._run.bindings]
        try:
            for leader, (_, names, _) in enumerate(model.units):
                for first, stop in spans:
                    work.indexer(leader, stop, first)
                impl = model.impls[names[0]]
                if convert:
                    impl.topk_indices_buffer[:n].copy_(self._topk[:n])
                    impl.record_logical_topk_ready()  # as vLLM's model does after the indexer
                for name in names:
                    layer = self._layer_of[name]
                    for first, stop in spans:
                        work.before_attention(layer, stop, first)
                    if convert:
                        rows, _ = model.impls[name].forward_mqa(self._q[:n], model.kv[name],
                                                                md[name], None)
                        self._rows[layer] = rows
                    for first, stop in spans:
                        work.attention(layer, self._rows[layer], stop, first)
                        work.mlp(layer, stop, first)
        finally:
            work.components = saved
            for b, g in zip(self._run.bindings, gathers):
                b.swap_gather(g)

    def _capture(self, n: int) -> None:
        """Batch ``n``'s graphs (step, and with the connector the oracle and the
        two-micro-batch ceiling if asked), between steps."""
        kinds = (tuple(GRAPH_OF[k] for k in self.connector_kinds) if self._run.with_connector
                 else ("step",))
        for b in self._run.bindings:
            b.gather.join()
        for kind in kinds:
            self._forward(n, **FORWARD_OF[kind])  # warm-up: allocates, view inert
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(n, **FORWARD_OF[kind])
            self._graphs[(n, kind)] = graph
            self.graphs_captured += 1
        for key in [key for key in self._graphs if key[0] != n]:  # a finished point's graphs
            del self._graphs[key]

    def _components_alone(self, n: int) -> dict[str, float]:
        """ms of each stand-in alone at batch ``n`` (its own graph, every layer, median of
        5 replays; the rows are the last step's)."""
        if not self._cuda:
            return {}
        out = {}
        for comp in sorted(self.work.components):
            graph = torch.cuda.CUDAGraph()
            self._forward(n, components=frozenset({comp}), convert=False)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, pool=self._pool):
                self._forward(n, components=frozenset({comp}), convert=False)
            times = []
            for _ in range(5):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            out[comp] = statistics.median(times)
            del graph
        return out

    def _counters(self) -> tuple[list[int], list[int]]:
        """([resident, hit, miss, miss rows x the unit's layers] summed over the index
        groups, each group's misses): one copy of every binding's ``HotState.stats``."""
        units = [(b, b.num_layers) for b in self._run.bindings]
        if not units:
            return [0, 0, 0, 0], []
        stats = torch.stack([b.hot_state.stats for b, _ in units]).cpu()
        misses = [int(stats[i, 2]) for i in range(len(units))]
        by_layers = sum(m * k for m, (_, k) in zip(misses, units))
        return [*map(int, stats.sum(0).tolist()), by_layers], misses


def _where(w) -> str:
    """A sync warning as ``file:line: message`` (the Python line that made the call)."""
    return f"{w.filename}:{w.lineno}: {str(w.message)[:100]}"


def disagreeing_steps(steps: list[TimedStep]) -> list[TimedStep]:
    """The timed steps whose index groups counted different misses. The probe gives every
    group the same top-k, batch and tables, so their hot states move in lockstep and their
    counts must be equal; a difference means a group resolved other selections than its
    indexer's (a stream-ordering fault: docs/benchmarks.md, "The stale top-k")."""
    return [s for s in steps if len(set(s.misses_per_unit)) > 1]


def summarize(steps: list[TimedStep], kind: str, batch: int) -> dict:
    """Median, range and tokens/s of one kind's timed steps at one batch size."""
    chosen = [s for s in steps if s.kind == kind and s.batch == batch]
    if not chosen:
        return {}
    ms = [s.ms for s in chosen]
    out = dict(timed_steps=len(chosen), step_ms_median=statistics.median(ms),
               step_ms_min=min(ms), step_ms_max=max(ms),
               host_waited=sum(s.host_waited for s in chosen))
    for name in ("gpu", "host"):  # apart: the real model scales them differently
        times = [getattr(s, f"{name}_ms") for s in chosen]
        out.update({f"{name}_ms_median": statistics.median(times), f"{name}_ms_min": min(times),
                    f"{name}_ms_max": max(times)})
    out["tokens_per_s"] = batch / (out["step_ms_median"] / 1e3)
    out["tokens_per_s_range"] = [batch / (max(ms) / 1e3), batch / (min(ms) / 1e3)]
    # Each timed step in the order it ran, so that a median can be traced to its steps.
    out["gpu_ms_per_step"] = [s.gpu_ms for s in chosen]
    sel = sum(s.selections for s in chosen)
    if sel:
        out["miss_rate"] = sum(s.misses for s in chosen) / sel
        out["miss_bytes_per_step"] = sum(s.miss_bytes for s in chosen) / len(chosen)
        out["misses_per_step"] = [s.misses for s in chosen]
        if any(s.misses_per_unit for s in chosen):  # which index group's misses moved
            out["misses_per_unit_per_step"] = [list(s.misses_per_unit) for s in chosen]
    return out
