"""Sparse MLA decode over each token's ``K`` selected KV rows, fused (the attention stand-in
of ``bench throughput``: FlashMLA's sparse decode is not on the GPU machine).

One Triton kernel reads each selected row once from the layer's KV cache (its bytes as the
cache stores them), dequantizes it in registers, and runs the absorbed MLA attention of every
head over the ``K`` rows with an online softmax: the scores stay on chip, as in FlashMLA. Its
FLOPs are sparse MLA decode's, ``2 · heads · K · (576 + 512)`` per token, and its HBM bytes
are ``K`` rows per token plus the query and the output.

Row layouts (:class:`MlaRowLayout`): DeepSeek-V3.2's fp8 rows (656 B: 512 fp8 e4m3 latent
values, one fp32 scale per 128 of them, 64 bf16 rope values) and GLM-5.x's bf16 rows (1152 B:
576 bf16 values). The latent part is both key and value (MLA's absorbed form).

When ``batch × head blocks`` would leave SMs idle, ``K`` is split over several programs per
head block (flash decoding) and a second kernel merges their partial outputs by their
log-sum-exp.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from vllm_hisparse.cli.benchmarks.launch_configs import LaunchChooser

#: Values per fp32 scale of an fp8 row.
FP8_GROUP = 128
#: Selected rows per split when ``K`` is split (fewer would leave a split mostly overhead).
MIN_ROWS_PER_SPLIT = 256
#: Split counts timed per batch size, up to the one that gives every SM ``MAX_WAVES``
#: programs.
SPLIT_OPTIONS = (1, 2, 3, 4, 6, 8)
MAX_WAVES = 4

#: Block sizes timed per batch size. At 8 warps every one of them spills on the H100 (255
#: registers a thread: the [heads, 512] fp32 accumulator); 16 warps halve that (they run in
#: the GPU test; which one the step chooses is in ``bench throughput``'s JSON).
CONFIGS = [dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=s)
           for bh, bn, w, s in ((64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 8, 1), (32, 64, 8, 2),
                                (32, 32, 4, 2), (16, 32, 4, 2), (64, 64, 16, 2), (64, 32, 16, 2))]


@dataclasses.dataclass(frozen=True)
class MlaRowLayout:
    """One KV row: ``nope_dim`` latent values (key and value) and ``rope_dim`` rope values,
    fp8 with fp32 scales (``fp8``) or all bf16; ``row_bytes`` the cache's row pitch."""

    nope_dim: int
    rope_dim: int
    fp8: bool
    row_bytes: int

    @classmethod
    def fitting(cls, nope_dim: int, rope_dim: int, row_bytes: int) -> "MlaRowLayout":
        """bf16 where the row holds ``2 · (nope + rope)`` bytes (GLM-5.x), else fp8
        (DeepSeek-V3.2); a row larger than its layout keeps its tail unread."""
        if 2 * (nope_dim + rope_dim) <= row_bytes:
            return cls(nope_dim, rope_dim, False, row_bytes)
        fp8_bytes = nope_dim + 4 * -(-nope_dim // FP8_GROUP) + 2 * rope_dim
        if fp8_bytes <= row_bytes:
            return cls(nope_dim, rope_dim, True, row_bytes)
        raise ValueError(f"MLA rows of {row_bytes} B cannot hold {nope_dim} latent + "
                         f"{rope_dim} rope values (fp8 with scales needs {fp8_bytes} B)")

    def __post_init__(self):
        if self.fp8 and (self.nope_dim % FP8_GROUP or self.row_bytes % 4):
            raise ValueError(f"fp8 MLA rows: nope_dim {self.nope_dim} must be a multiple of "
                             f"{FP8_GROUP} and row_bytes {self.row_bytes} of 4 (fp32 scales)")
        if self.row_bytes % 2:
            raise ValueError(f"MLA rows: row_bytes {self.row_bytes} is odd (bf16 values)")

    @property
    def scale_groups(self) -> int:
        return self.nope_dim // FP8_GROUP if self.fp8 else 0

    @property
    def rope_offset_bytes(self) -> int:
        return self.nope_dim + 4 * self.scale_groups if self.fp8 else 2 * self.nope_dim

    @property
    def used_bytes(self) -> int:
        return self.rope_offset_bytes + 2 * self.rope_dim

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 ``[..., row_bytes]`` → float32 ``[..., nope + rope]``, each value rounded to
        bf16 as the kernel's matrix products take it."""
        if self.fp8:
            nope = rows[..., :self.nope_dim].contiguous().view(torch.float8_e4m3fn).float()
            scales = rows[..., self.nope_dim:self.rope_offset_bytes].contiguous()
            scales = scales.view(torch.float32).repeat_interleave(FP8_GROUP, dim=-1)
            nope = nope * scales
        else:
            nope = rows[..., :2 * self.nope_dim].contiguous().view(torch.bfloat16).float()
        rope = rows[..., self.rope_offset_bytes:self.used_bytes].contiguous()
        rope = rope.view(torch.bfloat16).float()
        return torch.cat([nope, rope], dim=-1).bfloat16().float()


def sparse_mla_decode_reference(q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor,
                                layout: MlaRowLayout, sm_scale: float) -> torch.Tensor:
    """Twin of :class:`SparseMlaDecode` in torch: float32 ``[B, heads, nope]``.

    q: bf16 ``[B, heads, nope + rope]``; kv_rows: uint8 ``[rows, row_bytes]``; indices: int32
    ``[B, K]``, each a row of ``kv_rows`` or ``-1`` (padding, not attended). A token with no
    valid row gets zeros."""
    valid = indices >= 0
    keys = layout.dequantize(kv_rows[indices.clamp_min(0).long()])  # [B, K, nope + rope]
    scores = torch.einsum("bhd,bkd->bhk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of -inf: zeros
    return torch.einsum("bhk,bkd->bhd", probs, keys[..., :layout.nope_dim])


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def sparse_mla_decode_kernel(
            q_ptr, kv_u8_ptr, kv_bf16_ptr, kv_f32_ptr, idx_ptr, out_ptr, part_ptr, lse_ptr,
            top_k, rows_per_split, sm_scale,
            HEADS: tl.constexpr, NOPE: tl.constexpr, ROPE: tl.constexpr,
            ROW_BYTES: tl.constexpr, ROPE_AT: tl.constexpr, GROUPS: tl.constexpr,
            FP8: tl.constexpr, SPLIT: tl.constexpr, DOT: tl.constexpr,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(2)
        dn = tl.arange(0, NOPE)
        dr = tl.arange(0, ROPE)
        token_head = b.to(tl.int64) * HEADS + heads
        q_at = q_ptr + token_head[:, None] * (NOPE + ROPE)
        q_nope = tl.load(q_at + dn[None, :]).to(DOT)
        q_rope = tl.load(q_at + NOPE + dr[None, :]).to(DOT)
        m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        denom = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, NOPE), tl.float32)
        start = split * rows_per_split
        stop = tl.minimum(start + rows_per_split, top_k)
        for n0 in range(start, stop, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            idx = tl.load(idx_ptr + b.to(tl.int64) * top_k + n, mask=n < stop, other=-1)
            valid = idx >= 0
            row = tl.where(valid, idx, 0).to(tl.int64)
            if FP8:
                raw = tl.load(kv_u8_ptr + row[:, None] * ROW_BYTES + dn[None, :],
                              mask=valid[:, None], other=0)
                scale = tl.load(kv_f32_ptr + row[:, None] * (ROW_BYTES // 4) + NOPE // 4
                                + tl.arange(0, GROUPS)[None, :], mask=valid[:, None], other=0.0)
                grouped = tl.reshape(raw.to(tl.float8e4nv, bitcast=True).to(tl.float32),
                                     (BLOCK_N, GROUPS, NOPE // GROUPS))
                k_nope = tl.reshape(grouped * scale[:, :, None], (BLOCK_N, NOPE)).to(DOT)
            else:
                k_nope = tl.load(kv_bf16_ptr + row[:, None] * (ROW_BYTES // 2) + dn[None, :],
                                 mask=valid[:, None], other=0.0).to(DOT)
            k_rope = tl.load(kv_bf16_ptr + row[:, None] * (ROW_BYTES // 2) + ROPE_AT // 2
                             + dr[None, :], mask=valid[:, None], other=0.0).to(DOT)
            score = tl.dot(q_nope, tl.trans(k_nope)) + tl.dot(q_rope, tl.trans(k_rope))
            score = tl.where(valid[None, :], score * sm_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(score, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid row yet
            alpha = tl.exp(m - base)
            p = tl.exp(score - base[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), k_nope)
            m = m_new
        has = denom > 0
        mean = acc / tl.where(has, denom, 1.0)[:, None]
        if SPLIT:
            slot = token_head * tl.num_programs(2) + split
            tl.store(part_ptr + slot[:, None] * NOPE + dn[None, :], mean)
            tl.store(lse_ptr + slot, tl.where(has, m + tl.log(denom), float("-inf")))
        else:
            tl.store(out_ptr + token_head[:, None] * NOPE + dn[None, :], mean.to(tl.bfloat16))

    @triton.jit
    def merge_splits_kernel(part_ptr, lse_ptr, out_ptr, splits, NOPE: tl.constexpr,
                            BLOCK_S: tl.constexpr):
        """One (token, head): its splits' partial outputs weighted by their log-sum-exp."""
        token_head = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        inside = s < splits
        lse = tl.load(lse_ptr + token_head * splits + s, mask=inside, other=float("-inf"))
        top = tl.max(lse, axis=0)
        weight = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # -inf: 0
        total = tl.sum(weight, axis=0)
        dn = tl.arange(0, NOPE)
        part = tl.load(part_ptr + (token_head * splits + s)[:, None] * NOPE + dn[None, :],
                       mask=inside[:, None], other=0.0)
        merged = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + token_head * NOPE + dn, merged.to(tl.bfloat16))

    return sparse_mla_decode_kernel, merge_splits_kernel


class SparseMlaDecode:
    """Fused sparse MLA decode (module docstring) for one layout and head count.

    ``__call__(q, kv_rows, indices, out, splits=None)``: q bf16 ``[B, heads, nope + rope]``
    contiguous, kv_rows uint8 ``[rows, row_bytes]`` contiguous, indices int32 ``[B, K]``
    contiguous (``-1``: padding), out bf16 ``[B, heads, nope]`` contiguous, written. A token
    with no valid row gets zeros. ``splits``: programs per head block over ``K``; by default
    the fastest, per batch size, of :meth:`split_options` (timed with the block sizes,
    :class:`.launch_configs.LaunchChooser`). Capturable in a CUDA graph once each
    batch size ran eagerly (launch chosen, split workspace allocated)."""

    def __init__(self, layout: MlaRowLayout, heads: int, sm_scale: float):
        if heads % 16:
            raise ValueError(f"SparseMlaDecode: heads {heads} is not a multiple of 16")
        self.layout, self.heads, self.sm_scale = layout, heads, sm_scale
        self._kernel, self._merge = _kernel()
        self._blocks = [c for c in CONFIGS if heads % c["BLOCK_H"] == 0]
        self._chooser = LaunchChooser("sparse MLA decode")
        self._workspace: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._num_sms = 0

    def split_options(self, batch: int, block_h: int, top_k: int,
                      device: torch.device) -> list[int]:
        """Split counts worth timing at ``batch`` tokens: :data:`SPLIT_OPTIONS` up to the one
        that gives every SM ``MAX_WAVES`` programs, each split at least
        ``MIN_ROWS_PER_SPLIT`` rows (only 1 off the GPU)."""
        if device.type != "cuda":
            return [1]
        if not self._num_sms:
            self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        programs = batch * (self.heads // block_h)
        most = min(math.ceil(MAX_WAVES * self._num_sms / max(1, programs)),
                   top_k // MIN_ROWS_PER_SPLIT)
        return [n for n in SPLIT_OPTIONS if n == 1 or n <= most]

    def _candidates(self, batch: int, top_k: int, splits: int | None,
                    device: torch.device) -> list[dict]:
        out = []
        for block in self._blocks:
            options = ([splits] if splits is not None else
                       self.split_options(batch, block["BLOCK_H"], top_k, device))
            out += [dict(block, splits=n) for n in options]
        return out

    def __call__(self, q: torch.Tensor, kv_rows: torch.Tensor, indices: torch.Tensor,
                 out: torch.Tensor, *, splits: int | None = None) -> torch.Tensor:
        L = self.layout
        self._check(q, kv_rows, indices, out)
        B, K = indices.shape
        if B == 0:
            return out
        if splits is not None and not 1 <= splits <= max(1, K):
            raise ValueError(f"splits {splits}: expected 1 to {max(1, K)}")
        import triton
        import triton.language as tl
        dot = tl.bfloat16 if q.device.type == "cuda" else tl.float32  # interpreter: no bf16 dot
        scales = kv_rows.view(torch.float32) if L.fp8 else kv_rows  # unread without fp8

        def launch(config: dict) -> None:
            meta = dict(config)
            n = meta.pop("splits")
            part, lse = self._split_workspace(B, n, q.device)
            grid = (B, self.heads // meta["BLOCK_H"], n)
            self._kernel[grid](
                q, kv_rows, kv_rows.view(torch.bfloat16), scales, indices, out, part, lse, K,
                -(-K // n), self.sm_scale, HEADS=self.heads, NOPE=L.nope_dim, ROPE=L.rope_dim,
                ROW_BYTES=L.row_bytes, ROPE_AT=L.rope_offset_bytes,
                GROUPS=max(1, L.scale_groups), FP8=L.fp8, SPLIT=n > 1, DOT=dot, **meta)
            if n > 1:  # merge the splits by their log-sum-exp
                self._merge[(B * self.heads,)](part, lse, out, n, NOPE=L.nope_dim,
                                               BLOCK_S=triton.next_power_of_2(n))

        key = (B, K, splits)
        new = key not in self._chooser.chosen
        chosen = self._chooser.run(key, lambda: self._candidates(B, K, splits, q.device),
                                   launch, q.device)
        if new:  # drop the workspaces of the splits not chosen
            for n in [n for b, n in self._workspace if b == B and n != chosen["splits"]]:
                del self._workspace[(B, n)]
        return out

    def launches(self) -> dict[str, dict]:
        """The launch chosen so far per batch size (the key of ``bench throughput``'s JSON)."""
        return {str(batch): config for (batch, _, _), config in self._chooser.chosen.items()}

    def _check(self, q, kv_rows, indices, out) -> None:
        L = self.layout
        B = indices.shape[0] if indices.dim() == 2 else -1
        if indices.dim() != 2 or indices.dtype != torch.int32:
            raise ValueError(f"indices: expected int32 [B, K], got {indices.dtype} "
                             f"{tuple(indices.shape)}")
        width = L.nope_dim + L.rope_dim
        if tuple(q.shape) != (B, self.heads, width) or q.dtype != torch.bfloat16:
            raise ValueError(f"q: expected bf16 [{B}, {self.heads}, {width}], got {q.dtype} "
                             f"{tuple(q.shape)}")
        if kv_rows.dim() != 2 or kv_rows.shape[1] != L.row_bytes or kv_rows.dtype != torch.uint8:
            raise ValueError(f"kv_rows: expected uint8 [rows, {L.row_bytes}], got "
                             f"{kv_rows.dtype} {tuple(kv_rows.shape)}")
        if tuple(out.shape) != (B, self.heads, L.nope_dim) or out.dtype != torch.bfloat16:
            raise ValueError(f"out: expected bf16 [{B}, {self.heads}, {L.nope_dim}], got "
                             f"{out.dtype} {tuple(out.shape)}")
        for name, t in (("q", q), ("kv_rows", kv_rows), ("indices", indices), ("out", out)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")

    def _split_workspace(self, batch: int, splits: int, device: torch.device):
        """(partial outputs float32 ``[B, heads, S, nope]``, their log-sum-exp ``[B, heads,
        S]``), one pair per (batch, splits), allocated at its first (eager) call."""
        key = (batch, splits)
        if key not in self._workspace:
            if splits == 1:
                empty = torch.empty(0, device=device)
                self._workspace[key] = (empty, empty)
            else:
                shape = (batch, self.heads, splits)
                self._workspace[key] = (
                    torch.empty(shape + (self.layout.nope_dim,), device=device),
                    torch.empty(shape, device=device))
        return self._workspace[key]
