"""One DSA decoder layer's GPU work on one rank of an 8-GPU expert-parallel deployment, as
stand-ins with the real model's bytes and FLOPs: what ``bench throughput`` runs around each
sparse layer's top-k conversion.

A rank of DeepSeek-V3.2 or GLM-5.x served with data-parallel attention and expert parallelism
over 8 GPUs (the deployment of the HiSparse paper and of vLLM's DeepSeek recipes) runs, per
decode step and layer, for its own batch of ``B`` requests:

========================  ======================================================================
stand-in                  what it does here, and why it is faithful
========================  ======================================================================
indexer logits            every cached indexer key of every request (``B × context`` fp8 keys
                          of ``index_head_dim`` bytes and an fp32 scale each: the 132 B rows;
                          two such sets, cycled over the leaders, since vLLM's plan packs
                          indexer pages into blocks shared with other layers) scored against
                          the token's fp8 queries of ``index_heads`` heads, ReLU, weighted sum
                          over the heads (:mod:`.indexer_logits`, fused in Triton: bound by
                          the key bytes, as DeepGEMM's ``fp8_mqa_logits`` is).
indexer top-k             ``torch.topk`` of ``K`` over each request's ``context`` logits (vLLM
                          runs its own top-k kernel; this one is slower, so the stand-in
                          overstates the step the IO hides under).
before attention          what the compute stream runs between the indexer and the attention's
                          top-k conversion (``mla.py:235`` → ``forward_mqa``): the layer's new
                          KV rows written (a copy of ``B`` rows) and the absorbed query
                          projection (``W_UK``, one of the weight GEMMs below). vLLM's
                          conversion, and ours, run beside it on the index group's side stream.
sparse MLA                two stand-ins (``attention``). ``matmul`` (default): the ``K`` rows
                          each token's conversion returned gathered from the layer's KV cache
                          (``index_select``), then ``[B·heads, 576] @ [576, K]``, softmax,
                          ``[B·heads, K] @ [K, 512]`` in bf16 (cuBLAS; sparse MLA decode's
                          FLOPs, the score matrix through HBM). ``fused``: the absorbed MLA
                          decode of every head over the rows, each read once from the KV
                          cache in its own layout (fp8 rows with scales, or bf16), online
                          softmax, the scores on chip (:mod:`.mla_decode`, Triton: FlashMLA's
                          FLOPs and bytes). FlashMLA itself is not on the GPU machine; on the
                          H100 at 90 requests × 2048 rows (DeepSeek-V3.2) ``matmul`` takes
                          about 2.1× and ``fused`` 3.1× the time FlashMLA's published 410
                          TFLOPS would give, so ``matmul``, the closer in time, is the default.
weights                   every projection as a bf16 GEMM ``[B, in] @ [in, out]`` whose weight
                          bytes equal the model's fp8 weights (``out`` halved): q/kv down
                          projections, q up projection with the indexer's, the absorbed kv up
                          projection (bf16 in vLLM, which dequantizes it for the absorbed
                          BMMs, so not halved; its ``W_UK`` half before the attention, its
                          ``W_UV`` half after), o_proj, the shared expert, the router, and this rank's
                          routed experts as two batched GEMMs ``[E, T, in] @ [E, in, out]``
                          with ``T`` the most tokens any local expert got from a uniform top-k
                          router over the tokens of all ``ep_ranks`` (memory-bound: a batched
                          GEMM reads each expert's weights once whatever ``T``).
EP dispatch + combine     a wait of ``ep_comm_us`` on one SM (the extension's global-timer
                          spin, in two halves around the experts); 0 drops it. Default
                          191 µs: DeepEP's low-latency kernels on 8 GPUs, dispatch 77 µs +
                          combine 114 µs at 128 tokens per rank, hidden 7168, top-8
                          (DeepEP README's table).
========================  ======================================================================

Left out: embeddings, norms, rotary embeddings, the LM head and sampling (per step, not per
layer), DeepSeek-V3.2's three dense layers (modelled as MoE layers). Weights are random and
shared by every ``weight_sets``-th layer (each set is many times the L2, so every layer's read
still comes from HBM). Every tensor is allocated once at the largest batch, so a layer is
capturable in a CUDA graph at any batch up to it (the fused kernels choose their launch at a
batch's first, eager, step). Without CUDA (smoke runs) the fused stand-ins run as their torch
twins.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from vllm_hisparse.cli.benchmarks.indexer_logits import IndexerLogits, indexer_logits_reference
from vllm_hisparse.cli.benchmarks.mla_decode import (MlaRowLayout, SparseMlaDecode,
                                                     sparse_mla_decode_reference)

#: Public per-layer sizes of the geometries ``bench throughput`` runs (config.json of each).
GEOMETRIES: dict[str, dict] = {
    # DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2-Exp config): 61 layers, an indexer in each.
    "dsv32": dict(name="DeepSeek-V3.2", num_layers=61, layers_per_indexer=1, hidden=7168,
                  heads=128, q_lora_rank=1536, kv_lora_rank=512, rope_dim=64,
                  qk_nope_dim=128, v_head_dim=128, experts=256, experts_per_token=8,
                  moe_intermediate=2048, index_heads=64, index_head_dim=128,
                  mla_row_bytes=656, index_row_bytes=132, kv_gib=40.0),
    # GLM-5.1 (GlmMoeDsa): 78 layers, an indexer in each, bf16 MLA rows (576 × 2 B).
    "glm51": dict(name="GLM-5.1", num_layers=78, layers_per_indexer=1, hidden=6144, heads=64,
                  q_lora_rank=2048, kv_lora_rank=512, rope_dim=64, qk_nope_dim=192,
                  v_head_dim=256, experts=256, experts_per_token=8, moe_intermediate=2048,
                  index_heads=32, index_head_dim=128, mla_row_bytes=1152,
                  index_row_bytes=132, kv_gib=32.0),
    # GLM-5.2 IndexShare: GLM-5.1's layers, one indexer per group of 4 (its followers reuse
    # the leader's top-k).
    "glm52": dict(name="GLM-5.2 IndexShare", num_layers=78, layers_per_indexer=4, hidden=6144,
                  heads=64, q_lora_rank=2048, kv_lora_rank=512, rope_dim=64, qk_nope_dim=192,
                  v_head_dim=256, experts=256, experts_per_token=8, moe_intermediate=2048,
                  index_heads=32, index_head_dim=128, mla_row_bytes=1152,
                  index_row_bytes=132, kv_gib=32.0),
}

#: The sparse MLA stand-ins (``--attention-stand-in``; module docstring).
ATTENTION_STAND_INS = ("matmul", "fused")

#: DeepEP low-latency dispatch + combine on 8 GPUs (README table: 77 + 114 µs).
DEFAULT_EP_COMM_US = 191.0

#: The GEMM that runs between the indexer and the attention (the absorbed query projection).
PRE_ATTENTION_GEMM = "kv_b q absorb (W_UK)"


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One geometry's per-layer sizes (:data:`GEOMETRIES`) and the deployment around it."""

    name: str
    num_layers: int
    layers_per_indexer: int
    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    rope_dim: int
    qk_nope_dim: int
    v_head_dim: int
    experts: int
    experts_per_token: int
    moe_intermediate: int
    index_heads: int
    index_head_dim: int
    mla_row_bytes: int
    index_row_bytes: int
    kv_gib: float  # KV cache per GPU left by the weights (H200, fp8 weights, EP 8)
    ep_ranks: int = 8
    ep_comm_us: float = DEFAULT_EP_COMM_US

    @classmethod
    def named(cls, key: str, **overrides) -> "LayerShape":
        if key not in GEOMETRIES:
            raise ValueError(f"geometry {key!r}: expected one of {', '.join(GEOMETRIES)}")
        return cls(**{**GEOMETRIES[key], **overrides})

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep_ranks

    def gemms(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of every dense projection as a bf16 GEMM with the bytes vLLM reads
        (fp8 weights at half width; kv_b and the router at full width, bf16 as served)."""
        h, H = self.hidden, self.heads
        half = lambda n: max(1, n // 2)  # noqa: E731 - fp8 bytes in bf16
        return [
            ("q_a + kv_a + indexer k, weights", h,
             half(self.q_lora_rank + self.kv_lora_rank + self.rope_dim + self.index_head_dim
                  + self.index_heads)),
            ("q_b + indexer q_b", self.q_lora_rank,
             half(H * (self.qk_nope_dim + self.rope_dim)
                  + self.index_heads * self.index_head_dim)),
            # vLLM dequantizes kv_b to the model's dtype for the absorbed BMMs
            # (mla_attention.split_kv_b_proj): bf16 bytes, not halved
            (PRE_ATTENTION_GEMM, self.kv_lora_rank, H * self.qk_nope_dim),
            ("kv_b v up (W_UV)", self.kv_lora_rank, H * self.v_head_dim),
            ("o_proj", H * self.v_head_dim, half(h)),
            ("shared expert gate_up", h, self.moe_intermediate),  # 2 × inter, halved
            ("shared expert down", self.moe_intermediate, half(h)),
            ("router", h, self.experts),  # bf16 in the model
        ]

    def weight_bytes(self) -> int:
        """Bytes of one layer's weights on this rank (what the stand-in reads per layer)."""
        dense = sum(i * o * 2 for _, i, o in self.gemms())
        expert = (self.hidden * self.moe_intermediate + self.moe_intermediate
                  * (self.hidden // 2)) * 2
        return dense + self.local_experts * expert

    def describe(self) -> str:
        return (f"{self.name}: {self.num_layers} layers, "
                f"{'an indexer per layer' if self.layers_per_indexer == 1 else f'one indexer per {self.layers_per_indexer} layers'}"
                f", MLA rows {self.mla_row_bytes} B, indexer rows {self.index_row_bytes} B, "
                f"{self.heads} heads, {self.local_experts} of {self.experts} experts on this "
                f"rank (EP {self.ep_ranks}), {self.weight_bytes() / 1e9:.2f} GB of weights per "
                f"layer, EP dispatch + combine {self.ep_comm_us:.0f} µs per layer")


def tokens_per_expert(shape: LayerShape, batch: int, seed: int = 0) -> int:
    """The most tokens one of this rank's experts receives when every rank holds ``batch``
    tokens and a uniform router picks ``experts_per_token`` distinct experts per token."""
    if batch <= 0:
        return 0
    g = torch.Generator().manual_seed(seed)
    tokens = batch * shape.ep_ranks
    picks = torch.rand((tokens, shape.experts), generator=g).argsort(dim=1)
    picks = picks[:, :shape.experts_per_token]
    counts = torch.bincount(picks.flatten(), minlength=shape.experts)[:shape.local_experts]
    return max(1, int(counts.max()))


class Spin:
    """A wait of a number of µs on the GPU: the extension's global-timer spin
    (:func:`vllm_hisparse.ops.probe.spin`), or ``torch.cuda._sleep`` calibrated once where the
    extension is not built (a cycle count, which stretches when the SM clock drops)."""

    def __init__(self, device: torch.device):
        from vllm_hisparse.ops import probe

        self.kind = "none"
        self._probe = probe
        self.cycles_per_us = 0.0
        if device.type != "cuda":
            return
        if probe.available():
            self.kind = "global timer"
            return
        self.kind = "cycles (torch.cuda._sleep)"
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        self.cycles_per_us = cycles / (start.elapsed_time(end) * 1e3)

    def __call__(self, us: float) -> None:
        if us <= 0 or self.kind == "none":
            return
        if self.kind == "global timer":
            self._probe.spin(us)
        else:
            torch.cuda._sleep(int(us * self.cycles_per_us))


class ModelLayerWork:
    """The stand-in GPU work of every layer (module docstring), for batches up to
    ``max_batch`` of ``context``-token requests.

    ``indexer(layer, batch)`` before an index group's leader converts; ``before_attention(
    layer, batch)`` before each layer converts; ``attention(layer, rows, batch)`` with the
    rows the conversion returned (int32 ``[batch, K]``, valid first; ``-1`` padding);
    ``mlp(layer, batch)`` after. ``kv_rows``: each sparse layer's flat row
    view of its KV cache (uint8 ``[rows, mla_row_bytes]``), in layer order.

    Each takes ``first`` (default 0): it then runs over tokens ``first`` to ``batch - 1``
    only, one micro-batch of :func:`split_batch` (the two-micro-batch ceiling runs a layer
    once per half: the weights read twice, each half's experts at its own token count).
    """

    def __init__(self, shape: LayerShape, *, max_batch: int, context: int, top_k: int,
                 kv_rows: list[torch.Tensor], device: torch.device, weight_sets: int = 2,
                 seed: int = 0,
                 components: frozenset[str] = frozenset({"indexer", "attention", "weights",
                                                         "comm"}),
                 attention: str = "matmul"):
        if attention not in ATTENTION_STAND_INS:
            raise ValueError(f"attention stand-in {attention!r}: expected one of "
                             f"{', '.join(ATTENTION_STAND_INS)}")
        self.attention_stand_in = attention
        self.shape, self.context, self.top_k, self.device = shape, context, top_k, device
        self.max_batch = max_batch
        self.components = components
        self.kv_rows = kv_rows
        bf16 = dict(dtype=torch.bfloat16, device=device)
        g = torch.Generator(device=device).manual_seed(seed)

        def rand(*size):
            return torch.empty(size, **bf16).uniform_(-0.05, 0.05, generator=g)

        # indexer: every request's context keys (fp8 + an fp32 scale each), two sets cycled
        # over the leaders; fp8 bytes drawn with exponents below 0b0111 (|x| < 1, no NaN)
        def fp8_bytes(*size):
            return torch.randint(0, 256, size, dtype=torch.uint8, device=device,
                                 generator=g).bitwise_and_(0xB7)

        H_i, D_i = shape.index_heads, shape.index_head_dim
        self.index_keys = [fp8_bytes(max_batch, context, D_i) for _ in range(2)]
        self.index_key_scales = [torch.rand((max_batch, context), device=device, generator=g)
                                 for _ in range(2)]
        self.index_q = fp8_bytes(max_batch, H_i, D_i)
        self.index_weights = torch.rand((max_batch, H_i), device=device, generator=g)
        self.logits = torch.empty((max_batch, context), dtype=torch.float32, device=device)
        self.topk_values = torch.empty((max_batch, top_k), dtype=torch.float32, device=device)
        self.topk_indices = torch.empty((max_batch, top_k), dtype=torch.int64, device=device)
        # before attention: the new KV rows (written to a buffer of their own: the cache's
        # rows are the attention's reads)
        self.new_kv = torch.zeros((2, max_batch, shape.mla_row_bytes), dtype=torch.uint8,
                                  device=device)
        # attention: the absorbed query of every head, the output's latent values
        self.mla_layout = MlaRowLayout.fitting(shape.kv_lora_rank, shape.rope_dim,
                                               shape.mla_row_bytes)
        self.sm_scale = (shape.qk_nope_dim + shape.rope_dim) ** -0.5
        self.attn_q = rand(max_batch, shape.heads, shape.kv_lora_rank + shape.rope_dim)
        self.attn_out = torch.empty((max_batch, shape.heads, shape.kv_lora_rank), **bf16)
        # the fused kernels on the GPU (Triton), their torch twins elsewhere (smoke runs)
        on_gpu = device.type == "cuda"
        self._logits = IndexerLogits(H_i, D_i) if on_gpu else None
        self._mla = (SparseMlaDecode(self.mla_layout, shape.heads, self.sm_scale)
                     if on_gpu and attention == "fused" else None)
        if attention == "matmul":  # the gathered rows, one row set's values for the products
            self.reads = torch.empty((max_batch * top_k, shape.mla_row_bytes),
                                     dtype=torch.uint8, device=device)
            self.attn_kv = rand(top_k, shape.kv_lora_rank + shape.rope_dim)
            self.attn_scores = torch.empty((max_batch * shape.heads, top_k), **bf16)
        # weights: dense GEMMs and the routed experts, weight_sets distinct sets
        self.gemm_shapes = shape.gemms()
        self._pre_gemm = [n for n, _, _ in self.gemm_shapes].index(PRE_ATTENTION_GEMM)
        width = max(max(i, o) for _, i, o in self.gemm_shapes)
        self.act_in = rand(max_batch, width)
        self.act_out = torch.empty((max_batch, width), **bf16)
        self.sets = []
        for _ in range(weight_sets):
            dense = [rand(i, o) for _, i, o in self.gemm_shapes]
            up = rand(shape.local_experts, shape.hidden, shape.moe_intermediate)
            down = rand(shape.local_experts, shape.moe_intermediate, shape.hidden // 2)
            self.sets.append((dense, up, down))
        self.max_expert_tokens = tokens_per_expert(shape, max_batch, seed)
        self.expert_in = rand(shape.local_experts, self.max_expert_tokens, shape.hidden)
        self.expert_mid = torch.empty((shape.local_experts, self.max_expert_tokens,
                                       shape.moe_intermediate), **bf16)
        self.expert_out = torch.empty((shape.local_experts, self.max_expert_tokens,
                                       shape.hidden // 2), **bf16)
        self._expert_tokens: dict[int, int] = {}
        self.spin = Spin(device)

    # ------------------------------------------------------------------ per layer

    def indexer(self, leader: int, batch: int, first: int = 0) -> None:
        """Leader ``leader``'s (its index among the leaders) logits and top-k."""
        if "indexer" not in self.components or batch <= first:
            return
        t = slice(first, batch)
        j = leader % len(self.index_keys)
        args = (self.index_q[t], self.index_weights[t], self.index_keys[j][t],
                self.index_key_scales[j][t])
        if self._logits is not None:
            self._logits(*args, out=self.logits[t])
        else:
            self.logits[t] = indexer_logits_reference(*args)
        torch.topk(self.logits[t], self.top_k, dim=1,
                   out=(self.topk_values[t], self.topk_indices[t]))

    def before_attention(self, layer: int, batch: int, first: int = 0) -> None:
        """The layer's KV write and absorbed query projection (between its indexer and its
        conversion)."""
        if batch <= first:
            return
        if "attention" in self.components:
            self.new_kv[1, first:batch].copy_(self.new_kv[0, first:batch])
        if "weights" in self.components:
            dense = self.sets[layer % len(self.sets)][0]
            _, i, o = self.gemm_shapes[self._pre_gemm]
            torch.matmul(self.act_in[first:batch, :i], dense[self._pre_gemm],
                         out=self.act_out[first:batch, :o])

    def attention(self, layer: int, rows: torch.Tensor, batch: int, first: int = 0) -> None:
        """Sparse MLA over the ``K`` rows of each of the tokens."""
        if "attention" not in self.components or batch <= first:
            return
        if self.attention_stand_in == "matmul":
            self._attention_matmul(layer, rows, batch, first)
        else:
            self._attention_fused(layer, rows, batch, first)

    def _attention_matmul(self, layer: int, rows: torch.Tensor, batch: int, first: int) -> None:
        """The rows gathered (``index_select``), then cuBLAS products and a softmax."""
        flat = rows[first:batch].reshape(-1).clamp_min(0).to(torch.int64)
        torch.index_select(self.kv_rows[layer], 0, flat, out=self.reads[:flat.numel()])
        h = slice(first * self.shape.heads, batch * self.shape.heads)
        q = self.attn_q.view(-1, self.attn_q.shape[-1])
        torch.matmul(q[h], self.attn_kv.t(), out=self.attn_scores[h])
        probs = torch.softmax(self.attn_scores[h], dim=1)
        torch.matmul(probs, self.attn_kv[:, :self.shape.kv_lora_rank],
                     out=self.attn_out.view(-1, self.attn_out.shape[-1])[h])

    def _attention_fused(self, layer: int, rows: torch.Tensor, batch: int, first: int) -> None:
        """One fused kernel over the rows in their layout (its torch twin off the GPU)."""
        rows = rows[first:batch]
        if rows.dtype != torch.int32 or not rows.is_contiguous():
            rows = rows.to(torch.int32).contiguous()
        q, out = self.attn_q[first:batch], self.attn_out[first:batch]
        if self._mla is not None:
            self._mla(q, self.kv_rows[layer], rows, out)
        else:
            out.copy_(sparse_mla_decode_reference(q, self.kv_rows[layer], rows,
                                                  self.mla_layout, self.sm_scale))

    def mlp(self, layer: int, batch: int, first: int = 0) -> None:
        """The other projections' GEMMs, EP dispatch, the routed experts, EP combine."""
        if batch <= first:
            return
        if "weights" in self.components:
            dense, up, down = self.sets[layer % len(self.sets)]
            for j, ((_, i, o), w) in enumerate(zip(self.gemm_shapes, dense)):
                if j != self._pre_gemm:  # that one ran before the attention
                    torch.matmul(self.act_in[first:batch, :i], w,
                                 out=self.act_out[first:batch, :o])
        if "comm" in self.components:
            self.spin(self.shape.ep_comm_us / 2)  # dispatch
        if "weights" in self.components:
            t = self.expert_tokens(batch - first)
            torch.bmm(self.expert_in[:, :t], up, out=self.expert_mid[:, :t])
            torch.bmm(self.expert_mid[:, :t], down, out=self.expert_out[:, :t])
        if "comm" in self.components:
            self.spin(self.shape.ep_comm_us / 2)  # combine

    def launches(self) -> dict[str, dict[str, dict]]:
        """The launch each fused stand-in chose, per batch size (MLA) or shape (indexer)."""
        return {name: kernel.launches()
                for name, kernel in (("sparse MLA", self._mla), ("indexer logits", self._logits))
                if kernel is not None}

    def expert_tokens(self, batch: int) -> int:
        if batch not in self._expert_tokens:
            self._expert_tokens[batch] = min(self.max_expert_tokens,
                                             tokens_per_expert(self.shape, batch))
        return self._expert_tokens[batch]


def split_batch(batch: int, parts: int = 2) -> list[tuple[int, int]]:
    """The micro-batches of a batch as ``(first, stop)`` token ranges: consecutive, sizes
    within one of each other (the first ones larger), every token in exactly one; empty
    ones dropped (a batch of 1 is one micro-batch: nothing to overlap it with)."""
    if parts < 1:
        raise ValueError(f"parts={parts}: expected at least 1")
    size, extra = divmod(max(0, batch), parts)
    spans, first = [], 0
    for j in range(parts):
        stop = first + size + (j < extra)
        if stop > first:
            spans.append((first, stop))
        first = stop
    return spans


def layer_flops_and_bytes(shape: LayerShape, batch: int, context: int, top_k: int) -> dict:
    """The real layer's work at ``batch`` requests (for the realism table): indexer bytes,
    attention FLOPs and bytes, weight bytes."""
    qk, v = shape.kv_lora_rank + shape.rope_dim, shape.kv_lora_rank
    return dict(
        indexer_bytes=batch * context * shape.index_row_bytes,
        indexer_flops=2 * batch * context * shape.index_heads * shape.index_head_dim,
        attention_flops=2 * batch * shape.heads * top_k * (qk + v),
        attention_bytes=batch * top_k * shape.mla_row_bytes,
        weight_bytes=shape.weight_bytes())


def round_down(n: int, multiple: int) -> int:
    return max(multiple, (n // multiple) * multiple) if n >= multiple else n


def log_points(top: int, low: int = 8) -> list[int]:
    """Concurrency points from ``top`` down to ``low``: ``top``, then the powers of two below
    it (97 -> 97, 64, 32, 16, 8)."""
    points = {top}
    p = 2 ** int(math.log2(max(1, top)))
    while p >= low:
        if p < top:
            points.add(p)
        p //= 2
    return sorted(points, reverse=True)
