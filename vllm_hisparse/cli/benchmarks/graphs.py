"""Decode steps through the attention hook, eager vs one replayed CUDA graph (GPU; the step
harness also runs on CPU, where tests use it).

    vllm-hisparse bench graphs                      # batch 64 (60 real), K 2048, 8 layers
    vllm-hisparse bench graphs --index-group-layers 1 --json g.json

A decode step as vLLM's FULL-graph path runs it (``cudagraph_mode`` ``FULL_AND_PIECEWISE``,
vLLM's default): a batch padded to the graph's size (padding tokens map to batch row 0, as
vLLM maps them), and per layer the index group's top-k conversion through the residency hook
(``read_path.hooked_conversion``, on a stand-in index group whose own conversion is the
pure-torch twin of vLLM's; on CUDA each leader converts on the group's own side stream from
an event recorded where its indexer would end, unless ``--inline-conversion``), compaction
included, then a stand-in sparse attention read of the
K rows of every token. Every input lives in a fixed buffer; each step writes its values there
and opens the worker's :class:`StepView` (``begin``), as ``start_load_kv`` does. Requests keep
an eighth of their pages resident (plus the tail); every ``--full-every``-th request is FULL
(all pages resident, vLLM's rows), the others are host-backed with a hot region.

The same steps run eagerly (every op launched from Python) and as one graph captured outside
any step (where the view is inert) and replayed, from the same start state; the rows each step
resolves must be identical. Printed: ms per step of both, for steps with host-backed requests
and for all-FULL steps (eager takes vLLM's conversion alone there; the graph replays the
residency path, which resolves nothing), and for the latter the same graph captured without
the connector (what the inert path costs a replay).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from vllm_hisparse.cli.args import CliParser, nonneg_int, output_path, positive_int
from vllm_hisparse.cli.output import write_json
from vllm_hisparse.vllm.worker_side.conversion_stream import ConversionStream
from vllm_hisparse.vllm.worker_side.read_path import (BINDING_ATTR, IndexGroupResidency,
                                                      compact_valid_to_front, hooked_conversion,
                                                      vllm_reference_conversion)
from vllm_hisparse.vllm.worker_side.score_tap import ScoreTap
from vllm_hisparse.vllm.worker_side.step_view import StepView
from vllm_hisparse.worker.device_rows import DeviceRowLayout
from vllm_hisparse.worker.host_pool import HostPool
from vllm_hisparse.worker.hot_state import HotState
from vllm_hisparse.worker.page_tables import PageTables
from vllm_hisparse.worker.synthetic import TopkGenerator, describe_row, kv_rows

#: A selection no request has: a padding token that reached the resolver would fail it.
PADDING_POSITION = 1 << 30


@dataclasses.dataclass(frozen=True)
class GraphStepSpec:
    """Sizes of a :class:`HookedDecodeStep` (GPU benchmark defaults)."""

    batch: int = 64  # tokens (one per request) the graph is captured for
    requests: int = 60  # requests (state rows); a step schedules up to this many
    topk: int = 2048
    hot_rows: int = 4096
    block_size: int = 64
    context: int = 8192  # tokens of every request
    layers: int = 8
    index_group_layers: int = 4  # leader + followers
    row_bytes: int = 656
    resident_every: int = 8  # every n-th page resident (the two tail pages always)
    full_every: int = 4  # every n-th request FULL (0: none)
    steps: int = 12
    seed: int = 0
    score_eviction: bool = False  # indexer logits per step, slot classes (hot_region_eviction)
    # leaders convert on the compute stream (default on CUDA: each group's own side stream,
    # from an event recorded where the indexer ends, as with vLLM's index groups)
    inline_conversion: bool = False


@dataclasses.dataclass
class StepInputs:
    """One step of the plan: its requests in batch order and the buffers' contents."""

    order: list[int]  # request (state row) of each batch row
    topk: torch.Tensor  # int32 [batch, K]; padding tokens select PADDING_POSITION
    req_id: torch.Tensor  # int32 [batch]: batch row of each token; padding tokens -> 0
    blocks: torch.Tensor  # int32 [len(order), P]: vLLM's block table rows
    state_rows: list[int]  # state row of each batch row whose request is tracked, else -1
    logits: torch.Tensor | None = None  # float32 [batch, context] with score_eviction


class HookedDecodeStep:
    """Fixed buffers, hot states, bindings and the per-step plan of the harness (module doc).

    ``plan[s]``: the inputs of step ``s`` (:class:`StepInputs`; a random subset of the
    requests in random order when ``vary_batch``). :meth:`run` replays the plan eagerly or
    through a graph and returns every step's resolved rows.
    """

    def __init__(self, spec: GraphStepSpec, device: str | torch.device, *,
                 vary_batch: bool = True, all_full: bool = False):
        s = self.spec = spec
        self.device = dev = torch.device(device)
        if spec.requests > spec.batch or spec.layers % spec.index_group_layers:
            raise ValueError("graph step: requests <= batch and whole index groups needed")
        bs, K, D, R = spec.block_size, spec.topk, spec.hot_rows, spec.requests
        self.pages = P = spec.context // bs
        self.full = [all_full or bool(spec.full_every and (r + 1) % spec.full_every == 0)
                     for r in range(R)]
        # Device rows: block r * P + p holds page p of request r (resident or not), then
        # the hot regions.
        hot_base = R * P
        rows = (hot_base + R * (D // bs)) * bs
        self.kv = [torch.zeros((rows, spec.row_bytes), dtype=torch.uint8, device=dev)
                   for _ in range(spec.layers)]
        self.host = HostPool(spec.layers, R * P, bs, spec.row_bytes, huge_pages="auto",
                             pin=dev.type == "cuda")
        positions = torch.arange(spec.context, device=dev)
        for r in range(R):
            for l in range(spec.layers):
                truth = kv_rows(r + 1, positions, l, spec.row_bytes)
                self.host.layers[l][r * P * bs:(r + 1) * P * bs] = truth.cpu()
                self.kv[l][r * P * bs:(r + 1) * P * bs] = truth
        self.step_view = StepView(spec.batch, dev, max_num_tokens=spec.batch)
        # score eviction: each leader's "indexer" records this step's logits (the plan's
        # selections are their top-k) in the tap its conversion reads
        self.tap = ScoreTap() if spec.score_eviction else None
        if self.tap is not None:
            self.tap.enable()
        self.logits = torch.zeros((spec.batch, spec.context), device=dev) \
            if spec.score_eviction else None
        group_sizes = [spec.index_group_layers] * (spec.layers // spec.index_group_layers)
        self.states, self.bindings, self.groups, first = [], [], [], 0
        tables = PageTables(R, P, dev)  # one page table per lane, as the worker role
        for size in group_sizes:
            state = HotState(R, P, D, bs, dev, page_tables=tables)
            layers = list(range(first, first + size))
            binding = IndexGroupResidency(state, [self.host.layers[l] for l in layers],
                                          [self.kv[l] for l in layers],
                                          DeviceRowLayout(bs, bs), self.step_view,
                                          scores=self.tap)
            group = SimpleNamespace()
            binding.attach(group, None if spec.inline_conversion or dev.type != "cuda" else
                           ConversionStream(torch.cuda.Stream(dev), lambda: self.topk_ready,
                                            dev))
            self.states.append(state)
            self.bindings.append(binding)
            self.groups.append((group, layers))
            first += size
        table = self.states[0]
        for r in range(R):
            pages = list(range(P))
            resident = [r * P + p if self.full[r] or p >= P - 2 or p % spec.resident_every == 0
                        else -1 for p in pages]
            table.set_pages([r] * P, pages, resident)
            table.set_host_blocks([r] * P, pages, [r * P + p for p in pages])
        self._hot = [[hot_base + r * (D // bs) + i for i in range(D // bs)] for r in range(R)]
        self.reset_hot_state()
        # vLLM's batch block table: batch row -> its request's blocks (right for FULL ones).
        i32 = dict(dtype=torch.int32, device=dev)
        self.block_table = torch.zeros((spec.batch, P), **i32)
        self.topk = torch.full((spec.batch, K), PADDING_POSITION, **i32)
        self.req_id = torch.zeros(spec.batch, **i32)
        self.metadata = SimpleNamespace(req_id_per_token=self.req_id,
                                        block_table=self.block_table, block_size=bs,
                                        num_actual_tokens=spec.batch)
        self.reads = [torch.empty((spec.batch * K, spec.row_bytes), dtype=torch.uint8,
                                  device=dev) for _ in range(spec.layers)]
        self.converted: list[torch.Tensor | None] = [None] * spec.layers
        #: Recorded where each group's indexer would end; its leader's conversion starts there.
        self.topk_ready = torch.Event(device=dev) if dev.type == "cuda" else None
        self.plan = self._make_plan(vary_batch)

    def _make_plan(self, vary_batch: bool) -> list[StepInputs]:
        spec, P = self.spec, self.pages
        gens = [TopkGenerator(spec.topk, seed=spec.seed * 1000 + r, recent=64,
                              drift_tokens=16.0) for r in range(spec.requests)]
        rng = torch.Generator().manual_seed(spec.seed)
        pin = self.device.type == "cuda"
        plan = []
        for _ in range(spec.steps):
            order = list(range(spec.requests))
            if vary_batch:
                order = torch.randperm(spec.requests, generator=rng).tolist()
                order = order[:int(torch.randint(spec.requests // 2, spec.requests + 1, (1,),
                                                 generator=rng))]
            n = len(order)
            topk = torch.full((spec.batch, spec.topk), PADDING_POSITION, dtype=torch.int32)
            topk[:n] = torch.stack([gens[r].select(spec.context) for r in order])
            req_id = torch.zeros(spec.batch, dtype=torch.int32)  # padding: batch row 0
            req_id[:n] = torch.arange(n, dtype=torch.int32)
            blocks = (torch.tensor(order, dtype=torch.int32)[:, None] * P
                      + torch.arange(P, dtype=torch.int32))
            logits = None
            if spec.score_eviction:  # the selected positions score above every other
                logits = torch.randn((spec.batch, spec.context), generator=rng)
                logits[:n].scatter_add_(1, topk[:n].long(), torch.full((n, spec.topk), 8.0))
            plan.append(StepInputs(order, *(t.pin_memory() if pin else t
                                            for t in (topk, req_id, blocks)),
                                   [-1 if self.full[r] else r for r in order],
                                   logits.pin_memory() if pin and logits is not None else logits))
        return plan

    def reset_hot_state(self) -> None:
        """Empty hot regions, LRU in slot order, zero counters (the state before step 0)."""
        for state in self.states:
            state.fence_side_work()
            for r in range(self.spec.requests):
                if self.full[r]:
                    state.release_hot_region(r)
                else:
                    state.lease_hot_region(r, self._hot[r])
            state.stats.zero_()

    def load(self, step: int) -> None:
        """Write step ``step``'s inputs into the fixed buffers and open the step view (what
        vLLM's input preparation and ``start_load_kv`` do before a replay)."""
        inputs = self.plan[step]
        n = len(inputs.order)
        self.topk.copy_(inputs.topk, non_blocking=True)
        self.req_id.copy_(inputs.req_id, non_blocking=True)
        self.block_table[:n].copy_(inputs.blocks, non_blocking=True)
        if inputs.logits is not None:
            self.logits.copy_(inputs.logits, non_blocking=True)
        tracked = inputs.state_rows
        self.step_view.begin(step, None if all(r < 0 for r in tracked) else tracked, n)

    def forward(self) -> None:
        """Every layer's conversion through the hook and its stand-in attention read."""
        bs = self.spec.block_size

        def original(layer_index, logical_topk, md, *, block_stride_rows, return_valid_counts):
            rows = vllm_reference_conversion(md.req_id_per_token, md.block_table, logical_topk,
                                             bs, block_stride_rows)
            return compact_valid_to_front(rows) if return_valid_counts else rows

        for group, layers in self.groups:
            if self.tap is not None:
                self.tap.record_decode_topk(lambda *args: None, self.logits, None, 1, self.topk,
                                            self.spec.topk, self.spec.context)
            if self.topk_ready is not None:
                self.topk_ready.record(torch.cuda.current_stream(self.device))
            for index, layer in enumerate(layers):
                rows, _ = hooked_conversion(group, original, index, self.topk, self.metadata,
                                            block_stride_rows=bs, return_valid_counts=True)
                # In a capture these are the graph's output tensors: replays rewrite them.
                self.converted[layer] = rows
                flat = rows.reshape(-1).clamp_min(0).to(torch.int64)
                torch.index_select(self.kv[layer], 0, flat, out=self.reads[layer])

    def step_rows(self) -> list[torch.Tensor]:
        """The rows the step's leader layers converted to (int32 [batch, K], compacted;
        copies), one tensor per index group."""
        return [self.converted[layers[0]].clone() for _, layers in self.groups]

    def check_reads(self, step: int) -> int:
        """Every row the step's real tokens read equals its ground truth (compared on the
        device); returns how many rows were checked."""
        inputs = self.plan[step]
        K, checked = self.spec.topk, 0
        topk = inputs.topk.to(self.device)
        for layer, reads in enumerate(self.reads):
            got = reads.reshape(self.spec.batch, K, -1)
            for t, r in enumerate(inputs.order):
                pos = topk[t][topk[t] >= 0]
                want = kv_rows(r + 1, pos, layer, self.spec.row_bytes)
                bad = (got[t, :pos.numel()] != want).any(dim=1).nonzero().flatten()
                if bad.numel():
                    raise AssertionError(
                        f"step {step} layer {layer} token {t}: position {int(pos[bad[0]])} read "
                        f"{describe_row(got[t, int(bad[0])].cpu())}")
                checked += pos.numel()
        return checked

    def run(self, mode: str, *, check: bool = False, timed: bool = False, stock: bool = False):
        """Every step of the plan, ``mode`` ``"eager"`` or ``"graph"`` (captured outside a
        step, after one eager warm-up forward there, then replayed); returns (resolved rows
        of every step, ms per step when ``timed``). ``stock``: the index groups unbound
        (vLLM without the connector; right only when every request is FULL)."""
        self.reset_hot_state()
        for (group, _), binding in zip(self.groups, self.bindings):
            setattr(group, BINDING_ATTR, None if stock else binding)
        graph = None
        if mode == "graph":
            self.forward()  # the warm-up vLLM runs before a capture: inert, allocates
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.forward()
        elif mode != "eager":
            raise ValueError(f"graph step: mode must be eager or graph, got {mode!r}")
        rows, times = [], []
        for step in range(len(self.plan)):
            if timed:
                torch.cuda.synchronize(self.device)
                start = time.perf_counter()
            self.load(step)
            graph.replay() if graph is not None else self.forward()
            self.step_view.end()
            if timed:
                torch.cuda.synchronize(self.device)
                times.append((time.perf_counter() - start) * 1e3)
            rows.append(self.step_rows())
            if check:
                self.check_reads(step)
        return rows, (statistics.median(times[1:] or times) if timed else None)

    def close(self) -> None:
        for state in self.states:
            state.fence_side_work()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.host.close()


def compare(spec: GraphStepSpec, *, all_full: bool) -> dict:
    """Eager vs graph on one plan: identical rows, and each mode's ms per step."""
    rig = HookedDecodeStep(spec, "cuda", vary_batch=False, all_full=all_full)
    try:
        rig.run("eager", check=True)  # warm-up of every shape, and the exactness check
        eager_rows, eager_ms = rig.run("eager", timed=True)
        eager_stats = [s.stats.tolist() for s in rig.states]
        graph_rows, graph_ms = rig.run("graph", timed=True)
        graph_stats = [s.stats.tolist() for s in rig.states]
        same = all(torch.equal(a, b) for ea, ga in zip(eager_rows, graph_rows)
                   for a, b in zip(ea, ga)) and eager_stats == graph_stats
        result = dict(all_full=all_full, eager_ms=eager_ms, graph_ms=graph_ms,
                      speedup=eager_ms / graph_ms, identical=same, stats=graph_stats)
        if all_full:  # the same graph without the connector: what the inert path costs
            stock_rows, result["stock_graph_ms"] = rig.run("graph", timed=True, stock=True)
            result["identical"] = same and all(torch.equal(a, b) for sa, ga in
                                               zip(stock_rows, graph_rows)
                                               for a, b in zip(sa, ga))
        return result
    finally:
        rig.close()


def main(argv=None) -> int:
    p = CliParser(prog="vllm-hisparse bench graphs", description=__doc__.splitlines()[0])
    defaults = GraphStepSpec()
    for field in dataclasses.fields(GraphStepSpec):
        flag, default = "--" + field.name.replace("_", "-"), getattr(defaults, field.name)
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", default=default)
        else:
            p.add_argument(flag, default=default, type=nonneg_int
                           if field.name in ("full_every", "seed") else positive_int)
    p.add_argument("--json", type=output_path)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("vllm-hisparse bench graphs: needs a CUDA device", file=sys.stderr)
        return 2
    spec = GraphStepSpec(**{f.name: getattr(a, f.name) for f in dataclasses.fields(GraphStepSpec)})
    print(f"decode step through the attention hook: batch {spec.batch} ({spec.requests} real), "
          f"K {spec.topk}, D {spec.hot_rows}, {spec.layers} layers in index groups of "
          f"{spec.index_group_layers}, context {spec.context}"
          f"{', score-aware eviction' if spec.score_eviction else ''}; ms per step, median of "
          f"{spec.steps - 1}", flush=True)
    results = []
    for all_full in (False, True):
        r = compare(spec, all_full=all_full)
        results.append(r)
        what = "all FULL" if all_full else "host-backed requests"
        stock = (f"  (graph without the connector {r['stock_graph_ms']:.3f})"
                 if "stock_graph_ms" in r else "")
        print(f"{what:22s} eager {r['eager_ms']:7.3f}  graph {r['graph_ms']:7.3f}  "
              f"x{r['speedup']:.2f}  rows identical: {r['identical']}{stock}", flush=True)
    if a.json and not write_json("--json", a.json, dict(spec=dataclasses.asdict(spec),
                                                         results=results),
                                 command="bench graphs"):
        return 2
    return 0 if all(r["identical"] for r in results) else 1
