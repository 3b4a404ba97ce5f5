"""Decode capacity with a fixed HBM budget for KV: full residency vs hybrid residency (GPU).

For each context length the benchmark sizes two decode batches for the same HBM given to
the sparse-MLA KV:

* **full**: every request keeps its whole KV on the GPU (what vLLM does);
* **hybrid**: a request keeps a hot region of ``--hot-rows`` rows plus its 2-page tail on the
  GPU and its whole KV in the pinned host pool (which then bounds the batch too).

It then times a decode step of each batch on the GPU, layer by layer as a model runs it
(``--rounds`` timed runs of each, interleaved; medians over the rounds). Per
index group (a leader layer that runs the indexer plus the followers that reuse its top-k):
top-k → device rows at the leader (vLLM's block-table arithmetic for full; ``resolve`` +
the group's gathers for hybrid); then per layer a stand-in sparse attention read of K rows
per request (an index_select of the rows, which is what a sparse MLA kernel reads) followed
by a stand-in for the layer's weight pass (``--weights-gib-per-layer`` read from HBM;
DeepSeek-V3.2 on 8 GPUs reads roughly 1.3 GiB of weights per layer per GPU per decode step;
this term hardly grows with the batch, which is why a larger batch pays). ``--weight-pass
sum`` (the default) reads the weights with one HBM-bound reduction; ``gemm`` multiplies every
token of the batch by all of the layer's weights, a compute-heavy bound: a MoE layer's
tokens each meet only a few experts, so its FLOPs per token are far fewer
(docs/benchmarks.md). Selections come from :class:`TopkGenerator` (drifting locality),
precomputed, one generator per request and index group.

Hybrid steps run in each ``--gather-modes`` entry:

* ``single``: one gather launch for every layer of the group, before the leader's attention;
* ``side`` / ``side:C1,C2,...`` / ``side...@N``: the leader's launch before its attention, the
  followers' on a side stream, each follower's attention waiting on its own event
  (``GroupGather``; ``C1,C2,...`` is the launch schedule, see ``hot_state.fit_chunks``, and
  ``N`` the side launches' CTAs per SM, 0 = the kernel's default grid; ``#M`` a cap on a side
  launch's whole grid, in CTAs; ``~P`` the side stream's priority, 0 = the compute stream's;
  ``side`` = the defaults);
* ``noio``: resolve but no copy at all (an oracle, not exact: what the step would cost if
  the PCIe transfers were free).

The first table keeps the figures of the earlier version of this benchmark (KV part timed
alone, the weight pass added afterwards: no overlap possible), for comparison.

    vllm-hisparse bench capacity                # defaults: 8 layers in one index group
    vllm-hisparse bench capacity --index-group-layers 8 4   # and GLM-5.2-like groups of 4
    vllm-hisparse bench capacity --gather-modes single side side:1 side:2,2,4 noio
    vllm-hisparse bench capacity --layout layer      # the layer-major host pool
    vllm-hisparse bench capacity --trace             # + how much gather time ran hidden

``--trace`` profiles one step of every hybrid mode (``torch.profiler``, CUDA) and reports the
gather kernels' time, the part of it that ran while other kernels ran (hidden) and the rest
(exposed): the direct measure of overlap (``timeline.py``).

``--layout`` picks the host pool layout (position-major by default: the rows of all layers of a
position are adjacent, docs/kernels.md); ``--rows-per-warp`` / ``--ctas-per-sm`` set the gather
kernel's tuning (0 = its defaults).
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from vllm_hisparse import ops
from vllm_hisparse.cli.args import (CliParser, nonneg_float, nonneg_int, output_path,
                                    positive_float, positive_int)
from vllm_hisparse.cli.memory import check_fits_in_memory
from vllm_hisparse.cli.output import write_json
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, GIB
from vllm_hisparse.worker.host_pool import HostPool
from vllm_hisparse.worker.hot_state import (DEFAULT_SIDE_CTAS_PER_SM, DEFAULT_SIDE_MAX_CTAS,
                                            DEFAULT_SIDE_PRIORITY, GroupGather, HotState,
                                            fit_chunks)
from vllm_hisparse.worker.synthetic import TopkGenerator

from .timeline import gather_overlap, profile_kernels

# Flags whose default depends on the machine: a GPU run's sizes, or a CPU smoke run small
# enough for a laptop (the GPU sizes would allocate 28 GiB of host memory).
GPU_DEFAULTS = dict(contexts=[4096, 32768, 131072], hbm_gib=4.0, host_gib=24.0, layers=8,
                    topk=2048, hot_rows=4096, block_size=64, weights_gib_per_layer=1.3,
                    steps=20, rounds=3, warmup=5)
CPU_DEFAULTS = dict(contexts=[256, 2048], hbm_gib=0.01, host_gib=0.05, layers=2, topk=64,
                    hot_rows=256, block_size=16, weights_gib_per_layer=0.001, steps=2,
                    rounds=1, warmup=1)
#: Hidden size of the GEMM weight pass (DeepSeek-V3.2's model dimension).
HIDDEN = 7168
WEIGHT_PASSES = ("gemm", "sum")


class WeightPass:
    """Stand-in for each layer's weight pass: ``bytes_per_layer`` of weights read from HBM.

    ``sum``: one reduction over the layer's fp32 weights (HBM-bound, batch-independent: what
    decode's weight reads cost). ``gemm``: ``[batch, HIDDEN] @ [HIDDEN, N]`` in bf16, N chosen
    for the byte count; every token meets every weight, so it is compute-bound at large
    batches, unlike a MoE layer (a sensitivity bound, not the default). Activations and
    outputs are allocated once per batch size."""

    def __init__(self, kind: str, num_layers: int, bytes_per_layer: int, device):
        if kind not in WEIGHT_PASSES:
            raise ValueError(f"weight pass {kind!r}: expected one of {', '.join(WEIGHT_PASSES)}")
        self.kind = kind
        self.device = device
        if kind == "gemm":
            cols = max(1, bytes_per_layer // (2 * HIDDEN))
            self.weights = torch.empty((num_layers, HIDDEN, cols), dtype=torch.bfloat16,
                                       device=device).uniform_(-0.01, 0.01)
        else:
            self.weights = torch.empty((num_layers, max(1, bytes_per_layer // 4)),
                                       dtype=torch.float32, device=device).uniform_()
        self._io: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ms: dict[int, float] = {}

    def __call__(self, layer: int, batch: int) -> None:
        if self.kind == "sum":
            self.weights[layer].sum()
            return
        if batch not in self._io:
            self._io[batch] = (torch.randn((batch, HIDDEN), dtype=torch.bfloat16,
                                           device=self.device),
                               torch.empty((batch, self.weights.shape[2]),
                                           dtype=torch.bfloat16, device=self.device))
        x, y = self._io[batch]
        torch.matmul(x, self.weights[layer], out=y)

    def step_ms(self, batch: int) -> float:
        """Median ms of every layer's pass at ``batch`` (measured once per batch)."""
        if batch not in self._ms:
            layers = range(self.weights.shape[0])
            self._ms[batch] = statistics.median(time_steps(
                lambda i: [self(layer, batch) for layer in layers], 10, 3))
        return self._ms[batch]


def _defaults_text(defaults: dict) -> str:
    return ", ".join(f"--{k.replace('_', '-')} " + (" ".join(map(str, v)) if isinstance(v, list)
                                                     else str(v)) for k, v in defaults.items())


def plan_batches(context: int, a) -> dict:
    bs = a.block_size
    pages = math.ceil(context / bs)
    row_layer_bytes = a.layers * a.row_bytes
    full_request_bytes = pages * bs * row_layer_bytes
    hbm = int(a.hbm_gib * GIB)
    host = int(a.host_gib * GIB)
    full = min(a.max_batch, hbm // full_request_bytes)
    if pages * bs <= a.hot_rows + ACTIVE_TAIL_PAGES * bs:
        hybrid, hybrid_device_rows = full, pages * bs  # short requests stay fully resident
    else:
        hybrid_device_rows = a.hot_rows + ACTIVE_TAIL_PAGES * bs
        hybrid = min(a.max_batch, hbm // (hybrid_device_rows * row_layer_bytes),
                     host // full_request_bytes)
    return dict(context=context, pages=pages, full_batch=int(full), hybrid_batch=int(hybrid),
                hybrid_device_rows=hybrid_device_rows)


def group_spans(num_layers: int, group_layers: int) -> list[tuple[int, int]]:
    """``[(first, end), ...]`` layer ranges of the index groups (``group_layers`` 0 = one
    group of every layer; the last group may be shorter)."""
    size = num_layers if group_layers <= 0 else group_layers
    return [(s, min(s + size, num_layers)) for s in range(0, num_layers, size)]


def parse_mode(text: str) -> tuple[str, tuple[int, ...] | None, int, int, int]:
    """``single`` | ``noio`` | ``side[:C1,C2,...][@N][#M][~P]`` → (kind, chunk spec or None,
    side CTAs per SM N (default ``DEFAULT_SIDE_CTAS_PER_SM``; 0 = the kernel's default grid),
    side stream priority P (default ``DEFAULT_SIDE_PRIORITY``; 0 = the compute stream's),
    cap M on a side launch's whole grid in CTAs (default ``DEFAULT_SIDE_MAX_CTAS``; 0 = none))."""
    if text in ("single", "noio"):
        return text, None, DEFAULT_SIDE_CTAS_PER_SM, DEFAULT_SIDE_PRIORITY, DEFAULT_SIDE_MAX_CTAS
    if text == "side" or text.startswith(("side:", "side@", "side~", "side#")):
        rest, _, prio = text[4:].partition("~")
        rest, _, grid = rest.partition("#")
        body, _, ctas = rest.partition("@")
        try:
            spec = tuple(int(c) for c in body[1:].split(",")) if body else None
            if spec is not None:
                fit_chunks(spec, 1)
            ctas_per_sm = int(ctas) if ctas else DEFAULT_SIDE_CTAS_PER_SM
            priority = int(prio) if prio else DEFAULT_SIDE_PRIORITY
            max_ctas = int(grid) if grid else DEFAULT_SIDE_MAX_CTAS
            if ctas_per_sm < 0 or max_ctas < 0 or (body and not body.startswith(":")):
                raise ValueError
        except ValueError:
            raise ValueError(f"gather mode {text!r}: expected side[:C1,C2,...][@N][#M][~P] "
                             f"with positive ints C, N >= 0, M >= 0 and an int P") from None
        return "side", spec, ctas_per_sm, priority, max_ctas
    raise ValueError(f"gather mode {text!r}: expected single, side[:C1,C2,...][@N][#M][~P] "
                     f"or noio")


def time_steps(fn, steps: int, warmup: int) -> list[float]:
    """Milliseconds of each of ``steps`` calls after ``warmup`` calls (CUDA events on a GPU)."""
    cuda = torch.cuda.is_available()
    for i in range(warmup):
        fn(i)
    if cuda:
        torch.cuda.synchronize()
    times = []
    for i in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(warmup + i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(warmup + i)
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def run_context(plan: dict, device_kv, host_pool: HostPool, weights, group_layers: int,
                a) -> dict:
    bs, k, ctx = a.block_size, a.topk, plan["context"]
    pages = plan["pages"]
    total_steps = a.steps + a.warmup
    # One more step of selections than timed: --trace profiles it, right after the timed ones.
    generated_steps = total_steps + 1
    dev = device_kv[0].device
    groups = group_spans(a.layers, group_layers)
    result = dict(plan, index_group_layers=[e - s for s, e in groups])

    def topk_for(batch: int, group: int) -> torch.Tensor:
        gens = [TopkGenerator(k, seed=r + 7919 * group) for r in range(batch)]
        sel = torch.stack([torch.stack([g.select(ctx) for g in gens])
                           for _ in range(generated_steps)])
        return sel.to(dev)  # [steps, batch, K]

    read_buf = torch.empty((max(plan["full_batch"], plan["hybrid_batch"]) * k, a.row_bytes),
                           dtype=torch.uint8, device=dev)

    def attend(rows: torch.Tensor, layer: int) -> None:
        flat = rows.reshape(-1).clamp_min(0).to(torch.int64)
        torch.index_select(device_kv[layer], 0, flat, out=read_buf[:flat.numel()])

    def weight_pass(layer: int, batch: int) -> None:
        if weights is not None:
            weights(layer, batch)

    # -- full residency: request r owns pages [r * pages, (r + 1) * pages) of the device pool
    full_b = plan["full_batch"]
    time_full = None
    if full_b > 0:
        full_sels = [topk_for(full_b, g) for g in range(len(groups))]
        block_table = torch.arange(full_b * pages, dtype=torch.int64, device=dev).view(full_b,
                                                                                       pages)

        def full_step(i, with_weights=True):
            for g, (first, end) in enumerate(groups):
                s = full_sels[g][i].to(torch.int64)
                rows = torch.where(s >= 0,
                                   block_table.gather(1, (s.clamp_min(0) // bs)) * bs + s % bs,
                                   torch.full_like(s, -1))
                for layer in range(first, end):
                    attend(rows, layer)
                    if with_weights:
                        weight_pass(layer, full_b)

        def time_full() -> float:
            return statistics.median(time_steps(full_step, a.steps, a.warmup))

        result["full_kv_ms"] = statistics.median(
            time_steps(lambda i: full_step(i, False), a.steps, a.warmup))

    # -- hybrid: tail pages resident, the rest host-backed, hot region leased per request
    b = plan["hybrid_batch"]
    if b > 0:
        sels = [topk_for(b, g) for g in range(len(groups))]
        tokens_all_resident = plan["hybrid_device_rows"] >= pages * bs
        hot_rows = a.hot_rows
        hot_blocks_per_req = hot_rows // bs
        next_block = 0
        leases, rows_idx, pages_idx, blocks = [], [], [], []
        for r in range(b):
            if tokens_all_resident:
                resident = range(pages)
            else:
                resident = range(pages - ACTIVE_TAIL_PAGES, pages)
                leases.append((r, list(range(next_block, next_block + hot_blocks_per_req))))
                next_block += hot_blocks_per_req
            for p in resident:
                rows_idx.append(r)
                pages_idx.append(p)
                blocks.append(next_block)
                next_block += 1
        all_rows = [r for r in range(b) for _ in range(pages)]
        all_pages = [p for _ in range(b) for p in range(pages)]
        all_hosts = [r * pages + p for r, p in zip(all_rows, all_pages)]
        token_rows = torch.arange(b, dtype=torch.int32, device=dev)
        host_layers = [l[:b * pages * bs] for l in host_pool.layers]

        # the ops with the gather tuning of --rows-per-warp / --ctas-per-sm
        backend = ops.select(a.ops_backend, copy_rows_per_warp=a.rows_per_warp,
                             copy_ctas_per_sm=a.ctas_per_sm)

        def fresh_states() -> list[HotState]:
            """One state per index group; every group leases the same hot blocks (a device
            block holds every layer's page, each group fills its own layers' rows)."""
            states = []
            for _ in groups:
                state = HotState(b, pages, hot_rows, bs, dev, ops_backend=backend)
                for r, hot in leases:
                    state.lease_hot_region(r, hot)
                state.set_pages(rows_idx, pages_idx, blocks)
                state.set_host_blocks(all_rows, all_pages, all_hosts)
                states.append(state)
            return states

        def timed(step_fn, states) -> tuple[float, float]:
            """Median step ms and miss rate of the timed steps (fresh hot regions, warm-up)."""
            before = {}

            def measured(i):
                if i == a.warmup and not before:
                    before["stats"] = [s.stats.clone() for s in states]
                step_fn(i)

            ms = statistics.median(time_steps(measured, a.steps, a.warmup))
            counts = [sum(int(x) for x in col) for col in zip(*[
                (s.stats - s0).tolist() for s, s0 in zip(states, before["stats"])])]
            resident, hits, misses = counts
            return ms, misses / max(1, resident + hits + misses), hits / max(1, hits + misses)

        def hybrid_step(i, states, gathers, with_weights=True):
            for g, (first, end) in enumerate(groups):
                res = states[g].resolve(sels[g][i], token_rows)
                if gathers is not None:
                    gathers[g].launch(res)
                for j, layer in enumerate(range(first, end)):
                    if gathers is not None:
                        gathers[g].wait(j)
                    attend(res.out_rows, layer)
                    if with_weights:
                        weight_pass(layer, b)

        # Old-style figures: resolve + one gather of every layer alone, and the KV step.
        states = fresh_states()
        rg = lambda i: [states[g].gather(states[g].resolve(sels[g][i], token_rows),
                                         host_layers[s:e], device_kv[s:e])
                        for g, (s, e) in enumerate(groups)]
        result["hybrid_resolve_gather_ms"], result["miss_rate"], result["hot_hit_rate"] = \
            timed(rg, states)
        states = fresh_states()
        gathers = [GroupGather(st, host_layers[s:e], device_kv[s:e], mode="single")
                   for st, (s, e) in zip(states, groups)]
        result["hybrid_kv_ms"], _, _ = timed(
            lambda i: hybrid_step(i, states, gathers, with_weights=False), states)

        def time_mode(text: str, trace: bool) -> dict:
            """One timed run of a gather mode from fresh hot regions (+ a profiled step)."""
            kind, spec, ctas_per_sm, priority, max_ctas = parse_mode(text)
            states = fresh_states()
            gathers = None if kind == "noio" else [
                GroupGather(st, host_layers[s:e], device_kv[s:e], mode=kind, chunks=spec,
                            side_ctas_per_sm=ctas_per_sm, side_priority=priority,
                            side_max_ctas=max_ctas)
                for st, (s, e) in zip(states, groups)]
            ms, miss_rate, _ = timed(lambda i: hybrid_step(i, states, gathers), states)
            out = dict(step_ms=ms, miss_rate=miss_rate,
                       chunks=[list(gg.chunks) for gg in gathers] if gathers else None)
            if trace:
                out["timeline"] = gather_overlap(profile_kernels(
                    lambda: hybrid_step(total_steps, states, gathers)))
            return out

    # -- the step times: full and every hybrid mode in turn, --rounds times (interleaved, so
    # a drift of the machine moves all of them alike), medians over the rounds
    full_rounds: list[float] = []
    mode_rounds: dict[str, list[dict]] = {text: [] for text in a.gather_modes}
    for rnd in range(a.rounds):
        if time_full is not None:
            full_rounds.append(time_full())
        if b > 0:
            for text in a.gather_modes:
                trace = a.trace and dev.type == "cuda" and rnd == a.rounds - 1
                mode_rounds[text].append(time_mode(text, trace))
    if full_rounds:
        result["full_step_ms"] = statistics.median(full_rounds)
        result["full_step_ms_rounds"] = full_rounds
        result["full_tokens_per_s"] = full_b / (result["full_step_ms"] / 1e3)
    if b > 0:
        modes = {}
        for text, runs in mode_rounds.items():
            ms = statistics.median(r["step_ms"] for r in runs)
            modes[text] = dict(runs[-1], step_ms=ms, step_ms_rounds=[r["step_ms"] for r in runs],
                               tokens_per_s=b / (ms / 1e3))
            if result.get("full_tokens_per_s"):
                modes[text]["tokens_per_s_ratio"] = (modes[text]["tokens_per_s"]
                                                     / result["full_tokens_per_s"])
                # each round's hybrid step against the full step timed just before it
                modes[text]["tokens_per_s_ratio_rounds"] = [
                    (b / r["step_ms"]) / (full_b / f) for r, f in zip(runs, full_rounds)]
        result["modes"] = modes
    if result.get("full_kv_ms") and result.get("hybrid_kv_ms"):
        result["tokens_per_s_ratio_kv_only"] = ((plan["hybrid_batch"] / result["hybrid_kv_ms"])
                                                / (plan["full_batch"] / result["full_kv_ms"]))
    return result


def main(argv=None) -> int:
    p = CliParser(prog="vllm-hisparse bench capacity", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=positive_int, nargs="+")
    p.add_argument("--hbm-gib", type=positive_float, help="HBM given to the MLA KV")
    p.add_argument("--host-gib", type=positive_float, help="pinned host pool")
    p.add_argument("--layers", type=positive_int)
    p.add_argument("--index-group-layers", type=nonneg_int, nargs="+", default=[0],
                   help="layers per index group (leader + followers), one run each; 0 = one "
                        "group of every layer (the default, IndexShare over 8 layers); 4 = "
                        "GLM-5.2-like (21 leaders for 78 layers, ~3.7 layers per group)")
    p.add_argument("--gather-modes", nargs="+", default=["single", "side", "noio"],
                   help="hybrid gather modes: single, side, side:C1,C2,... (launch schedule), "
                        "side...@N (side launches' CTAs per SM), side...~P (side stream "
                        "priority, 0 = the compute stream's), noio (no copies: an oracle)")
    p.add_argument("--row-bytes", type=positive_int, default=656)
    p.add_argument("--topk", type=positive_int)
    p.add_argument("--hot-rows", type=positive_int)
    p.add_argument("--block-size", type=positive_int)
    p.add_argument("--max-batch", type=positive_int, default=256)
    p.add_argument("--weights-gib-per-layer", type=nonneg_float,
                   help="HBM read per layer standing in for the weight pass (0 = none)")
    p.add_argument("--weight-pass", choices=WEIGHT_PASSES, default="sum",
                   help="weight pass stand-in: sum (an HBM-bound read of the weights, default) "
                        "or gemm (every token times every weight: a compute-heavy bound)")
    p.add_argument("--trace", action="store_true",
                   help="profile one step of every hybrid mode and report how much of the "
                        "gather time ran hidden under other kernels (GPU only)")
    p.add_argument("--steps", type=positive_int)
    p.add_argument("--rounds", type=positive_int,
                   help="timed runs of the full step and of every gather mode, interleaved; "
                        "the tables show the median over the rounds")
    p.add_argument("--warmup", type=nonneg_int)
    p.add_argument("--ops-backend", default="auto")
    p.add_argument("--layout", choices=["position", "layer"], default=None,
                   help="host pool layout (default: HostPool's default, position-major)")
    p.add_argument("--rows-per-warp", type=nonneg_int, default=0,
                   help="gather tuning (0 = default)")
    p.add_argument("--ctas-per-sm", type=nonneg_int, default=0,
                   help="gather tuning (0 = default)")
    p.add_argument("--json", metavar="PATH", type=output_path)
    p.epilog = ("Defaults: on a GPU " + _defaults_text(GPU_DEFAULTS) + "; without one (a CPU "
                "smoke run) " + _defaults_text(CPU_DEFAULTS) + ".")
    a = p.parse_args(argv)
    for text in a.gather_modes:
        try:
            parse_mode(text)
        except ValueError as e:
            p.error(str(e))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    defaults = GPU_DEFAULTS if device == "cuda" else CPU_DEFAULTS
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    try:  # on the CPU the "HBM" is host memory too
        check_fits_in_memory("--host-gib", a.host_gib, total_gib=a.host_gib + (
            a.hbm_gib if device == "cpu" else 0), what="the host pool" + (
            " with --hbm-gib (host memory on the CPU)" if device == "cpu" else ""))
    except ValueError as e:
        p.error(str(e))
    if device == "cpu":
        print("vllm-hisparse bench capacity: no CUDA device: a CPU smoke run with the reference "
              "ops and CPU-sized defaults (the figures mean nothing)", file=sys.stderr)

    rows_per_layer = int(a.hbm_gib * GIB) // (a.layers * a.row_bytes)
    rows_per_layer -= rows_per_layer % a.block_size
    device_kv = [torch.randint(0, 256, (rows_per_layer, a.row_bytes), dtype=torch.uint8,
                               device=device) for _ in range(a.layers)]
    host_blocks = int(a.host_gib * GIB) // (a.layers * a.block_size * a.row_bytes)
    t0 = time.perf_counter()
    pool_kwargs = {} if a.layout is None else dict(layout=a.layout)
    host_pool = HostPool(a.layers, host_blocks, a.block_size, a.row_bytes, **pool_kwargs)
    flat = host_pool.buffer  # never time on zeros: fill in large contiguous copies
    chunk = device_kv[0].view(-1)
    for start in range(0, flat.numel(), chunk.numel()):
        n = min(chunk.numel(), flat.numel() - start)
        flat[start:start + n].copy_(chunk[:n], non_blocking=True)
    if device == "cuda":
        torch.cuda.synchronize()
    print(f"host pool {host_pool.logical_gib:.1f} GiB ({host_pool.page_mode}, "
          f"{host_pool.layout}-major) ready in {time.perf_counter() - t0:.1f} s", flush=True)

    per_layer_bytes = int(a.weights_gib_per_layer * GIB)
    weights = WeightPass(a.weight_pass, a.layers, per_layer_bytes, device) \
        if per_layer_bytes else None
    weight_ms = weights.step_ms(1) if weights is not None else 0.0

    results = []
    for group_layers in a.index_group_layers:
        for context in a.contexts:
            plan = plan_batches(context, a)
            groups = group_spans(a.layers, group_layers)
            print(f"context {context}, {len(groups)} index group(s): full batch "
                  f"{plan['full_batch']}, hybrid batch {plan['hybrid_batch']} ...", flush=True)
            r = run_context(plan, device_kv, host_pool, weights, group_layers, a)
            r["weight_pass_ms"] = {b: weights.step_ms(b) if weights is not None else 0.0
                                   for b in (r["full_batch"], r["hybrid_batch"]) if b > 0}
            if r.get("full_kv_ms") and r.get("hybrid_kv_ms"):
                full = r["full_batch"] / (r["full_kv_ms"] + r["weight_pass_ms"][r["full_batch"]])
                hybrid = r["hybrid_batch"] / (r["hybrid_kv_ms"]
                                              + r["weight_pass_ms"][r["hybrid_batch"]])
                r["tokens_per_s_ratio_weight_added"] = hybrid / full
            results.append(r)
    host_layout = host_pool.layout
    host_pool.close()

    print()
    print(f"{a.layers} layers x {a.row_bytes} B rows, K = {a.topk}, hot rows {a.hot_rows}, "
          f"HBM for KV {a.hbm_gib} GiB, host pool {a.host_gib} GiB ({host_layout}-major), "
          f"gather tuning {a.rows_per_warp or 'default'} rows/warp, "
          f"{a.ctas_per_sm or 'default'} CTAs/SM, weight pass {a.weight_pass} "
          f"{weight_ms:.2f} ms at batch 1 ({a.weights_gib_per_layer} GiB/layer), "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}")
    nan = float("nan")
    print("\nKV part timed alone, single launch (the earlier method; weight pass added after):")
    print("| context | index groups | full batch | hybrid batch | full KV ms | hybrid KV ms | "
          "of which resolve+gather ms | miss rate | tok/s ratio, KV only | "
          "tok/s ratio, weight pass added |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['context']} | {'+'.join(map(str, r['index_group_layers']))} "
              f"| {r['full_batch']} | {r['hybrid_batch']} "
              f"| {r.get('full_kv_ms', nan):.3f} | {r.get('hybrid_kv_ms', nan):.3f} "
              f"| {r.get('hybrid_resolve_gather_ms', nan):.3f} "
              f"| {100 * r.get('miss_rate', 0):.1f} % "
              f"| {r.get('tokens_per_s_ratio_kv_only', nan):.2f} "
              f"| {r.get('tokens_per_s_ratio_weight_added', nan):.2f} |")
    print(f"\nLayered decode step (per layer: [wait] + attention read + weight pass; medians "
          f"of {a.rounds} interleaved rounds, the ratio's range over the rounds in brackets):")
    print("| context | index groups | full step ms | gather mode | launches per group "
          "| hybrid step ms | exposed IO ms (vs noio) | tok/s hybrid / full |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        modes = r.get("modes", {})
        noio = modes.get("noio", {}).get("step_ms")
        for text, m in modes.items():
            chunks = m["chunks"][0] if m["chunks"] else []
            exposed = (m["step_ms"] - noio) if noio is not None else nan
            per_round = m.get("tokens_per_s_ratio_rounds") or []
            spread = (f" [{min(per_round):.2f}-{max(per_round):.2f}]"
                      if len(per_round) > 1 else "")
            print(f"| {r['context']} | {'+'.join(map(str, r['index_group_layers']))} "
                  f"| {r.get('full_step_ms', nan):.3f} | {text} "
                  f"| {','.join(map(str, chunks)) or '-'} | {m['step_ms']:.3f} "
                  f"| {exposed:.3f} | {m.get('tokens_per_s_ratio', nan):.2f}{spread} |")
    traced = [(r, text, m["timeline"]) for r in results
              for text, m in r.get("modes", {}).items() if "timeline" in m]
    if traced:
        print("\nOne profiled step per mode (--trace; kernel times from torch.profiler, ms):")
        print("| context | index groups | gather mode | step span | gather kernels "
              "| of which hidden under other kernels | exposed | no kernel running |")
        print("|---|---|---|---|---|---|---|---|")
        for r, text, t in traced:
            print(f"| {r['context']} | {'+'.join(map(str, r['index_group_layers']))} | {text} "
                  f"| {t['span_us'] / 1e3:.3f} | {t['gather_us'] / 1e3:.3f} "
                  f"| {t['gather_hidden_us'] / 1e3:.3f} | {t['gather_exposed_us'] / 1e3:.3f} "
                  f"| {t['idle_us'] / 1e3:.3f} |")
    if a.json and not write_json("--json", a.json, dict(
            args=vars(a), device=device, host_layout=host_layout,
            weight_pass_batch1_ms=weight_ms, results=results), command="bench capacity"):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
