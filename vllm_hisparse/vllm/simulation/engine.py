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

What is synthetic (:class:`SyntheticForward`): the model runner's per-request block tables are
rebuilt from each ``SchedulerOutput`` as vLLM's model runner does (new requests' block ids,
appended ``new_block_ids``, replaced on resume); the "forward" writes deterministic KV bytes
(``worker.synthetic``: one row per request, position and layer) into the slots those tables
name, draws top-k selections (``TopkGenerator`` for decode tokens: recent tokens, a drifting
focus window and a few scattered positions; a seeded scatter over the whole prefix for prefill
tokens), converts them through every sparse layer's index group, and checks **every row** the
conversion returns against the ground truth of the selected position, request and layer. It
samples one fixed token per request whose prompt is complete. The indexer's own KV and the
attention arithmetic are not simulated.

Any mismatch raises :class:`SimulationMismatch` naming the request, step, layer and position and
what the row held instead; any other failure inside a step raises :class:`SimulationFailure`
with the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.compat import (
    KVConnectorOutput,
    ModelRunnerOutput,
    Request,
    SamplingParams,
    StructuredOutputManager,
    generate_scheduler_kv_cache_config,
    get_global_kv_cache_groups,
    get_kv_cache_configs,
    get_request_block_hasher,
    init_none_hash,
    sha256,
)
from vllm_hisparse.vllm.attention_hook import (
    BINDING_ATTR,
    compact_valid_to_front,
    finish_conversion,
    vllm_reference_conversion,
)
from vllm_hisparse.vllm.kv_planning import host_page_bytes, indexer_group_ids, sparse_group_ids
from vllm_hisparse.vllm.simulation.model import (
    dsa_layer_specs,
    kv_transfer_config,
    make_vllm_config,
    write_model_dir,
)
from vllm_hisparse.worker.device_rows import flat_row_view
from vllm_hisparse.worker.indexer_pages import page_view
from vllm_hisparse.worker.synthetic import HEADER_BYTES, TopkGenerator, describe_row, kv_rows

#: Token every synthetic forward samples (requests end on max_tokens, never on EOS).
SAMPLED_TOKEN = 7
#: The "request" a shared prompt prefix's KV rows name (every request sharing it reads them).
SHARED_PREFIX_SERIAL = 65_535
#: Layer offset of the indexer rows' synthetic KV (distinct from the sparse-MLA rows').
INDEXER_LAYER_BASE = 1_000
ARRIVALS = ("burst", "poisson")
#: How the synthetic attention layers convert top-k, i.e. which vLLM backend they imitate:
#: ``group``: every batch through the index group (``SparseMLACommonImpl``, FlashInfer
#: sparse); ``direct``: decode-only batches through the group, batches with prefill tokens
#: through the backend's own ``triton_convert_req_index_to_global_index`` call on the batch
#: block table (FlashAttention sparse; FlashMLA sparse's mixed-batch paths do the same).
ATTENTION_PATHS = ("direct", "group")
#: Where the generic sparse-MLA backend calls the direct conversion (a module global).
DIRECT_SITE_MODULE = "vllm.model_executor.layers.attention.sparse_mla_attention"


class SimulationFailure(RuntimeError):
    """The system under simulation failed (a refused step, a leak, a worker error)."""


class SimulationMismatch(SimulationFailure):
    """A row read through the conversion path is not the ground truth of its selection."""

    def __init__(self, message: str, *, request: str, step: int, layer: int, position: int):
        super().__init__(message)
        self.request, self.step, self.layer, self.position = request, step, layer, position


@dataclass(frozen=True)
class SimulationSpec:
    """Model geometry, device pool and workload of one simulation (both runs share it)."""

    num_layers: int = 4
    layers_per_indexer: int = 2  # IndexShare: a leader and (n - 1) layers reusing its top-k
    block_size: int = 64
    top_k: int = 128
    prefill_top_k: int = 16  # selections per prefill token (decode tokens select top_k)
    device_buffer_size: int | None = None  # hot rows per request (None: the connector default)
    device_blocks: int = 400
    host_pool_gib: float | None = None  # None: enough for every request at once
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    num_requests: int = 16
    prompt_len: int = 1024
    output_len: int = 256
    length_jitter: float = 0.0  # prompt / output lengths drawn uniformly within +-jitter
    shared_prefix_len: int = 0  # leading prompt tokens (and their KV) common to all requests
    arrival: str = "burst"
    arrival_rate: float = 0.5  # requests per step (poisson)
    seed: int = 0
    device: str = "cpu"
    ops_backend: str = "auto"
    attention: str = "direct"  # see ATTENTION_PATHS
    check: bool = True
    max_steps: int = 20_000

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option (CLI spelling) and what it accepts."""
        def need(ok: bool, option: str, accepted: str, value: Any) -> None:
            if not ok:
                raise ValueError(f"--{option}={value} is invalid; accepted: {accepted}")

        for name in ("num_layers", "block_size", "top_k", "device_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "num_requests", "prompt_len", "output_len",
                     "layers_per_indexer", "max_steps", "prefill_top_k"):
            value = getattr(self, name)
            option = {"num_requests": "requests", "num_layers": "layers"}.get(name, name)
            need(isinstance(value, int) and value > 0, option.replace("_", "-"),
                 "a positive integer", value)
        need(self.layers_per_indexer <= self.num_layers, "layers-per-indexer",
             f"at most --layers={self.num_layers}", self.layers_per_indexer)
        need(self.block_size in (16, 32, 64), "block-size", "16, 32 or 64", self.block_size)
        need(self.top_k % self.block_size == 0 or self.top_k < self.block_size, "top-k",
             "a multiple of --block-size (or smaller than it)", self.top_k)
        need(self.top_k <= 2048, "top-k", "at most 2048", self.top_k)
        need(0.0 <= self.length_jitter < 1.0, "length-jitter", "a fraction in [0, 1)",
             self.length_jitter)
        need(isinstance(self.shared_prefix_len, int) and 0 <= self.shared_prefix_len,
             "shared-prefix-len", "an integer >= 0 (at most the prompt length is shared)",
             self.shared_prefix_len)
        need(self.arrival in ARRIVALS, "arrival", " | ".join(ARRIVALS), self.arrival)
        need(self.attention in ATTENTION_PATHS, "attention", " | ".join(ATTENTION_PATHS),
             self.attention)
        need(self.arrival_rate > 0 and math.isfinite(self.arrival_rate), "arrival-rate",
             "a finite number > 0 (requests per step)", self.arrival_rate)
        need(self.host_pool_gib is None or (self.host_pool_gib > 0
                                            and math.isfinite(self.host_pool_gib)),
             "host-pool-gib", "a finite number > 0", self.host_pool_gib)
        need(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), "device",
             "cpu | cuda | cuda:N", self.device)
        need(self.ops_backend in ("auto", "cuda", "reference"), "ops-backend",
             "auto | cuda | reference", self.ops_backend)
        need(self.max_num_seqs <= 1024, "max-num-seqs", "at most 1024", self.max_num_seqs)
        need(self.num_requests < 65536, "requests", "fewer than 65536", self.num_requests)
        need(self.max_model_len <= 1 << 20, "prompt-len",
             "prompt + output lengths up to 1M tokens", self.prompt_len)
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"--device={self.device} is invalid: no CUDA device is visible; "
                             "accepted: cpu")
        if self.device == "cpu" and self.ops_backend == "cuda":
            raise ValueError("--ops-backend=cuda is invalid with --device=cpu; accepted: auto "
                             "or reference")

    @property
    def leaders(self) -> set[int]:
        return set(range(0, self.num_layers, self.layers_per_indexer))

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_len + int(self.prompt_len * self.length_jitter)

    @property
    def max_output_len(self) -> int:
        return self.output_len + int(self.output_len * self.length_jitter)

    @property
    def max_model_len(self) -> int:
        total = self.max_prompt_len + self.max_output_len
        return -(-total // self.block_size) * self.block_size


@dataclass
class RequestPlan:
    request_id: str
    serial: int  # the request number encoded in its KV rows
    arrival_step: int
    prompt_len: int
    output_len: int


def make_workload(spec: SimulationSpec) -> list[RequestPlan]:
    """The requests of a run: lengths and arrival steps (deterministic per seed)."""
    rng = random.Random(spec.seed)
    plans, t = [], 0.0
    for i in range(spec.num_requests):
        if spec.arrival == "poisson" and i > 0:
            t += rng.expovariate(spec.arrival_rate)

        def jitter(n: int) -> int:
            if not spec.length_jitter:
                return n
            d = int(n * spec.length_jitter)
            return max(1, n + rng.randint(-d, d))

        # Request i is "sim-<i+1>" and its rows say request i + 1: an unwritten (zero) row
        # never passes for a real one.
        plans.append(RequestPlan(f"sim-{i + 1}", i + 1, int(t), jitter(spec.prompt_len),
                                 jitter(spec.output_len)))
    return plans


@dataclass
class RunResult:
    """What one run (with or without the connector) measured."""

    with_connector: bool
    steps: int = 0
    peak_running: int = 0
    mean_running: float = 0.0
    preemptions: int = 0
    finished: int = 0
    generated_tokens: int = 0
    peak_blocks_in_use: int = 0
    peak_blocks_saved: int = 0
    rows_checked: int = 0
    tokens_checked: int = 0
    resident: int = 0
    hot_hits: int = 0
    misses: int = 0
    bytes_h2d: int = 0
    bytes_d2h: int = 0
    gather_bytes: int = 0
    restore_bytes: int = 0
    demotions: int = 0
    promotions: int = 0
    released_pages: int = 0
    host_prefix_hit_tokens: int = 0  # loaded from the host tier (prefix hits, resumes)
    published_pages: int = 0
    indexer_rows_checked: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def hot_hit_rate(self) -> float:
        host = self.hot_hits + self.misses
        return self.hot_hits / host if host else 0.0

    @property
    def miss_rate(self) -> float:
        """Misses over every distinct selection (resident + hot hits + misses)."""
        total = self.resident + self.hot_hits + self.misses
        return self.misses / total if total else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["hot_hit_rate"] = self.hot_hit_rate
        out["miss_rate"] = self.miss_rate
        return out


@dataclass
class Progress:
    label: str
    step: int
    running: int
    waiting: int
    finished: int
    total: int
    # For per-step plots: the BlockPool's free blocks after the step, and the worker's
    # selection counters so far (distinct resident / hot hit / miss selections).
    free_blocks: int = 0
    resident: int = 0
    hot_hits: int = 0
    misses: int = 0


# ================================================================================ layers


class SyntheticSparseMLAImpl:
    """Stands in for vLLM's sparse-MLA attention impl of one layer, reduced to what decides
    which KV rows attention reads. ``forward_mqa`` takes the indexer's top-k from
    ``topk_indices_buffer`` and converts it as vLLM's generic ``SparseMLACommonImpl.forward_mqa``
    does (``sparse_mla_attention.py:749-790``): through the layer's index group
    (``convert_logical_to_physical_topk``), or, with ``group_conversion_decode_only`` and a
    batch holding prefill tokens, through the module-global direct conversion on the batch
    block table. ``block_stride_rows`` comes from the cache's flat row view. It returns
    ``(physical rows, valid counts)`` instead of attention output: the simulator checks them."""

    def __init__(self, index_group: Any, index_group_index: int, topk_indices_buffer: torch.Tensor,
                 group_conversion_decode_only: bool):
        self.index_group = index_group
        self.index_group_index = index_group_index
        self.topk_indices_buffer = topk_indices_buffer
        self.group_conversion_decode_only = group_conversion_decode_only

    def forward_mqa(self, q: torch.Tensor, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any,
                    layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        topk = self.topk_indices_buffer[:num_tokens]
        block_size = attn_metadata.block_size
        _, block_stride_rows = flat_row_view(kv_c_and_k_pe_cache, block_size)
        if self.group_conversion_decode_only and not (
                self.index_group.num_layers > 1
                and attn_metadata.num_decode_tokens >= num_tokens):
            convert = getattr(importlib.import_module(DIRECT_SITE_MODULE),
                              "triton_convert_req_index_to_global_index")
            return convert(attn_metadata.req_id_per_token[:num_tokens], attn_metadata.block_table,
                           topk, BLOCK_SIZE=block_size, BLOCK_STRIDE_ROWS=block_stride_rows,
                           NUM_TOPK_TOKENS=topk.shape[1], return_valid_counts=True)
        return self.index_group.convert_logical_to_physical_topk(
            self.index_group_index, topk, attn_metadata, block_stride_rows=block_stride_rows,
            return_valid_counts=True)


def cpu_direct_conversion(req_id, block_table, token_indices, BLOCK_SIZE=64,
                          BLOCK_STRIDE_ROWS=None, NUM_TOPK_TOKENS=2048, BLOCK_N=128,
                          HAS_PREFILL_WORKSPACE=False, prefill_workspace_request_ids=None,
                          prefill_workspace_starts=None, prefill_workspace_rank_stride=None,
                          dcp_size=1, dcp_rank=0, cp_kv_cache_interleave_size=1,
                          return_valid_counts=False, out=None, valid_counts_out=None,
                          idx_mapping=None):
    """Pure-torch twin of vLLM's ``triton_convert_req_index_to_global_index``
    (``sparse_utils.py:493``, same signature) for CPU runs, where Triton cannot run. The
    prefill workspace, DCP and ``idx_mapping`` are not needed by the simulator."""
    if HAS_PREFILL_WORKSPACE or dcp_size != 1 or idx_mapping is not None:
        raise NotImplementedError("cpu_direct_conversion: prefill workspace, DCP and "
                                  "idx_mapping are not simulated")
    rows = vllm_reference_conversion(req_id, block_table, token_indices, BLOCK_SIZE,
                                     BLOCK_STRIDE_ROWS)
    return finish_conversion(rows, return_valid_counts, out, valid_counts_out)


class _ProcessPatches:
    """Remove, after a run, the process-wide patches its worker role installed."""

    def __enter__(self):
        self._hook = compat.topk_conversion_hook_installed()
        routed = getattr(compat, "direct_conversion_routing_installed", None)
        self._routing = routed() if routed is not None else True
        return self

    def __exit__(self, *exc):
        if not self._hook:
            compat.remove_topk_conversion_hook()
        if not self._routing:
            compat.remove_direct_conversion_routing()
        return False


class _CpuDirectConversion:
    """Puts :func:`cpu_direct_conversion` in place of vLLM's Triton function (in
    ``sparse_utils`` and at every direct site) for one CPU run, so that the worker role's
    routing wraps the twin; restores vLLM's function afterwards."""

    def __init__(self):
        self._saved: dict[Any, Any] = {}

    def __enter__(self):
        if getattr(compat, "remove_direct_conversion_routing", None) is not None:
            compat.remove_direct_conversion_routing()
        modules = ["vllm.v1.attention.backends.mla.sparse_utils", DIRECT_SITE_MODULE]
        modules += list(getattr(compat, "DIRECT_CONVERSION_SITES", {}))
        for name in dict.fromkeys(modules):
            module = importlib.import_module(name)
            self._saved[module] = module.__dict__.get("triton_convert_req_index_to_global_index")
            module.triton_convert_req_index_to_global_index = cpu_direct_conversion
        return self

    def __exit__(self, *exc):
        if getattr(compat, "remove_direct_conversion_routing", None) is not None:
            compat.remove_direct_conversion_routing()
        for module, fn in self._saved.items():
            module.triton_convert_req_index_to_global_index = fn
        return False


# ================================================================================ engine


class SimulationEngine:
    """Runs one :class:`SimulationSpec` with and without the connector.

    Args:
        spec: the simulation.
        workdir: where the generated model config goes (default: a temporary directory).
        progress: called after every step with a :class:`Progress`.
    """

    def __init__(self, spec: SimulationSpec, *, workdir: Path | None = None,
                 progress: Callable[[Progress], None] | None = None):
        spec.validate()
        self.spec = spec
        self.progress = progress
        self.workload = make_workload(spec)
        self._tmp = None
        if workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="vllm-hisparse-sim-")
            workdir = Path(self._tmp.name)
        self.model_dir = write_model_dir(Path(workdir) / "dsa-tiny", index_topk=spec.top_k,
                                         num_hidden_layers=spec.num_layers)
        from vllm_hisparse.vllm.plugin import register

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
        pages = sum(-(-(p.prompt_len + p.output_len) // spec.block_size) for p in self.workload)
        pages += -(-spec.max_model_len // spec.block_size)
        return math.ceil(pages * per_block * 1.05 / (1 << 30) * 64) / 64

    def _config(self, host_gib: float):
        spec = self.spec
        extra: dict[str, Any] = {"host_pool_gib": host_gib,
                                 "ops_backend": spec.ops_backend}
        if spec.device_buffer_size is not None:
            extra["device_buffer_size"] = spec.device_buffer_size
        return make_vllm_config(
            self.model_dir, kv_transfer=kv_transfer_config(extra),
            max_model_len=spec.max_model_len, block_size=spec.block_size,
            max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
            device=("cuda" if spec.device.startswith("cuda") else "cpu"))

    def _plan(self, vllm_config):
        spec = self.spec
        specs = dsa_layer_specs(spec.num_layers, leaders=spec.leaders, block_size=spec.block_size)
        groups = get_global_kv_cache_groups(vllm_config, [specs])
        vllm_config.cache_config.num_gpu_blocks_override = spec.device_blocks
        try:
            # With the override vLLM sizes the pool to exactly device_blocks whatever memory
            # we claim; claim plenty so its max_model_len check passes.
            (full,) = get_kv_cache_configs(vllm_config, [specs], [1 << 40], groups)
        finally:
            vllm_config.cache_config.num_gpu_blocks_override = None
        vllm_config.cache_config.num_gpu_blocks = spec.device_blocks
        # The engine core hands the scheduler each group collapsed to its first layer's spec.
        return full, generate_scheduler_kv_cache_config([full])

    def run(self, with_connector: bool) -> RunResult:
        """One run of the workload; raises :class:`SimulationFailure` on any failure."""
        spec = self.spec
        label = "with connector" if with_connector else "without connector"
        probe = self._config(spec.host_pool_gib or 1024.0)  # planning only: sizes nothing
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
        vllm_config = self._config(host_gib)
        full, sched_config = self._plan(vllm_config)
        if not with_connector:
            # Same plan and pool; vLLM's stock managers, no connector.
            vllm_config.kv_transfer_config = None
        with contextlib.ExitStack() as stack:
            # The worker role patches vLLM process-wide when it binds (top-k hook, direct
            # conversion routing); a run leaves the process as it found it.
            stack.enter_context(_ProcessPatches())
            if not spec.device.startswith("cuda"):
                stack.enter_context(_CpuDirectConversion())
            runner = _Run(self, label, vllm_config, full, sched_config, with_connector)
            try:
                return runner.execute()
            finally:
                runner.close()


# ================================================================================ one run


@dataclass
class _ReqState:
    plan: RequestPlan
    block_ids: list[list[int]] | None = None  # per sparse group (model runner's view)
    next_pos: int = 0  # the position the model runner expects next
    topk: TopkGenerator | None = None
    slot: int = -1  # ground-truth store slot (-1: none yet)
    indexer_block_ids: list[list[int]] | None = None  # per indexer group


class _Run:
    """One run: scheduler, optional worker connector, synthetic forward, counters."""

    def __init__(self, engine: SimulationEngine, label: str, vllm_config, full_config,
                 sched_config, with_connector: bool):
        spec = engine.spec
        self.engine, self.spec, self.label = engine, spec, label
        self.vllm_config = vllm_config
        self.with_connector = with_connector
        self.device = torch.device(spec.device)
        self.block_size = spec.block_size
        self.result = RunResult(with_connector=with_connector)
        self.num_groups = len(sched_config.kv_cache_groups)
        self.sparse_groups = sparse_group_ids(full_config)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)

        scheduler_cls, _ = compat.scheduler_classes()
        self.scheduler = scheduler_cls(
            vllm_config=vllm_config, kv_cache_config=sched_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=self.block_size, log_stats=True)

        # The per-layer KV tensors vLLM's worker allocates for this plan.
        layout = compat.resolved_kv_cache_layout(vllm_config)
        self.kv = compat.allocate_kv_cache(full_config, self.device, layout)
        # Sparse-MLA layers: name -> (group id, model layer, flat row view, block stride rows).
        self.layers: dict[str, tuple[int, int, torch.Tensor, int]] = {}
        self.units: list[tuple[int, list[str], Any]] = []  # (group id, layer names, index group)
        for g in self.sparse_groups:
            group = full_config.kv_cache_groups[g]
            per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
            for name in group.layer_names:
                rows, stride = flat_row_view(self.kv[name], self.block_size)
                self.layers[name] = (g, int(name.split(".")[2]), rows, stride)
                leader = getattr(per_layer.get(name), "is_index_group_leader", True)
                if leader or not self.units or self.units[-1][0] != g:
                    self.units.append((g, [name], None))
                else:
                    self.units[-1][1].append(name)
        self.row_bytes = next(iter(self.layers.values()))[2].shape[1]
        # Indexer layers: name -> (index among the indexer groups, layer, uint8 view
        # [num_blocks, block_size, row_bytes]). The forward writes them; prefix hits must
        # bring them back. (Their blocks are packed at a stride that is not a whole number
        # of rows, so no flat row view.)
        self.indexer_groups = indexer_group_ids(full_config)
        self.indexer_layers: dict[str, tuple[int, int, torch.Tensor]] = {}
        for i, g in enumerate(self.indexer_groups):
            for name in full_config.kv_cache_groups[g].layer_names:
                pages = page_view(self.kv[name])
                view = pages.view(torch.uint8).as_strided(
                    (pages.shape[0], self.block_size, pages.shape[1] // self.block_size),
                    (pages.stride(0), pages.shape[1] // self.block_size, 1))
                self.indexer_layers[name] = (i, int(name.split(".")[2]), view)
        max_tokens = spec.max_num_batched_tokens + spec.max_num_seqs
        self.units = [(g, names, self._make_index_group(max_tokens)) for g, names, _ in self.units]
        # The model's sparse-MLA attention layers, as the connector finds them (static
        # forward context): one per layer, the layers of an index unit sharing one group and
        # one top-k buffer (what the unit's indexer writes).
        forward_context = compat.static_forward_context(vllm_config)
        self.impls: dict[str, SyntheticSparseMLAImpl] = {}
        for _, names, group in self.units:
            topk_buffer = torch.full((max_tokens, spec.top_k), -1, dtype=torch.int32,
                                     device=self.device)
            for i, name in enumerate(names):
                group.register_layer()
                impl = SyntheticSparseMLAImpl(group, i, topk_buffer,
                                              spec.attention == "direct")
                self.impls[name] = impl
                forward_context[name] = SimpleNamespace(impl=impl)

        self.worker = None
        if with_connector:
            from vllm_hisparse.vllm.compat import KVConnectorFactory, KVConnectorRole

            self.worker = KVConnectorFactory.create_connector(
                config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=full_config)
            self.worker.register_kv_caches(self.kv)
            unbound = [names[0] for _, names, group in self.units
                       if getattr(group, BINDING_ATTR, None) is None]
            if unbound:
                raise SimulationFailure(f"the worker role did not bind the index groups of "
                                        f"{unbound} through the static forward context")
            self.residency = self.scheduler.connector.scheduler_role
        self.requests: dict[str, _ReqState] = {}
        self.step = 0
        self._store: torch.Tensor | None = None
        self._free_slots: list[int] = []

    def _make_index_group(self, max_tokens: int):
        """vLLM's ``SparseMLAIndexGroup`` for one index unit. On CPU its Triton conversion is
        replaced by the pure-torch twin (``attention_hook.vllm_reference_conversion``)."""
        cls = compat.sparse_mla_index_group_class()
        k = self.spec.top_k
        buf = torch.zeros((max_tokens, k), dtype=torch.int32, device=self.device)
        on_cuda = self.device.type == "cuda"
        group = cls(logical_topk_indices=buf, physical_topk_indices=torch.zeros_like(buf),
                    valid_topk_counts=torch.zeros(max_tokens, dtype=torch.int32,
                                                  device=self.device),
                    side_stream=torch.cuda.Stream(self.device) if on_cuda else None,
                    logical_topk_ready=torch.cuda.Event() if on_cuda else None,
                    physical_topk_ready=torch.cuda.Event() if on_cuda else None,
                    has_indexer=False)
        if not on_cuda:
            def convert_once(layer_index, logical, req_id, block_table, block_size, *,
                             block_stride_rows, return_valid_counts, idx_mapping=None):
                rows = vllm_reference_conversion(req_id, block_table, logical, block_size,
                                                 block_stride_rows)
                return compact_valid_to_front(rows) if return_valid_counts else rows

            group._convert_once = convert_once
        return group

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.kv = {}
        self.layers = {}

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
                runner_output = self._forward(output)
            except SimulationFailure:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure names its step
                raise SimulationFailure(f"{self.label}, step {self.step}: {type(exc).__name__}: "
                                        f"{exc}") from exc
            engine_outputs = self.scheduler.update_from_output(output, runner_output)
            for outputs in engine_outputs.values():
                for out in outputs.outputs:
                    result.generated_tokens += len(out.new_token_ids)
                    if out.finish_reason is not None:
                        result.finished += 1
                        self._release_slot(out.request_id)
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
        # Prompt tokens unique per request (no cross-request prefix hits: every request's KV
        # bytes are its own); a preempted request recomputes and may hit its own blocks.
        rng = random.Random(plan.serial * 7_919 + self.spec.seed)
        tokens = [rng.randrange(10, 1000) for _ in range(plan.prompt_len)]
        shared = self._shared_len(plan)
        if shared:
            common = random.Random(self.spec.seed * 31 + 17)
            tokens[:shared] = [common.randrange(10, 1000) for _ in range(shared)]
        request = Request(request_id=plan.request_id, prompt_token_ids=tokens,
                          sampling_params=SamplingParams(max_tokens=plan.output_len,
                                                         ignore_eos=True),
                          pooling_params=None, block_hasher=self._hasher)
        self.requests[plan.request_id] = _ReqState(plan)
        self.scheduler.add_request(request)

    # ------------------------------------------------------------------ the forward

    def _update_tables(self, so) -> None:
        """The model runner's per-request block tables, from the scheduler output only."""
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
            state.block_ids = [list(new.block_ids[g]) for g in self.sparse_groups]
            state.indexer_block_ids = [list(new.block_ids[g]) for g in self.indexer_groups]
            state.next_pos = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = [list(new_ids[g]) for g in self.sparse_groups]
                state.indexer_block_ids = [list(new_ids[g]) for g in self.indexer_groups]
                state.next_pos = cached.num_computed_tokens[i]
            else:
                if state.block_ids is None:
                    raise SimulationFailure(f"step {self.step}: {rid} scheduled as a running "
                                            "request the model runner does not hold")
                if new_ids is not None:
                    for g, table in zip(self.sparse_groups, state.block_ids):
                        table.extend(new_ids[g])
                    for g, table in zip(self.indexer_groups, state.indexer_block_ids):
                        table.extend(new_ids[g])
                if cached.num_computed_tokens[i] != state.next_pos:
                    raise SimulationFailure(
                        f"step {self.step}: {rid} resumes at position "
                        f"{cached.num_computed_tokens[i]}, the model runner expected "
                        f"{state.next_pos}")

    def _slot(self, state: _ReqState) -> int:
        """The request's slot in the ground-truth store (uint8 ``[slots, layers, max_len,
        row_bytes]``: every layer's KV of every position), filled on first use."""
        if state.slot >= 0:
            return state.slot
        if not self._free_slots:
            old = self._store
            grow = max(4, 0 if old is None else old.shape[0])
            fresh = torch.empty((grow, self.spec.num_layers, self.spec.max_model_len,
                                 self.row_bytes), dtype=torch.uint8, device=self.device)
            first = 0 if old is None else old.shape[0]
            self._store = fresh if old is None else torch.cat([old, fresh])
            self._free_slots = list(range(first + grow - 1, first - 1, -1))
        state.slot = self._free_slots.pop()
        total = state.plan.prompt_len + state.plan.output_len
        shared = self._shared_len(state.plan)
        pos = torch.arange(total, device=self.device)
        for layer in range(self.spec.num_layers):
            self._store[state.slot, layer, :total] = kv_rows(state.plan.serial, pos, layer,
                                                             self.row_bytes)
            if shared:
                self._store[state.slot, layer, :shared] = kv_rows(
                    SHARED_PREFIX_SERIAL, pos[:shared], layer, self.row_bytes)
        return state.slot

    def _shared_len(self, plan: RequestPlan) -> int:
        """Leading positions whose tokens and KV every request shares."""
        return min(self.spec.shared_prefix_len, plan.prompt_len)

    def _indexer_truth(self, plan: RequestPlan, positions: torch.Tensor, layer: int,
                       row_bytes: int) -> torch.Tensor:
        """The indexer KV the forward writes at ``positions`` (shared prefix included)."""
        rows = kv_rows(plan.serial, positions, INDEXER_LAYER_BASE + layer, row_bytes)
        shared = positions < self._shared_len(plan)
        if bool(shared.any()):
            rows[shared] = kv_rows(SHARED_PREFIX_SERIAL, positions[shared],
                                   INDEXER_LAYER_BASE + layer, row_bytes)
        return rows

    def _check_loaded_indexer_pages(self, so) -> None:
        """Requests that start this step with computed tokens (a prefix hit, local or from
        the host tier, or a resume) must find their indexer KV in place for all of them."""
        starts = [(new.req_id, new.num_computed_tokens) for new in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        starts += [(rid, cached.num_computed_tokens[i]) for i, rid in enumerate(cached.req_ids)
                   if rid in cached.resumed_req_ids]
        bs = self.block_size
        for rid, computed in starts:
            if computed <= 0:
                continue
            state = self.requests[rid]
            pos = torch.arange(computed, device=self.device)
            for name, (g, layer, view) in self.indexer_layers.items():
                blocks = torch.as_tensor(state.indexer_block_ids[g], dtype=torch.int64,
                                         device=self.device)[pos // bs]
                got = view[blocks, pos % bs]
                want = self._indexer_truth(state.plan, pos, layer, view.shape[2])
                bad = (got != want).any(dim=1).nonzero()
                if bad.numel():
                    p = int(bad[0])
                    raise SimulationMismatch(
                        f"{self.label}, step {self.step}: {rid} starts with {computed} computed "
                        f"tokens but indexer layer {layer} holds wrong KV at position {p} "
                        f"(got {describe_row(got[p])}, want {describe_row(want[p])})",
                        request=rid, step=self.step, layer=layer, position=p)
                self.result.indexer_rows_checked += computed

    def _release_slot(self, rid: str) -> None:
        state = self.requests.pop(rid, None)
        if state is not None and state.slot >= 0:
            self._free_slots.append(state.slot)

    def _selections(self, state: _ReqState, start: int, n: int) -> torch.Tensor:
        """int32 ``[n, K]`` top-k of the tokens at positions ``start .. start + n - 1`` (each
        attends to ``[0, p]``); -1 padding only at the end of a row."""
        k = self.spec.top_k
        if n == 1 and start >= state.plan.prompt_len:
            if state.topk is None:
                state.topk = TopkGenerator(k, seed=state.plan.serial * 1_000 + self.spec.seed,
                                           recent=min(32, k // 2), drift_tokens=4.0)
            return state.topk.select(start + 1).reshape(1, k)
        # Prefill: ``prefill_top_k`` distinct positions per token spread over the whole
        # prefix (a stride walk from a seeded random start), -1 after them. Fewer than K
        # keeps the check of long prompts cheap; every returned row is still checked.
        kp = min(k, self.spec.prefill_top_k)
        pos = torch.arange(start, start + n, dtype=torch.int64)
        ctx = pos + 1
        g = torch.Generator().manual_seed(state.plan.serial * 65_537 + start)
        first = (torch.rand(n, generator=g) * ctx).to(torch.int64)
        j = torch.arange(k, dtype=torch.int64)
        stride = torch.clamp(ctx // kp, min=1)  # j * stride < ctx for j < min(kp, ctx)
        sel = (first[:, None] + j[None, :] * stride[:, None]) % ctx[:, None]
        valid = (j[None, :] < ctx[:, None]) & (j[None, :] < kp)
        sel = torch.where(valid, sel, torch.full_like(sel, -1))
        return sel.to(torch.int32)

    def _forward(self, so) -> ModelRunnerOutput:
        """One engine step's model execution, in the order vLLM's GPU model runner runs it."""
        self._update_tables(so)
        req_ids = list(so.num_scheduled_tokens)
        batch: list[tuple[str, _ReqState, int, int]] = []
        for rid in req_ids:
            state = self.requests[rid]
            batch.append((rid, state, state.next_pos, so.num_scheduled_tokens[rid]))
        metadata = self._attention_metadata(batch) if batch else {}
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
        if self.spec.check and self.indexer_layers:
            self._check_loaded_indexer_pages(so)
        if batch:
            self._write_kv(batch)
            if self.spec.check:
                self._attend(batch, metadata)
        for _, state, start, n in batch:
            state.next_pos = start + n
        connector_output = None
        if worker is not None:
            worker.wait_for_save()
            loads = worker.get_transfer_results(set())
            meta = worker.build_connector_worker_meta()
            stats = worker.get_kv_connector_stats()
            if stats is not None:
                self._add_worker_stats(stats)
            worker.clear_connector_metadata()
            connector_output = KVConnectorOutput(
                kv_connector_worker_meta=meta, finished_recving=loads.finished_recving or None,
                failed_recving=loads.failed_recving)
        sampled = []
        for rid, state, start, n in batch:
            sampled.append([SAMPLED_TOKEN] if start + n >= state.plan.prompt_len else [])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled,
                                 kv_connector_output=connector_output)

    def _block_of(self, state: _ReqState, group_index: int, pages: torch.Tensor) -> torch.Tensor:
        table = state.block_ids[group_index]
        if int(pages.max()) >= len(table):
            raise SimulationFailure(f"step {self.step}: {state.plan.request_id} writes page "
                                    f"{int(pages.max())} but the model runner's block table of "
                                    f"KV cache group {self.sparse_groups[group_index]} has "
                                    f"{len(table)} blocks")
        return torch.as_tensor(table, dtype=torch.int64, device=self.device)[pages]

    def _write_kv(self, batch) -> None:
        """The forward writes each scheduled token's KV into the slot the model runner's
        block table names (vLLM's slot mapping), in every sparse-MLA layer."""
        bs = self.block_size
        group_index = {g: i for i, g in enumerate(self.sparse_groups)}
        for rid, state, start, n in batch:
            slot = self._slot(state)
            truth = self._store[slot]
            pos = torch.arange(start, start + n, device=self.device)
            blocks = {g: self._block_of(state, i, pos // bs) for g, i in group_index.items()}
            for name, (g, layer, view, stride) in self.layers.items():
                rows = blocks[g] * stride + pos % bs
                view[rows] = truth[layer, start:start + n]
            for name, (g, layer, view) in self.indexer_layers.items():
                table = torch.as_tensor(state.indexer_block_ids[g], dtype=torch.int64,
                                        device=self.device)
                view[table[pos // bs], pos % bs] = self._indexer_truth(
                    state.plan, pos, layer, view.shape[2])

    def _attention_metadata(self, batch) -> dict[str, Any]:
        """Layer name -> the attention metadata of its KV cache group: the batch block table
        (one tensor per group, shared by its layers, as vLLM builds it), the batch row of
        every token, and the decode / prefill split (decodes first, as vLLM orders them)."""
        bs = self.block_size
        req_of_token = [torch.full((n,), b, dtype=torch.int32)
                        for b, (_, _, _, n) in enumerate(batch)]
        req_id_per_token = torch.cat(req_of_token).to(self.device)
        num_tokens = int(req_id_per_token.shape[0])
        num_decode_tokens = 0
        for _, _, _, n in batch:
            if n > 1:
                break
            num_decode_tokens += n
        out: dict[str, Any] = {}
        for g_index, g in enumerate(self.sparse_groups):
            width = max(len(state.block_ids[g_index]) for _, state, _, _ in batch)
            table = torch.zeros((len(batch), max(1, width)), dtype=torch.int32)
            for b, (_, state, _, _) in enumerate(batch):
                ids = state.block_ids[g_index]
                table[b, :len(ids)] = torch.as_tensor(ids, dtype=torch.int32)
            md = SimpleNamespace(req_id_per_token=req_id_per_token,
                                 block_table=table.to(self.device), block_size=bs,
                                 num_actual_tokens=num_tokens,
                                 num_decode_tokens=num_decode_tokens)
            for name, (layer_group, *_rest) in self.layers.items():
                if layer_group == g:
                    out[name] = md
        return out

    def _attend(self, batch, metadata) -> None:
        """Every sparse-MLA layer's attention, reduced to its top-k conversion: the unit's
        indexer fills the top-k buffer, each layer's ``forward_mqa`` converts it, and every
        row it returns is checked against the ground truth."""
        spans, topks = [], []
        t = 0
        for rid, state, start, n in batch:
            topks.append(self._selections(state, start, n))
            spans.append((rid, state, t, n, start))
            t += n
        topk = torch.cat(topks).to(self.device)
        counts_want = (topk >= 0).sum(dim=1)
        q = torch.empty((t, 1), device=self.device)
        for _, names, _ in self.units:
            self.impls[names[0]].topk_indices_buffer[:t] = topk
            for name in names:
                _, layer, view, _ = self.layers[name]
                rows, counts = self.impls[name].forward_mqa(q, self.kv[name], metadata[name],
                                                            None)
                self._check(rows, counts, counts_want, topk, spans, layer, view)
        self.result.tokens_checked += t

    def _check(self, rows, counts, counts_want, topk, spans, layer, view) -> None:
        """Every valid row the conversion returned must hold the ground truth of its selection
        (whole rows compared). ``spans``: (request id, state, first token, tokens, first
        position) per request of the batch."""
        num_tokens, k = topk.shape
        counts = counts[:num_tokens].to(torch.int64)
        if not torch.equal(counts, counts_want):
            t = int((counts != counts_want).nonzero()[0])
            rid, state, token_pos = self._token(t, spans)
            self._fail(rid, layer, token_pos, f"the conversion returned {int(counts[t])} rows "
                       f"for {int(counts_want[t])} selections")
        mask = torch.arange(k, device=topk.device)[None, :] < counts_want[:, None]
        got_rows = rows[:num_tokens].to(torch.int64)[mask]
        positions = topk.to(torch.int64)[mask]
        if got_rows.numel() and (int(got_rows.min()) < 0 or int(got_rows.max()) >= view.shape[0]):
            i = int(((got_rows < 0) | (got_rows >= view.shape[0])).nonzero()[0])
            rid, state, token_pos = self._token(self._token_of(i, counts_want), spans)
            self._fail(rid, layer, token_pos, f"selection of position {int(positions[i])} "
                       f"converted to row {int(got_rows[i])}, outside the layer's "
                       f"{view.shape[0]} rows")
        got = view.index_select(0, got_rows)
        slot_of_token = torch.cat([torch.full((n,), self._slot(state), dtype=torch.int64)
                                   for _, state, _, n, _ in spans]).to(topk.device)
        store = self._store  # after _slot: it may have grown
        per_slot = store.shape[1] * store.shape[2]
        index = (slot_of_token.repeat_interleave(counts_want) * per_slot
                 + layer * store.shape[2] + positions)
        want = store.view(-1, self.row_bytes).index_select(0, index)
        if not torch.equal(got, want):
            bad = (got != want).any(dim=1).nonzero().flatten()
            if not self._same_sets(bad, got, want, counts_want):
                i = int(bad[0])
                rid, state, token_pos = self._token(self._token_of(i, counts_want), spans)
                p = int(positions[i])
                differs = (got[i] != want[i]).nonzero().flatten()
                if bool(torch.equal(got[i, :HEADER_BYTES], want[i, :HEADER_BYTES])):
                    held = (f"the right row header but {differs.numel()} corrupted bytes "
                            f"(first at byte {int(differs[0])})")
                else:
                    what = ("an unwritten (all-zero) row" if not bool(got[i].any())
                            else describe_row(got[i].cpu()))
                    held = (f"{what}, not (request {state.plan.serial}, position {p}, "
                            f"layer {layer})")
                self._fail(rid, layer, token_pos,
                           f"selected position {p} (page {p // self.block_size}) read row "
                           f"{int(got_rows[i])} holding {held}{self._residency_note(rid)}; "
                           f"{bad.numel()} of {got.shape[0]} rows wrong")
        self.result.rows_checked += got.shape[0]

    @staticmethod
    def _token_of(i: int, counts_want: torch.Tensor) -> int:
        """Token of flattened valid selection ``i``."""
        cum = counts_want.cumsum(0)
        return int(torch.searchsorted(cum, torch.tensor([i], device=cum.device), right=True))

    @staticmethod
    def _token(t: int, spans) -> tuple[str, _ReqState, int]:
        """(request id, state, position) of batch token ``t``."""
        for rid, state, t0, n, start in spans:
            if t0 <= t < t0 + n:
                return rid, state, start + t - t0
        raise AssertionError("token outside the batch")

    def _same_sets(self, bad, got, want, counts_want) -> bool:
        """vLLM's CUDA conversion guarantees only the set of a token's valid rows, not their
        order: accept a token whose rows are a permutation of the right ones."""
        if self.device.type != "cuda":
            return False
        ends = counts_want.cumsum(0)
        for t in torch.unique(torch.searchsorted(ends, bad, right=True)).tolist():
            a, b = int(ends[t] - counts_want[t]), int(ends[t])
            if ({bytes(r.cpu().numpy()) for r in got[a:b]}
                    != {bytes(r.cpu().numpy()) for r in want[a:b]}):
                return False
        return True

    def _residency_note(self, rid: str) -> str:
        if self.worker is None:
            return ""
        try:
            policy = self.residency.policy
            residency = policy.residency(rid)
            return f" [request residency {residency.name}]"
        except Exception:  # noqa: BLE001 - diagnostics only
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

    def _account_blocks(self) -> None:
        pool = self.scheduler.kv_cache_manager.block_pool
        in_use = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        r = self.result
        r.peak_blocks_in_use = max(r.peak_blocks_in_use, in_use)
        # What full residency would hold for the same running requests: every page of every
        # group for the tokens computed so far.
        need = sum(-(-req.num_computed_tokens // self.block_size) for req in self.scheduler.running)
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
