"""``vllm-hisparse simulate``: the whole system end to end on a synthetic DSA model.

vLLM's real ``Scheduler`` and ``HiSparseResidencyConnector`` (scheduler role inside the
scheduler, worker role bound to the KV tensors vLLM allocates for the plan) drive a synthetic
DSA model: deterministic KV bytes per (request, position, layer) written into the slots vLLM
assigns, drifting top-k selections converted through every sparse layer's index group. Every
row attention would read is checked against the ground truth at every step. The same workload
runs with and without the connector on the same device pool, and a table compares them.

Exit status: 0 when both runs finish and every row matched; 1 on a mismatch (the message
names the request, step and layer) or any other failure of the system; 2 on bad arguments.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from vllm_hisparse.cli.args import EXIT_INTERRUPTED, output_path
from vllm_hisparse.cli.memory import check_fits_in_memory
from vllm_hisparse.cli.output import write_file, write_json

RUNS = ("both", "with", "without")

# Defaults: a 4-layer IndexShare model (2 index units of 2 layers), block 64, top-k 128 (hot
# region 256 rows = 4 blocks per request), 400 device blocks (5 KV cache groups, so about 80
# pages of tokens), 32 requests of ~1024 + ~256 tokens arriving at once. Without the connector
# about 7 requests fit; with it about twice as many (README, "Use", says how long it runs).
DEFAULTS = dict(requests=32, prompt_len=1024, output_len=256, length_jitter=0.0,
                device_blocks=400, layers=4, layers_per_indexer=2, block_size=64, top_k=128,
                prefill_top_k=16, max_num_seqs=32, max_num_batched_tokens=1024)


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="run vLLM's scheduler + this connector on a synthetic "
                       "DSA model; check every row read; compare with/without the connector",
                       description=__doc__)
    w = p.add_argument_group("workload")
    w.add_argument("--requests", type=int, default=DEFAULTS["requests"], metavar="N",
                   help="number of requests (default: %(default)s)")
    w.add_argument("--prompt-len", type=int, default=DEFAULTS["prompt_len"], metavar="TOKENS",
                   help="prompt tokens per request (default: %(default)s)")
    w.add_argument("--output-len", type=int, default=DEFAULTS["output_len"], metavar="TOKENS",
                   help="generated tokens per request (default: %(default)s)")
    w.add_argument("--length-jitter", type=float, default=DEFAULTS["length_jitter"],
                   metavar="F", help="draw each length uniformly within +-F of it "
                   "(default: %(default)s)")
    w.add_argument("--shared-prefix-len", type=int, default=0, metavar="TOKENS",
                   help="leading prompt tokens every request shares (prefix-cache hits, on "
                   "the device or from the host tier; default: %(default)s)")
    w.add_argument("--arrival", choices=("burst", "poisson"), default="burst",
                   help="burst: every request at step 0; poisson: exponential gaps of mean "
                   "1/--arrival-rate steps (default: %(default)s)")
    w.add_argument("--arrival-rate", type=float, default=0.5, metavar="R",
                   help="poisson: requests per step (default: %(default)s)")
    w.add_argument("--topk-drift", choices=("uniform", "mixed", "scored"), default="uniform",
                   help="decode selections: uniform, every request drifts alike; mixed, "
                   "requests from stable to wandering (TOPK_DRIFTS in simulation/spec.py); "
                   "scored, vLLM's SparseIndexerTopk over synthetic indexer scores with the "
                   "replay trace's drift (simulation/scored_indexer.py) (default: %(default)s)")
    w.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model and engine")
    m.add_argument("--device-blocks", type=int, default=DEFAULTS["device_blocks"], metavar="N",
                   help="vLLM's KV pool in blocks, all KV cache groups together "
                   "(default: %(default)s)")
    m.add_argument("--host-pool-gib", type=float, default=None, metavar="GIB",
                   help="host pool (default: enough for every request at once)")
    m.add_argument("--layers", type=int, default=DEFAULTS["layers"],
                   help="sparse-MLA layers (default: %(default)s)")
    m.add_argument("--layers-per-indexer", type=int, default=DEFAULTS["layers_per_indexer"],
                   metavar="N", help="IndexShare: layers sharing one indexer's top-k "
                   "(default: %(default)s; 1 = DeepSeek-V3.2 style)")
    m.add_argument("--block-size", type=int, default=DEFAULTS["block_size"],
                   help="tokens per block (default: %(default)s)")
    m.add_argument("--top-k", type=int, default=DEFAULTS["top_k"],
                   help="selections per decode token, the model's index_topk "
                   "(default: %(default)s)")
    m.add_argument("--prefill-top-k", type=int, default=DEFAULTS["prefill_top_k"], metavar="K",
                   help="selections per prefill token (default: %(default)s)")
    m.add_argument("--device-buffer-size", type=int, default=None, metavar="ROWS",
                   help="hot rows per request (default: the connector's, 2 * top-k)")
    m.add_argument("--max-num-seqs", type=int, default=DEFAULTS["max_num_seqs"], metavar="N",
                   help="vLLM max_num_seqs (default: %(default)s)")
    m.add_argument("--max-num-batched-tokens", type=int,
                   default=DEFAULTS["max_num_batched_tokens"], metavar="N",
                   help="vLLM max_num_batched_tokens (default: %(default)s)")
    m.add_argument("--attention", choices=("direct", "group"), default="direct",
                   help="which sparse-MLA backend the layers imitate: 'direct' converts "
                   "batches with prefill tokens on the batch block table and decode-only "
                   "batches through the index group (FlashAttention sparse, FlashMLA sparse's "
                   "mixed batches); 'group' converts every batch through the index group "
                   "(FlashInfer sparse) (default: %(default)s)")
    m.add_argument("--device", default="cpu",
                   help="where KV and the ops live: cpu (reference ops) or cuda[:N] (CUDA "
                   "kernels) (default: %(default)s)")
    m.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks: one worker role (and model runner) per rank, "
                   "rank r on cuda:r (--device cuda) or all on cpu, each in its own thread, "
                   "mapping one shared host pool that rank 0 writes; the scheduler votes "
                   "every rank's acks and every rank's rows are checked (default: "
                   "%(default)s)")
    m.add_argument("--ops-backend", choices=("auto", "cuda", "reference"), default="auto",
                   help="the connector's ops_backend (default: %(default)s)")
    m.add_argument("--connector-config", metavar="PATH", default=None,
                   help="a --kv-transfer-config JSON file (alone or MultiConnector, as in "
                   "examples/): the connector runs with its extra-config keys; host_pool_gib "
                   "and ops_backend stay the simulator's (--host-pool-gib, --ops-backend; the "
                   "output says when the file's value was replaced) and the other connectors "
                   "of a composition are not simulated")
    m.add_argument("--adaptive-hot-region", action="store_true",
                   help="the connector's adaptive_hot_region: each host-backed request's hot "
                   "region sized from its miss rate (default: fixed regions)")
    m.add_argument("--hot-region-target-miss-rate", type=float, default=None, metavar="F",
                   help="the connector's hot_region_target_miss_rate (with "
                   "--adaptive-hot-region; default: the connector's)")
    m.add_argument("--hot-region-eviction", choices=("lru", "score"), default=None,
                   help="the connector's hot_region_eviction: which hot slot a miss takes, "
                   "the least recently used or the one the indexer scored lowest (score "
                   "needs indexer scores: refused without --topk-drift scored) (default: "
                   "--connector-config's, else lru)")
    m.add_argument("--host-layout", choices=("auto", "position", "layer"), default=None,
                   help="the connector's host_layout: the host pool's layer-major or "
                   "position-major rows, auto = by index group size (default: "
                   "--connector-config's, else auto)")
    m.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch CPU threads (default: %(default)s; the per-step tensors are "
                   "small, more threads mostly spin)")
    r = p.add_argument_group("run")
    r.add_argument("--runs", choices=RUNS, default="both",
                   help="which runs (default: %(default)s)")
    r.add_argument("--max-steps", type=int, default=20_000, metavar="N",
                   help="fail a run that has not finished after N steps (default: %(default)s)")
    r.add_argument("--json", metavar="PATH", type=output_path, help="write the spec, both "
                   "runs and the verdict as JSON (also on failure, and on Ctrl-C with the runs "
                   "completed so far: status 'interrupted', exit status 130)")
    r.add_argument("--plot", metavar="PNG", type=output_path, help="plot running requests, "
                   "free device blocks and hit / miss rates per step of each run (matplotlib)")
    r.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _spec(args, file_extra: dict | None):
    from vllm_hisparse.vllm.simulation.spec import SimulationSpec  # no vLLM, no torch

    return SimulationSpec(
        num_layers=args.layers, layers_per_indexer=args.layers_per_indexer,
        block_size=args.block_size, top_k=args.top_k, prefill_top_k=args.prefill_top_k,
        device_buffer_size=args.device_buffer_size, device_blocks=args.device_blocks,
        host_pool_gib=args.host_pool_gib, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_requests=args.requests,
        prompt_len=args.prompt_len, output_len=args.output_len,
        length_jitter=args.length_jitter, shared_prefix_len=args.shared_prefix_len,
        arrival=args.arrival, arrival_rate=args.arrival_rate, topk_drift=args.topk_drift,
        seed=args.seed, device=args.device, ops_backend=args.ops_backend,
        tensor_parallel_size=args.tensor_parallel_size,
        attention=args.attention, connector_extra=_extra_keys(args, file_extra),
        max_steps=args.max_steps)


def _extra_keys(args, file_extra: dict | None) -> dict:
    """Extra-config keys from --connector-config (without the keys the simulator sets), then
    the options that set one (an option given wins over the file)."""
    extra = {k: v for k, v in (file_extra or {}).items() if k not in _SIMULATOR_KEYS}
    if args.adaptive_hot_region:
        extra["adaptive_hot_region"] = True
    if args.hot_region_target_miss_rate is not None:
        extra["hot_region_target_miss_rate"] = args.hot_region_target_miss_rate
    if args.host_layout is not None:
        extra["host_layout"] = args.host_layout
    # Always set, so that the report's spec says which eviction ran.
    extra["hot_region_eviction"] = args.hot_region_eviction or extra.get("hot_region_eviction",
                                                                         "lru")
    return extra


#: Extra-config keys of a --connector-config file the simulator sets itself.
_SIMULATOR_KEYS = ("host_pool_gib", "ops_backend")

#: The connector's name (``vllm.config.CONNECTOR_NAME``, whose module imports vLLM; a test
#: checks they agree).
CONNECTOR_NAME = "HiSparseResidencyConnector"


def _read_connector_config(path: str | None) -> tuple[dict | None, dict | None]:
    """``(the file's JSON, our connector's kv_connector_extra_config)`` of a
    ``--kv-transfer-config`` JSON file (top level or a MultiConnector child); ``(None, None)``
    without a file. Plain JSON, before vLLM is imported: a file that is not a JSON object, or
    names no HiSparseResidencyConnector, is a ValueError naming the option
    (:func:`_check_connector_config` validates it with vLLM's ``KVTransferConfig`` later)."""
    if path is None:
        return None, None
    import json

    from vllm_hisparse.vllm.setup.connector_entries import connector_entries

    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--connector-config={path} is invalid: {exc}".splitlines()[0]) from None
    if not isinstance(raw, dict):
        raise ValueError(f"--connector-config={path} is invalid: expected a JSON object (a "
                         f"--kv-transfer-config), got {type(raw).__name__}")
    ours = [entry.extra for entry in connector_entries(raw.get("kv_connector"),
                                                       raw.get("kv_connector_extra_config"))
            if entry.name == CONNECTOR_NAME]
    if not ours:
        raise ValueError(f"--connector-config={path} is invalid: it names no {CONNECTOR_NAME} "
                         "(top level or a MultiConnector child)")
    return raw, dict(ours[0]) if isinstance(ours[0], dict) else {}


def _check_connector_config(path: str, raw: dict) -> None:
    """vLLM's own validation of the file (``KVTransferConfig``) and our entry's shape."""
    import types

    from vllm_hisparse.vllm import compat
    from vllm_hisparse.vllm.setup.config import find_connector_extra_config

    try:
        kv_transfer_config = compat.KVTransferConfig(**raw)
        find_connector_extra_config(types.SimpleNamespace(kv_transfer_config=kv_transfer_config))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--connector-config={path} is invalid: {exc}".splitlines()[0]) from None


class ProgressBar:
    """One status line on stderr, redrawn in place on a terminal; otherwise a line every few
    seconds."""

    def __init__(self, stream=None, interval_s: float | None = None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s if interval_s is not None else (0.2 if self.tty else 5.0)
        self._last = 0.0
        self._label = None
        self._width = 0
        self._done = False

    def __call__(self, p) -> None:
        now = time.monotonic()
        changed = p.label != self._label
        done_now = p.finished == p.total and not self._done
        if not changed and not done_now and now - self._last < self.interval_s:
            return
        if changed and self._label is not None:
            self.end()
        self._label, self._last = p.label, now
        self._done = p.finished == p.total
        done = p.finished / p.total if p.total else 1.0
        bar = "#" * int(20 * done) + "." * (20 - int(20 * done))
        line = (f"[{p.label:>17}] [{bar}] {p.finished}/{p.total} finished | step {p.step} | "
                f"running {p.running} | waiting {p.waiting}")
        if self.tty:
            self.stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
        self._width = 0


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_table(results: dict) -> str:
    """The comparison table (markdown). ``results``: label -> RunResult."""
    labels = list(results)
    rows = [
        ("peak running requests", lambda r: str(r.peak_running)),
        ("mean running requests", lambda r: f"{r.mean_running:.1f}"),
        ("preemptions", lambda r: str(r.preemptions)),
        ("generated tokens", lambda r: f"{r.generated_tokens:,}"),
        ("steps", lambda r: f"{r.steps:,}"),
        ("hot hit rate (host-backed selections)",
         lambda r: f"{100 * r.hot_hit_rate:.1f} %" if r.with_connector else "-"),
        ("miss rate (all selections)",
         lambda r: f"{100 * r.miss_rate:.2f} %" if r.with_connector else "-"),
        ("worst request's miss rate (host-backed selections)",
         lambda r: f"{100 * r.worst_request_miss_rate:.1f} %" if r.with_connector else "-"),
        ("bytes H2D (miss gathers + restores)",
         lambda r: _fmt_bytes(r.bytes_h2d) if r.with_connector else "-"),
        ("bytes D2H (mirrors + spills)",
         lambda r: _fmt_bytes(r.bytes_d2h) if r.with_connector else "-"),
        ("tokens loaded from host (prefix hits, resumes)",
         lambda r: f"{r.host_prefix_hit_tokens:,}" if r.with_connector else "-"),
        ("demotions / promotions",
         lambda r: f"{r.demotions} / {r.promotions}" if r.with_connector else "-"),
        ("hot blocks per MIXED/NONE request (mean)",
         lambda r: f"{r.mean_hot_blocks:.2f}" if r.hot_request_steps else "-"),
        ("hot region grows / shrinks",
         lambda r: f"{r.hot_grows} / {r.hot_shrinks}" if r.with_connector else "-"),
        ("peak device blocks in use", lambda r: f"{r.peak_blocks_in_use:,}"),
        ("peak device blocks saved", lambda r: f"{r.peak_blocks_saved:,}" if r.with_connector
         else "-"),
        ("rows checked", lambda r: f"{r.rows_checked:,}"),
        ("indexer rows checked (prefix starts)", lambda r: f"{r.indexer_rows_checked:,}"),
        ("wall time", lambda r: f"{r.wall_s:.1f} s"),
    ]
    out = ["| | " + " | ".join(labels) + " |", "|---" + "|---:" * len(labels) + "|"]
    for name, fmt in rows:
        out.append(f"| {name} | " + " | ".join(fmt(results[label]) for label in labels) + " |")
    return "\n".join(out)


def format_ranks(label: str, ranks: list[dict]) -> str:
    """Per tensor-parallel rank: rows checked, bytes each way, host pool memory (markdown),
    then the ranks' host memory in one line."""
    from vllm_hisparse.vllm.simulation.ranks import host_memory_line

    out = [f"tensor-parallel ranks ({label}):",
           "| rank | device | rows checked | bytes D2H | bytes H2D | host pool | resident | Pss |",
           "|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in ranks:
        pool = r["host_pool"]
        if pool is None:
            kind = resident = pss = "-"
        else:
            kind = ("private" if not pool["shared"] else
                    "shared, writes" if r["writes_host"] else "shared, reads")
            resident, pss = _fmt_bytes(pool["resident_bytes"]), _fmt_bytes(pool["pss_bytes"])
        out.append(f"| {r['rank']} | {r['device']} | {r['rows_checked']:,} | "
                   f"{_fmt_bytes(r['bytes_d2h'])} | {_fmt_bytes(r['bytes_h2d'])} | {kind} | "
                   f"{resident} | {pss} |")
    line = host_memory_line(ranks)
    if line:
        out.append(line)
    return "\n".join(out)


class StepSeries:
    """Per-step figures of each run for ``--plot``, from the engine's progress reports."""

    def __init__(self, forward=None):
        self.forward = forward
        self.runs: dict[str, dict[str, list[int]]] = {}
        self._last = (0, 0, 0)

    def __call__(self, p) -> None:
        if p.label not in self.runs:
            self.runs[p.label] = {k: [] for k in ("step", "running", "free_blocks", "resident",
                                                  "hot_hits", "misses")}
            self._last = (0, 0, 0)
        run = self.runs[p.label]
        counts = (p.resident, p.hot_hits, p.misses)
        for key, value, last in zip(("resident", "hot_hits", "misses"), counts, self._last):
            run[key].append(value - last)  # the counters are cumulative: this step's share
        self._last = counts
        run["step"].append(p.step)
        run["running"].append(p.running)
        run["free_blocks"].append(p.free_blocks)
        if self.forward is not None:
            self.forward(p)


def validate(args):
    """Every argument check that needs neither torch nor vLLM (those imports take a minute on
    a loaded machine): ``(spec, connector config file's JSON, its extra config)``."""
    if args.threads <= 0:
        raise ValueError(f"--threads={args.threads} is invalid; accepted: a positive integer")
    raw, file_extra = _read_connector_config(args.connector_config)
    spec = _spec(args, file_extra)
    spec.validate()  # ValueError -> exit 2 with the option's name
    if spec.device_blocks < 2:  # vLLM's own message would blame gpu_memory_utilization
        raise ValueError(f"--device-blocks={spec.device_blocks} is invalid: vLLM keeps one "
                         "block back (its null block); accepted: at least 2, and enough for "
                         "one request of --prompt-len + --output-len in every KV cache group")
    if spec.host_pool_gib is not None:
        check_fits_in_memory("--host-pool-gib", spec.host_pool_gib)
    return spec, raw, file_extra


class _LastProgress:
    """Remembers the engine's last progress report (for an interrupted run's report)."""

    def __init__(self, forward=None):
        self.forward, self.last = forward, None

    def __call__(self, p) -> None:
        self.last = p
        if self.forward is not None:
            self.forward(p)


def run(args) -> int:
    spec, raw, file_extra = validate(args)
    import torch  # before vLLM: its logging is set up at first import (cli/quiet.py)

    from vllm_hisparse.vllm.simulation.engine import SimulationEngine, SimulationFailure

    if raw is not None:
        _check_connector_config(args.connector_config, raw)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    bar = None if args.quiet else ProgressBar()
    series = StepSeries(bar) if args.plot else None
    progress = _LastProgress(series or bar)
    engine = SimulationEngine(spec, progress=progress)
    results: dict = {}
    report = {"command": "simulate", "spec": dataclasses.asdict(spec),
              "workload": [dataclasses.asdict(p) for p in engine.workload],
              "runs": {}, "status": "ok", "error": None}
    status = 0
    started = time.perf_counter()
    try:
        order = {"both": (False, True), "with": (True,), "without": (False,)}[args.runs]
        for with_connector in order:
            label = "with connector" if with_connector else "without connector"
            results[label] = engine.run(with_connector)
            report["runs"][label] = results[label].as_dict()
            if bar is not None:
                bar.end()
    except SimulationFailure as exc:
        if bar is not None:
            bar.end()
        report.update(status="failed", error=str(exc))
        if hasattr(exc, "layer"):
            report.update(mismatch={"request": exc.request, "step": exc.step,
                                    "layer": exc.layer, "position": exc.position})
        print(f"vllm-hisparse simulate: FAILED: {exc}", file=sys.stderr)
        status = 1
    except KeyboardInterrupt:
        if bar is not None:
            bar.end()
        where = _interrupted_at(progress.last)
        report.update(status="interrupted", error=f"interrupted (Ctrl-C){where}",
                      interrupted=None if progress.last is None
                      else dataclasses.asdict(progress.last))
        print(f"vllm-hisparse simulate: interrupted (Ctrl-C){where}", file=sys.stderr)
        status = EXIT_INTERRUPTED
    finally:
        torch.set_num_threads(threads)
        engine.close()
        report["wall_s"] = time.perf_counter() - started
    overridden = _overridden_keys(file_extra, engine, spec)
    if overridden:
        report["connector_config_overridden"] = overridden
    if results:
        print(_workload_line(spec))
        if overridden:
            print(_overridden_line(args.connector_config, overridden, args))
        print(format_table(results))
        for label, result in results.items():
            if result.ranks:
                print(format_ranks(label, result.ranks))
    if status == 0:
        total = sum(r.rows_checked for r in results.values())
        print(f"exact: all {total:,} rows read through the conversion path matched their ground "
              f"truth ({time.perf_counter() - started:.1f} s)")
    written = True
    if args.json:
        written &= write_json("--json", args.json, report, command="simulate")
    if args.plot and series.runs and status != EXIT_INTERRUPTED:
        from vllm_hisparse.cli.plots import simulate_plot

        written &= write_file("--plot", args.plot, lambda path: simulate_plot(
            path, series.runs, _workload_line(spec)), command="simulate")
    return status or (0 if written else 1)


def _interrupted_at(progress) -> str:
    if progress is None:
        return " before the first step"
    return (f" during the run {progress.label}, at step {progress.step} "
            f"({progress.finished}/{progress.total} requests finished)")


def _overridden_keys(file_extra: dict | None, engine, spec) -> dict:
    """The --connector-config file's keys the simulator replaced: key -> (file's, used)."""
    if not file_extra:
        return {}
    used = {"host_pool_gib": getattr(engine, "host_pool_gib_used", None) or spec.host_pool_gib,
            "ops_backend": spec.ops_backend}
    return {key: (file_extra[key], used[key]) for key in _SIMULATOR_KEYS
            if key in file_extra and file_extra[key] != used[key]}


def _overridden_line(path: str, overridden: dict, args) -> str:
    """One line: which of the file's keys the simulator replaced, by what, and why."""
    parts = []
    for key, (given, used) in overridden.items():
        if key == "host_pool_gib":
            how = ("--host-pool-gib" if args.host_pool_gib is not None else
                   "the simulator's default: enough for every request at once")
            shown = "?" if used is None else f"{used:.3g}"
            parts.append(f"host_pool_gib={given:g} replaced by {shown} GiB ({how})")
        else:
            parts.append(f"{key}={given} replaced by {used} (--{key.replace('_', '-')})")
    return (f"--connector-config {path}: " + "; ".join(parts)
            + "; the file's other keys are the connector's")


def _workload_line(spec) -> str:
    jitter = f" (+-{spec.length_jitter:.0%})" if spec.length_jitter else ""
    shared = f", {spec.shared_prefix_len} shared" if spec.shared_prefix_len else ""
    drift = f", {spec.topk_drift} top-k drift" if spec.topk_drift != "uniform" else ""
    eviction = (spec.connector_extra or {}).get("hot_region_eviction", "lru")
    drift += f", {eviction} hot-slot eviction" if eviction != "lru" else ""
    return (f"workload: {spec.num_requests} requests, prompt {spec.prompt_len}{shared} + "
            f"output {spec.output_len} tokens{jitter}, {spec.arrival} arrival{drift}; model: "
            f"{spec.num_layers} sparse layers ({spec.layers_per_indexer} per indexer), block "
            f"{spec.block_size}, top-k {spec.top_k}; {spec.device_blocks} device blocks; "
            f"device {', '.join(spec.rank_devices)}"
            + (f" (tensor parallel {spec.tensor_parallel_size})"
               if spec.tensor_parallel_size > 1 else ""))
