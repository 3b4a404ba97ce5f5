"""A synthetic DSA decode workload: deterministic KV bytes and drifting top-k selections.

Used where no real DSA model can run (the CPU simulator, the GPU decode benchmark, tests) to
check that every row attention would read is the right one.

KV bytes: row ``(request, position, layer)`` starts with its own coordinates (little-endian
int32 position, int16 layer, int16 request) followed by a pattern derived from them, so a wrong
row is recognised exactly and the culprit is readable from its first 8 bytes.

Selections: each request's indexer picks K distinct positions per token from three sources,
like a real indexer's scores do: the most recent tokens, a window around a focus that drifts
slowly through the context, and a sprinkling of older positions. Step to step most selections
repeat, which is what makes a small hot region work.
"""

from __future__ import annotations

import torch

HEADER_BYTES = 8


def kv_rows(request: int, positions: torch.Tensor, layer: int, row_bytes: int) -> torch.Tensor:
    """uint8 ``[len(positions), row_bytes]``: the KV bytes of ``positions`` of one request and
    layer. ``row_bytes`` must be at least 16."""
    if row_bytes < 16:
        raise ValueError(f"kv_rows: row_bytes must be >= 16, got {row_bytes}")
    pos = positions.to(torch.int64).reshape(-1, 1)
    n = pos.shape[0]
    out = torch.empty((n, row_bytes), dtype=torch.uint8, device=positions.device)
    shifts = torch.arange(0, 32, 8, device=positions.device)  # no host copy: no sync
    out[:, 0:4] = ((pos >> shifts) & 0xFF).to(torch.uint8)
    out[:, 4] = layer & 0xFF
    out[:, 5] = (layer >> 8) & 0xFF
    out[:, 6] = request & 0xFF
    out[:, 7] = (request >> 8) & 0xFF
    seed = (pos * 1_000_003 + layer * 7919 + request * 104_729) % 65_521
    cols = torch.arange(row_bytes - HEADER_BYTES, device=positions.device).reshape(1, -1)
    out[:, HEADER_BYTES:] = ((seed + cols * 131 + (seed >> 3) * cols) % 251).to(torch.uint8)
    return out


def describe_row(row: torch.Tensor) -> str:
    """Human-readable coordinates encoded in a row's header (for mismatch messages)."""
    b = row[:HEADER_BYTES].to(torch.int64).tolist()
    position = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
    return f"(request {b[6] | b[7] << 8}, position {position}, layer {b[4] | b[5] << 8})"


class TopkGenerator:
    """Drifting top-k selections for one request.

    Args:
        k: selections per token (the model's ``index_topk``).
        seed: makes the sequence reproducible per request.
        recent: how many of the newest positions are always selected.
        drift_tokens: how far the focus moves per step, on average.
        random_fraction: share of selections drawn uniformly from the whole context.
    """

    def __init__(self, k: int, seed: int, *, recent: int = 128, drift_tokens: float = 8.0,
                 random_fraction: float = 0.05):
        self.k = k
        self.recent = recent
        self.drift_tokens = drift_tokens
        self.random_fraction = random_fraction
        self._gen = torch.Generator().manual_seed(seed)
        self._focus = None

    def _rand(self, n: int, high: int) -> torch.Tensor:
        return torch.randint(0, max(1, high), (n,), generator=self._gen)

    def select(self, context_len: int) -> torch.Tensor:
        """int32 ``[K]`` distinct positions in ``[0, context_len)``, -1 padded when the context
        is shorter than K."""
        k = self.k
        if context_len <= k:
            out = torch.full((k,), -1, dtype=torch.int32)
            out[:context_len] = torch.randperm(context_len, generator=self._gen).to(torch.int32)
            return out
        if self._focus is None:
            self._focus = float(self._rand(1, context_len)[0])
        step = float(torch.randn(1, generator=self._gen)[0]) * self.drift_tokens
        self._focus = min(max(0.0, self._focus + step), context_len - 1.0)
        recent = torch.arange(max(0, context_len - self.recent), context_len)
        num_random = int(k * self.random_fraction)
        window = k  # the focus window is wide enough to fill what the other sources leave
        lo = int(min(max(0, self._focus - window // 2), context_len - window))
        around = torch.arange(lo, lo + window)
        scattered = self._rand(num_random * 2, context_len)
        candidates = torch.cat([recent, scattered, around])
        # Distinct, keeping the first occurrence (recent, then scattered, then the window).
        uniq, inverse = torch.unique(candidates, return_inverse=True)
        first = torch.full((uniq.numel(),), candidates.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(candidates.numel()), reduce="amin")
        ordered = uniq[torch.argsort(first)]
        return ordered[:k].to(torch.int32)
