"""Inputs for op tests: a builder for hand-made ``resolve`` cases, a random case generator,
valid edge cases, and inputs only the data checks reject (``resolve`` and the copies).

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
    slot_class: torch.Tensor = None  # uint8 [R, D] eviction classes, or None (plain LRU)

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
        args = (self.topk, self.token_rows, self.residency, self.host_blocks, self.hot_blocks,
                self.slot_pos, self.lru, self.block_size, self.out_rows, self.miss_src,
                self.miss_dst, self.miss_count, self.stats)
        return args if self.slot_class is None else args + (self.slot_class,)

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
                padding_fraction: float = 0.1, allow_overflow: bool = False,
                partial_fraction: float = 0.0, with_classes: bool = False) -> ResolveCase:
    """A valid random ``resolve`` input with duplicates, padding and locality.

    Unless ``allow_overflow``, the number of distinct host-backed positions per request is
    kept within its leased slots, so the case resolves without error. ``partial_fraction``:
    the share of state rows whose hot region is partial (some hot blocks -1, their slots
    empty); ``with_classes``: random ``slot_class`` values 0..5 (above 3 counts as 3).
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
    leased_slots = [num_slots] * num_rows
    for r in range(num_rows):
        if partial_fraction and rng.random() < partial_fraction:
            gone = rng.sample(range(hot_nb), rng.randint(1, hot_nb))  # all of them sometimes
            for b in gone:
                hot_blocks[r, b] = -1
                slot_pos[r, b * bs:(b + 1) * bs] = -1  # an unleased slot is empty
            leased_slots[r] = (hot_nb - len(gone)) * bs
    slot_class = None
    if with_classes:
        slot_class = torch.tensor([[rng.randrange(6) for _ in range(num_slots)]
                                   for _ in range(num_rows)], dtype=torch.uint8)

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
            request_sel = _cap_host_backed(request_sel, residency[r], bs, leased_slots[r])
        token_rows.extend([r] * n)
        topk_rows.extend(request_sel)
    if not token_rows:
        topk = torch.zeros((0, k), dtype=torch.int32)
    else:
        topk = torch.tensor(topk_rows, dtype=torch.int32)
    return ResolveCase(topk, torch.tensor(token_rows, dtype=torch.int32).reshape(-1), residency,
                       host_blocks, hot_blocks, slot_pos, lru, bs, slot_class=slot_class)


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


def max_block_id(block_size: int) -> int:
    """The largest block id whose rows (``block * block_size + offset``) fit int32."""
    return (1 << 31) // block_size - 1


def adversarial_cases():
    """Valid edge cases as (name, case): every op check must accept them."""
    rng = random.Random(7)
    yield "empty batch", ResolveCase(
        torch.zeros((0, 4), dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
        torch.full((2, 3), -1, dtype=torch.int32), torch.full((2, 3), -1, dtype=torch.int32),
        torch.full((2, 1), -1, dtype=torch.int32), torch.full((2, 4), -1, dtype=torch.int32),
        torch.arange(4, dtype=torch.int16).repeat(2, 1), 4)
    c = random_case(random.Random(1), max_rows=4)
    c.token_rows = torch.full_like(c.token_rows, -1)
    yield "padding tokens only", c
    c = random_case(random.Random(2), max_rows=4, k=8)
    c.topk = torch.full_like(c.topk, -1)
    yield "padding selections only", c
    yield "all resident", random_case(random.Random(3), resident_fraction=1.0)
    c = random_case(random.Random(4), resident_fraction=0.0, hot_blocks_per_request=4)
    c.slot_pos.fill_(-1)
    yield "all miss", c
    c = random_case(random.Random(5), resident_fraction=0.0, k=16)
    c.topk = torch.where(c.topk >= 0, c.topk[:, :1].expand_as(c.topk), c.topk).contiguous()
    yield "one position repeated", c
    # Largest sizes: D = 32768 (int16 lru), K = 2048, block 64, block ids at the int32 edge.
    bs, num_pages, d, k = 64, 64, 32768, 2048
    edge = max_block_id(bs)
    residency = torch.full((1, num_pages), -1, dtype=torch.int32)
    residency[0, ::2] = edge - torch.arange(0, num_pages, 2, dtype=torch.int32)
    host_blocks = (edge - num_pages - torch.arange(num_pages, dtype=torch.int32)).reshape(1, -1)
    hot_blocks = (torch.arange(d // bs, dtype=torch.int32) + 1000).reshape(1, -1)
    slot_pos = torch.full((1, d), -1, dtype=torch.int32)
    slot_pos[0, :num_pages * bs // 4] = torch.arange(0, num_pages * bs, 4, dtype=torch.int32)
    lru = torch.tensor(rng.sample(range(d), d), dtype=torch.int16).reshape(1, d)
    topk = torch.tensor([rng.sample(range(num_pages * bs), k)], dtype=torch.int32)
    yield "max sizes, ids at the int32 edge", ResolveCase(topk, i32([0]), residency, host_blocks,
                                                          hot_blocks, slot_pos, lru, bs)
    # Partial hot regions and eviction classes (docs/design.md, "Op contracts", `resolve`, rules 4-5).
    c = random_case(random.Random(8), resident_fraction=0.0, hot_blocks_per_request=4,
                    partial_fraction=1.0)
    yield "partial hot regions, misses only in leased blocks", c
    c = random_case(random.Random(9), resident_fraction=0.0, hot_blocks_per_request=4,
                    with_classes=True)
    c.slot_pos.fill_(-1)
    yield "all miss, eviction classes", c
    c = random_case(random.Random(10), resident_fraction=0.2, hot_blocks_per_request=3,
                    partial_fraction=0.5, with_classes=True)
    yield "partial hot regions and eviction classes", c
    # the production shape with classes: K 2048, D 4096, every class, a quarter unleased
    bs, num_pages, d, k = 64, 2048, 4096, 2048
    hot_blocks = (torch.arange(d // bs, dtype=torch.int32) + 5000).reshape(1, -1)
    hot_blocks[0, 48:] = -1
    slot_pos = torch.full((1, d), -1, dtype=torch.int32)
    held = torch.tensor(rng.sample(range(num_pages * bs), 3 * d // 4), dtype=torch.int32)
    slot_pos[0, :3 * d // 4] = held
    lru = torch.tensor(rng.sample(range(d), d), dtype=torch.int16).reshape(1, d)
    chosen = rng.sample(held.tolist(), k // 2) + rng.sample(range(num_pages * bs), k // 2)
    chosen = list(dict.fromkeys(chosen))[:k]
    chosen += [-1] * (k - len(chosen))
    slot_class = torch.tensor([[rng.randrange(4) for _ in range(d)]], dtype=torch.uint8)
    yield "production shape, classes, a quarter unleased", ResolveCase(
        torch.tensor([chosen], dtype=torch.int32), i32([0]),
        torch.full((1, num_pages), -1, dtype=torch.int32),
        torch.arange(num_pages, dtype=torch.int32).reshape(1, -1) + 10_000, hot_blocks, slot_pos,
        lru, bs, slot_class=slot_class)


def input_defect_cases():
    """Invalid ``resolve`` inputs that only the data checks catch, as (name, case, error class,
    ResolveErrorCode or None, message fragment). Built on one base case: D = 8, K = 4, bs = 4,
    positions 12, 16, 25 host-backed (12 and 16 hits), 30 resident."""
    from vllm_hisparse.ops import errors

    def base() -> ResolveCase:
        residency = torch.full((1, 8), -1, dtype=torch.int32)
        residency[0, 7] = 9
        return ResolveCase(
            topk=i32([[12, 16, 25, 30]]), token_rows=i32([0]), residency=residency,
            host_blocks=i32([[100 + p for p in range(8)]]), hot_blocks=i32([[20, 21]]),
            slot_pos=i32([list(range(10, 18))]),
            lru=torch.arange(8, dtype=torch.int16).reshape(1, 8), block_size=4)

    c = base()
    c.lru[0, 3] = 8
    yield ("lru value D", c, errors.ResolveError, errors.ResolveErrorCode.CORRUPT_LRU,
           "holds 8, outside [0, 8)")
    c = base()
    c.lru[0, 5] = -3
    yield ("lru value negative", c, errors.ResolveError, errors.ResolveErrorCode.CORRUPT_LRU,
           "holds -3, outside [0, 8)")
    c = base()
    c.lru[0, 6] = 2
    yield ("lru slot twice", c, errors.ResolveError, errors.ResolveErrorCode.DUPLICATE_LRU_SLOT,
           "holds slot 2 more than once")
    c = base()
    c.residency[0, 2] = -2
    yield "residency -2", c, errors.NegativeIdError, None, "residency[0, 2] holds -2"
    c = base()
    c.host_blocks[0, 6] = -5
    yield "host_blocks -5", c, errors.NegativeIdError, None, "host_blocks[0, 6] holds -5"
    c = base()
    c.hot_blocks[0, 1] = -2
    yield "hot_blocks -2", c, errors.NegativeIdError, None, "hot_blocks[0, 1] holds -2"
    c = base()
    c.residency[0, 7] = max_block_id(4) + 1
    yield ("residency overflows int32", c, errors.RowOverflowError, None,
           f"residency[0, 7] holds block {max_block_id(4) + 1}")
    c = base()
    c.host_blocks[0, 6] = 1 << 30
    yield ("host_blocks overflows int32", c, errors.RowOverflowError, None,
           f"host_blocks[0, 6] holds block {1 << 30}")
    c = base()
    c.hot_blocks[0, 0] = (1 << 31) - 1
    yield ("hot_blocks overflows int32", c, errors.RowOverflowError, None,
           "overflow int32")


def copy_defect_cases():
    """Invalid copy inputs only the data checks catch, as (name, op, id lists, error class,
    message fragment), for src = 2 layers of 64 rows, dst = 2 layers of 40 rows, block_size 4
    (see :func:`call_copy`)."""
    from vllm_hisparse.ops import errors

    dup, neg = errors.DuplicateDestinationError, errors.NegativeIdError
    yield ("gather: one destination twice in a row", "gather_rows", ([[3, 4]], [[1, 1]], [2]),
           dup, "miss_dst[0, 0] and miss_dst[0, 1] both hold 1")
    yield ("gather: one destination in two rows", "gather_rows",
           ([[3, 4], [5, 6]], [[7, 0], [2, 7]], [1, 2]),
           dup, "miss_dst[0, 0] and miss_dst[1, 1] both hold 7")
    yield ("gather: counted source -1", "gather_rows", ([[3, -1]], [[1, 2]], [2]),
           neg, "miss_src[0, 1] holds -1 within miss_count")
    yield ("gather: counted destination -2", "gather_rows", ([[3, 4]], [[-2, 2]], [1]),
           neg, "miss_dst[0, 0] holds -2 within miss_count")
    yield ("copy_blocks: one destination twice", "copy_blocks", ([1, 2, 3], [4, -1, 4]),
           dup, "dst_blocks[0] and dst_blocks[2] both hold 4")
    yield ("copy_blocks: source -2", "copy_blocks", ([1, -2], [0, 1]),
           neg, "src_blocks[1] holds -2: the only negative id is the -1")
    yield ("copy_blocks: destination -3 next to padding", "copy_blocks", ([-1, 2], [-3, 1]),
           neg, "dst_blocks[0] holds -3")
    yield ("mirror_rows: one destination twice", "mirror_rows", ([1, 2], [39, 39]),
           dup, "dst_rows[0] and dst_rows[1] both hold 39")
    yield ("mirror_rows: source -5", "mirror_rows", ([-5], [0]), neg, "src_rows[0] holds -5")


def call_copy(backend, op: str, src_layers, dst_layers, id_lists, device="cpu") -> None:
    """``backend.<op>(src_layers, dst_layers, *ids)`` with the id lists as int32 tensors on
    ``device`` (``copy_blocks`` gets block_size 4)."""
    ids = [torch.tensor(x, dtype=torch.int32, device=device) for x in id_lists]
    rest = (4,) if op == "copy_blocks" else ()
    getattr(backend, op)(src_layers, dst_layers, *ids, *rest)
