"""The DSA indexer's logits over every cached key of every request, fused (the indexer
stand-in of ``bench throughput``: DeepGEMM's ``fp8_mqa_logits`` is not on the GPU machine).

For token ``b`` and cached position ``t``::

    logit[b, t] = key_scale[b, t] · Σ_h weight[b, h] · relu(q[b, h] · key[b, t])

with fp8 e4m3 queries ``[index_heads, head_dim]`` and keys ``[head_dim]``, an fp32 scale per
key and an fp32 weight per head: the indexer's score in DeepSeek-V3.2 and GLM-5.x. One Triton
kernel reads each key and its scale once (``head_dim + 4`` bytes: the 132 B rows of the
indexer KV cache) and runs the heads as one fp8 matrix product per tile of keys, so it is
bound by those bytes as DeepGEMM's kernel is (``2 · index_heads · head_dim`` FLOPs per 132 B
is under the fp8 ridge of an H100 or H200).
"""

from __future__ import annotations

import functools

import torch

from vllm_hisparse.cli.benchmarks.launch_configs import LaunchChooser

CONFIGS = [dict(BLOCK_T=bt, num_warps=w, num_stages=s)
           for bt, w, s in ((128, 4, 3), (128, 8, 3), (256, 8, 3), (64, 4, 4), (256, 4, 2))]


def indexer_logits_reference(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                             key_scales: torch.Tensor) -> torch.Tensor:
    """Twin of :class:`IndexerLogits` in torch: float32 ``[B, context]``.

    q: uint8 ``[B, heads, head_dim]`` (fp8 e4m3 bytes); weights: float32 ``[B, heads]``;
    keys: uint8 ``[B, context, head_dim]`` (fp8 e4m3 bytes); key_scales: float32
    ``[B, context]``."""
    qf = q.view(torch.float8_e4m3fn).float()
    kf = keys.view(torch.float8_e4m3fn).float()
    dots = torch.einsum("btd,bhd->bth", kf, qf).clamp_min(0.0)
    return torch.einsum("bth,bh->bt", dots, weights) * key_scales


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def indexer_logits_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, out_ptr, context,
                              HEADS: tl.constexpr, DIM: tl.constexpr, DOT: tl.constexpr,
                              BLOCK_T: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        inside = t < context
        d = tl.arange(0, DIM)
        h = tl.arange(0, HEADS)
        # q as [DIM, HEADS] (dim contiguous in memory: the B operand K-major, as fp8 wants)
        q = tl.load(q_ptr + b * HEADS * DIM + h[None, :] * DIM + d[:, None])
        key_at = b * context + t
        k = tl.load(k_ptr + key_at[:, None] * DIM + d[None, :], mask=inside[:, None], other=0)
        dots = tl.dot(k.to(tl.float8e4nv, bitcast=True).to(DOT),
                      q.to(tl.float8e4nv, bitcast=True).to(DOT))  # [BLOCK_T, HEADS] fp32
        w = tl.load(w_ptr + b * HEADS + h)
        logit = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
        scale = tl.load(ks_ptr + key_at, mask=inside, other=0.0)
        tl.store(out_ptr + key_at, logit * scale, mask=inside)

    return indexer_logits_kernel


class IndexerLogits:
    """Fused indexer logits (module docstring) for one head count and head dim.

    ``__call__(q, weights, keys, key_scales, out)`` with the shapes of
    :func:`indexer_logits_reference` (all contiguous) and ``out`` float32 ``[B, context]``,
    written. Capturable in a CUDA graph once it ran eagerly (launch config chosen)."""

    def __init__(self, heads: int, head_dim: int):
        if heads % 16 or head_dim % 16:
            raise ValueError(f"IndexerLogits: heads {heads} and head_dim {head_dim} must be "
                             "multiples of 16")
        self.heads, self.head_dim = heads, head_dim
        self._kernel = _kernel()
        self._chooser = LaunchChooser("indexer logits")

    def launches(self) -> dict[str, dict]:
        """The launch chosen so far per ``heads x head_dim``."""
        return {"x".join(map(str, key)): config for key, config in self._chooser.chosen.items()}

    def __call__(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 key_scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        B, T = out.shape
        H, D = self.heads, self.head_dim
        expected = dict(q=((B, H, D), torch.uint8), weights=((B, H), torch.float32),
                        keys=((B, T, D), torch.uint8), key_scales=((B, T), torch.float32),
                        out=((B, T), torch.float32))
        given = dict(q=q, weights=weights, keys=keys, key_scales=key_scales, out=out)
        for name, (shape, dtype) in expected.items():
            t = given[name]
            if tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous():
                raise ValueError(f"{name}: expected contiguous {dtype} {list(shape)}, got "
                                 f"{t.dtype} {list(t.shape)}")
        if B == 0 or T == 0:
            return out
        import triton.language as tl
        # fp8 products on the GPU; Triton's interpreter (tests) multiplies in float32
        dot = tl.float8e4nv if q.device.type == "cuda" else tl.float32

        def launch(config: dict) -> None:
            grid = (B, -(-T // config["BLOCK_T"]))
            self._kernel[grid](q, weights, keys, key_scales, out, T, HEADS=H, DIM=D, DOT=dot,
                               **config)

        self._chooser.run((H, D), lambda: CONFIGS, launch, q.device)
        return out
