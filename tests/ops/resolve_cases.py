"""Inputs for ``resolve`` tests: a builder for hand-made cases and a random case generator.

Shared by the reference tests (CPU) and the kernel tests (GPU), so both see the same cases.
"""

from __future__ import annotations

import dataclasses
import random

import torch


@dataclasses.dataclass
class ResolveCase:
    """All arguments of ``resolve`` (outputs poisoned so unwritten entries show)."""

    topk: torch.Tensor
    token_rows: torch.Tensor
    residency: torch.Tensor
    host_blocks: torch.Tensor
    hot_blocks: torch.Tensor
    slot_pos: torch.Tensor
    lru: torch.Tensor
    block_size: int
    out_rows: torch.Tensor = None
    miss_src: torch.Tensor = None
    miss_dst: torch.Tensor = None
    miss_count: torch.Tensor = None
    stats: torch.Tensor = None

    def __post_init__(self):
        shape = tuple(self.topk.shape)
        poison = -7  # never a valid output value
        if self.out_rows is None:
            self.out_rows = torch.full(shape, poison, dtype=torch.int32)
        if self.miss_src is None:
            self.miss_src = torch.full(shape, poison, dtype=torch.int32)
        if self.miss_dst is None:
            self.miss_dst = torch.full(shape, poison, dtype=torch.int32)
        if self.miss_count is None:
            self.miss_count = torch.full((shape[0],), poison, dtype=torch.int32)
        if self.stats is None:
            self.stats = torch.zeros(3, dtype=torch.int64)

    def args(self):
        return (self.topk, self.token_rows, self.residency, self.host_blocks, self.hot_blocks,
                self.slot_pos, self.lru, self.block_size, self.out_rows, self.miss_src,
                self.miss_dst, self.miss_count, self.stats)

    def clone(self, device: str | torch.device | None = None) -> "ResolveCase":
        fields = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v.clone() if device is None else v.to(device).clone()
            fields[f.name] = v
        return ResolveCase(**fields)

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor, copied to the CPU (for before/after comparisons)."""
        return {f.name: getattr(self, f.name).detach().cpu().clone()
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def random_case(rng: random.Random, *, max_rows: int = 6, max_tokens_per_request: int = 4,
                k: int | None = None, block_size: int | None = None,
                hot_blocks_per_request: int | None = None, resident_fraction: float | None = None,
                padding_fraction: float = 0.1, allow_overflow: bool = False) -> ResolveCase:
    """A valid random ``resolve`` input with duplicates, padding and locality.

    Unless ``allow_overflow``, the number of distinct host-backed positions per request is
    kept within D, so the case resolves without error.
    """
    bs = block_size or rng.choice([1, 2, 4, 8, 16])
    hot_nb = hot_blocks_per_request or rng.randint(1, 4)
    num_slots = hot_nb * bs
    k = k or rng.randint(1, 24)
    num_rows = rng.randint(1, max_rows)
    num_pages = rng.randint(1, 12)
    num_positions = num_pages * bs
    frac = rng.random() if resident_fraction is None else resident_fraction

    residency = torch.full((num_rows, num_pages), -1, dtype=torch.int32)
    host_blocks = torch.full((num_rows, num_pages), -1, dtype=torch.int32)
    hot_blocks = torch.full((num_rows, hot_nb), -1, dtype=torch.int32)
    device_ids = list(range(num_rows * (num_pages + hot_nb)))
    host_ids = list(range(num_rows * num_pages))
    rng.shuffle(device_ids)
    rng.shuffle(host_ids)
    for r in range(num_rows):
        for p in range(num_pages):
            host_blocks[r, p] = host_ids.pop()
            if rng.random() < frac:
                residency[r, p] = device_ids.pop()
        for b in range(hot_nb):
            hot_blocks[r, b] = device_ids.pop()

    slot_pos = torch.full((num_rows, num_slots), -1, dtype=torch.int32)
    lru = torch.zeros((num_rows, num_slots), dtype=torch.int16)
    for r in range(num_rows):
        held = rng.sample(range(num_positions), min(num_positions, rng.randint(0, num_slots)))
        slots = rng.sample(range(num_slots), len(held))
        for s, pos in zip(slots, held):
            slot_pos[r, s] = pos
        perm = list(range(num_slots))
        rng.shuffle(perm)
        lru[r] = torch.tensor(perm, dtype=torch.int16)

    # Requests: contiguous runs of tokens, padding tokens in between.
    rows = rng.sample(range(num_rows), rng.randint(0, num_rows))
    token_rows: list[int] = []
    topk_rows: list[list[int]] = []
    for r in rows:
        if rng.random() < padding_fraction:
            token_rows.append(-1)
            topk_rows.append([rng.randrange(-1, num_positions) for _ in range(k)])
        n = rng.randint(1, max_tokens_per_request)
        held = [int(x) for x in slot_pos[r] if x >= 0]
        centre = rng.randrange(num_positions)
        request_sel: list[list[int]] = []
        for _ in range(n):
            sel = []
            for _ in range(k):
                u = rng.random()
                if u < padding_fraction:
                    sel.append(-1)
                elif u < 0.45 and held:
                    sel.append(rng.choice(held))  # likely a hit
                elif u < 0.6 and sel:
                    sel.append(rng.choice(sel))  # duplicate within the row
                else:
                    sel.append(min(num_positions - 1, max(0, centre + rng.randint(-3 * bs, 3 * bs))))
            request_sel.append(sel)
        if not allow_overflow:
            request_sel = _cap_host_backed(request_sel, residency[r], bs, num_slots)
        token_rows.extend([r] * n)
        topk_rows.extend(request_sel)
    if not token_rows:
        topk = torch.zeros((0, k), dtype=torch.int32)
    else:
        topk = torch.tensor(topk_rows, dtype=torch.int32)
    return ResolveCase(topk, torch.tensor(token_rows, dtype=torch.int32).reshape(-1), residency,
                       host_blocks, hot_blocks, slot_pos, lru, bs)


def _cap_host_backed(sel: list[list[int]], residency_row: torch.Tensor, bs: int,
                     num_slots: int) -> list[list[int]]:
    """Turn selections into padding once the request would select more than D host-backed
    distinct positions."""
    seen: set[int] = set()
    out = []
    for row in sel:
        new_row = []
        for p in row:
            if p >= 0 and int(residency_row[p // bs]) < 0 and p not in seen:
                if len(seen) == num_slots:
                    p = -1
                else:
                    seen.add(p)
            new_row.append(p)
        out.append(new_row)
    return out
