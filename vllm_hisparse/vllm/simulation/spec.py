"""What one simulation is: the model geometry, the device pool and the workload.

:class:`SimulationSpec` is what ``vllm-hisparse simulate`` parses its flags into (both runs,
with and without the connector, share it); :func:`make_workload` turns it into the requests
(:class:`RequestPlan`: lengths and arrival steps) and :func:`token_ids` into each request's
tokens. All of it is deterministic per ``seed``. Nothing here imports vLLM, and torch only
to check a ``cuda`` device: ``vllm-hisparse simulate`` validates its arguments before the
heavy imports.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from vllm_hisparse.core.units import cdiv

ARRIVALS = ("burst", "poisson")
#: How the synthetic attention layers convert top-k, i.e. which vLLM backend they imitate:
#: ``group``: every batch through the index group (``SparseMLACommonImpl``, FlashInfer
#: sparse); ``direct``: decode-only batches through the group, batches with prefill tokens
#: through the backend's own ``triton_convert_req_index_to_global_index`` call on the batch
#: block table (FlashAttention sparse; FlashMLA sparse's mixed-batch paths do the same).
ATTENTION_PATHS = ("direct", "group")
#: Decode top-k drift per request, ``(drift_tokens, random_fraction)`` of its
#: ``TopkGenerator``, request ``serial`` taking profile ``serial % len``: ``uniform``, every
#: request alike; ``mixed``, from a stable focus to one that wanders and scatters (the case
#: per-request hot sizes are for: one fixed size must serve the request that drifts most).
TOPK_DRIFTS = {"uniform": ((4.0, 0.05),),
               "mixed": ((1.0, 0.02), (2.0, 0.03), (4.0, 0.05), (12.0, 0.10))}
#: Decode top-k from a synthetic indexer's scores through vLLM's ``SparseIndexerTopk``
#: (``scored_indexer.py``) instead of a ``TopkGenerator``.
SCORED_DRIFT = "scored"
TOPK_DRIFT_CHOICES = (*TOPK_DRIFTS, SCORED_DRIFT)
#: Token every synthetic forward samples (requests end on max_tokens, never on EOS).
SAMPLED_TOKEN = 7


@dataclass(frozen=True)
class SimulationSpec:
    """Model geometry, device pool and workload of one simulation (both runs share it)."""

    num_layers: int = 4
    layers_per_indexer: int = 2  # IndexShare: a leader and (n - 1) layers reusing its top-k
    mla_row_bytes: int = 656  # sparse-MLA rows: 656 (fp8_ds_mla) or 1152 (bf16)
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
    tensor_parallel_size: int = 1  # ranks; each with its worker role and device (ranks.py)
    ops_backend: str = "auto"
    attention: str = "direct"  # see ATTENTION_PATHS
    check: bool = True  # False: no ground truth (timing runs); rows are read, not compared
    # Per-request miss rates (the worst one is reported): counters on the first index group's
    # resolves, a dozen small kernels per step that the connector runs only with
    # adaptive_hot_region. Timing runs turn them off.
    count_request_misses: bool = True
    connector_extra: dict | None = None  # further extra-config keys of the connector
    topk_drift: str = "uniform"  # see TOPK_DRIFT_CHOICES
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
        need(self.mla_row_bytes in (656, 1152), "mla-row-bytes", "656 (fp8_ds_mla) or 1152 "
             "(bf16)", self.mla_row_bytes)
        need(self.top_k % self.block_size == 0 or self.top_k < self.block_size, "top-k",
             "a multiple of --block-size (or smaller than it)", self.top_k)
        need(self.top_k <= 2048, "top-k", "at most 2048", self.top_k)
        need(0.0 <= self.length_jitter < 1.0, "length-jitter", "a fraction in [0, 1)",
             self.length_jitter)
        need(isinstance(self.shared_prefix_len, int) and 0 <= self.shared_prefix_len,
             "shared-prefix-len", "an integer >= 0 (at most the prompt length is shared)",
             self.shared_prefix_len)
        need(self.arrival in ARRIVALS, "arrival", " | ".join(ARRIVALS), self.arrival)
        need(self.topk_drift in TOPK_DRIFT_CHOICES, "topk-drift",
             " | ".join(TOPK_DRIFT_CHOICES), self.topk_drift)
        need(self.attention in ATTENTION_PATHS, "attention", " | ".join(ATTENTION_PATHS),
             self.attention)
        need(self.arrival_rate > 0 and math.isfinite(self.arrival_rate), "arrival-rate",
             "a finite number > 0 (requests per step)", self.arrival_rate)
        need(self.host_pool_gib is None or (self.host_pool_gib > 0
                                            and math.isfinite(self.host_pool_gib)),
             "host-pool-gib", "a finite number > 0", self.host_pool_gib)
        need(self.device in ("cpu", "cuda") or self.device.startswith("cuda:"), "device",
             "cpu | cuda | cuda:N", self.device)
        need(isinstance(self.tensor_parallel_size, int) and 1 <= self.tensor_parallel_size <= 8,
             "tensor-parallel-size", "an integer in [1, 8]", self.tensor_parallel_size)
        need(self.tensor_parallel_size == 1 or self.device in ("cpu", "cuda"), "device",
             "cpu or cuda with --tensor-parallel-size > 1 (rank r runs on cuda:r)", self.device)
        need(self.ops_backend in ("auto", "cuda", "reference"), "ops-backend",
             "auto | cuda | reference", self.ops_backend)
        need(self.max_num_seqs <= 1024, "max-num-seqs", "at most 1024", self.max_num_seqs)
        need(self.num_requests < 65536, "requests", "fewer than 65536", self.num_requests)
        need(self.max_model_len <= 1 << 20, "prompt-len",
             "prompt + output lengths up to 1M tokens", self.prompt_len)
        if self.device == "cpu" and self.ops_backend == "cuda":
            raise ValueError("--ops-backend=cuda is invalid with --device=cpu; accepted: auto "
                             "or reference")
        eviction = (self.connector_extra or {}).get("hot_region_eviction", "lru")
        if eviction == "score" and self.topk_drift != SCORED_DRIFT:
            raise ValueError(f"--hot-region-eviction=score is invalid with --topk-drift="
                             f"{self.topk_drift}: score-aware eviction needs the indexer's "
                             f"scores, which only --topk-drift {SCORED_DRIFT} computes; accepted: "
                             f"--topk-drift {SCORED_DRIFT}, or --hot-region-eviction lru")
        if not self.device.startswith("cuda"):
            return
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"--device={self.device} is invalid: no CUDA device is visible; "
                             "accepted: cpu")
        if self.device == "cuda" and torch.cuda.device_count() < self.tensor_parallel_size:
            raise ValueError(f"--tensor-parallel-size={self.tensor_parallel_size} is invalid "
                             f"with --device=cuda: {torch.cuda.device_count()} CUDA device(s) "
                             "visible, rank r runs on cuda:r; accepted: at most that many, or "
                             "--device=cpu")


    @property
    def rank_devices(self) -> list[str]:
        """The device of each tensor-parallel rank: ``cpu`` for all, or ``cuda:r``."""
        if self.tensor_parallel_size == 1:
            return [self.device]
        return ["cpu" if self.device == "cpu" else f"cuda:{r}"
                for r in range(self.tensor_parallel_size)]

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
        return cdiv(self.max_prompt_len + self.max_output_len, self.block_size) * self.block_size


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


def shared_prefix_len(spec: SimulationSpec, plan: RequestPlan) -> int:
    """Leading prompt positions whose tokens every request shares."""
    return min(spec.shared_prefix_len, plan.prompt_len)


def prompt_token_ids(spec: SimulationSpec, plan: RequestPlan) -> list[int]:
    """The request's prompt: seeded random tokens per request, the first
    :func:`shared_prefix_len` of them common to every request."""
    rng = random.Random(plan.serial * 7_919 + spec.seed)
    tokens = [rng.randrange(10, 1000) for _ in range(plan.prompt_len)]
    shared = shared_prefix_len(spec, plan)
    if shared:
        common = random.Random(spec.seed * 31 + 17)
        tokens[:shared] = [common.randrange(10, 1000) for _ in range(shared)]
    return tokens


def token_ids(spec: SimulationSpec, plan: RequestPlan) -> list[int]:
    """Every token the request will hold: its prompt, then ``output_len`` sampled tokens
    (the synthetic forward always samples :data:`SAMPLED_TOKEN`)."""
    return prompt_token_ids(spec, plan) + [SAMPLED_TOKEN] * plan.output_len
