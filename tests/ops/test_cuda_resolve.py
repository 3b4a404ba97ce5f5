"""resolve's CUDA kernels against the pure-torch twin, bit for bit (GPU only): >= 1,000
random cases plus adversarial ones (duplicates, padding, empty batch, all resident, all miss,
D = 32,768 with an int16 lru, K = 2048, block 64, 4-token spec-decode requests, requests past
the kernel's register chunk of 8 selections per thread, multi-step state evolution), the fast
path's hand-offs to the general path, and a CUDA-graph capture and replay of resolve + gather.
Errors: test_cuda_resolve_errors.py; the copies: test_cuda_copies.py.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from resolve_cases import ResolveCase, adversarial_cases, i32, random_case
from vllm_hisparse.ops import probe, reference
from vllm_hisparse.ops.errors import ResolveErrorCode

from cuda_harness import (DEV, TUNING, assert_same, big_case, cap_distinct, check_case, cuda_ops,
                          distinct_rows, expect_error, layers, run_both)

pytestmark = pytest.mark.gpu


# --------------------------------------------------------------------------------------
# resolve: random and adversarial equality
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_resolve_random_cases(seed):
    rng = random.Random(1000 + seed)
    for i in range(300):  # 4 x 300 = 1,200 random cases
        case = random_case(rng)
        check_case(case, with_stats=(i % 5 != 0), what=f"seed {seed} case {i}")


def test_resolve_random_multi_step():
    """State evolves over several steps exactly as in the reference."""
    rng = random.Random(7)
    for i in range(60):
        case = random_case(rng, max_tokens_per_request=4)
        ref = case.clone()
        gpu = case.clone(DEV)
        for step in range(4):
            if step:
                rng.randrange(1 << 30)  # the draw a discarded case took: same seeds as before
                # new selections within the same position range, same token layout
                npos = case.residency.shape[1] * case.block_size
                sel = torch.randint(-1, npos, tuple(case.topk.shape), dtype=torch.int32)
                ref.topk = sel.clone()
                gpu.topk = sel.to(DEV)
                ref = cap_distinct(ref)
                gpu.topk = ref.topk.to(DEV)
            reference.resolve(*ref.args())
            cuda_ops.resolve(*gpu.args(), tuning=TUNING)
            cuda_ops.check_errors(DEV)
            assert_same(ref.state(), gpu.state(), f"case {i} step {step}")


def test_resolve_worked_example():
    bs, num_pages = 4, 8
    residency = torch.full((1, num_pages), -1, dtype=torch.int32)
    residency[0, 7] = 9
    case = ResolveCase(
        topk=i32([[12, 16, 25, 30]]), token_rows=i32([0]), residency=residency,
        host_blocks=i32([[100 + p for p in range(num_pages)]]), hot_blocks=i32([[20, 21]]),
        slot_pos=i32([list(range(10, 18))]),
        lru=torch.arange(8, dtype=torch.int16).reshape(1, 8), block_size=bs)
    ref, gpu = run_both(case)
    assert_same(ref, gpu)
    assert gpu["lru"].tolist() == [[1, 3, 4, 5, 7, 0, 2, 6]]


def test_resolve_empty_batch():
    case = random_case(random.Random(3))
    case.topk = torch.zeros((0, 8), dtype=torch.int32)
    case.token_rows = torch.zeros((0,), dtype=torch.int32)
    case.__post_init__()
    case.out_rows = torch.zeros((0, 8), dtype=torch.int32)
    case.miss_src = torch.zeros((0, 8), dtype=torch.int32)
    case.miss_dst = torch.zeros((0, 8), dtype=torch.int32)
    case.miss_count = torch.zeros((0,), dtype=torch.int32)
    check_case(case)


def test_resolve_padding_only_and_padding_selections():
    rng = random.Random(11)
    case = big_case(rng, num_requests=3, tokens_per_request=2, k=64, num_slots=256,
                    block_size=16, num_pages=32, resident_fraction=0.3, hit_fraction=0.3,
                    padding=0.5)
    # padding tokens at the start, middle and end
    rows = case.token_rows.tolist()
    rows = [-1] + rows[:2] + [-1, -1] + rows[2:] + [-1]
    topk = torch.cat([torch.full((1, 64), 5, dtype=torch.int32), case.topk[:2],
                      torch.full((2, 64), -1, dtype=torch.int32), case.topk[2:],
                      torch.randint(0, 512, (1, 64), dtype=torch.int32)])
    case.token_rows = i32(rows)
    case.topk = topk.contiguous()
    for name in ("out_rows", "miss_src", "miss_dst"):
        setattr(case, name, torch.full(tuple(topk.shape), -7, dtype=torch.int32))
    case.miss_count = torch.full((topk.shape[0],), -7, dtype=torch.int32)
    check_case(case)
    # every token padding
    case.token_rows = torch.full_like(case.token_rows, -1)
    check_case(case)
    # every selection padding
    case.token_rows = i32(rows)
    case.topk = torch.full_like(case.topk, -1)
    check_case(case)


def test_resolve_duplicates_within_and_across_tokens():
    rng = random.Random(12)
    for i in range(20):
        case = big_case(rng, num_requests=4, tokens_per_request=rng.randint(1, 4), k=128,
                        num_slots=512, block_size=64, num_pages=16, resident_fraction=0.25,
                        hit_fraction=0.4, dup=0.5, padding=0.05)
        case = cap_distinct(case)
        check_case(case, what=f"dup case {i}")


def test_resolve_all_resident_leaves_hot_state():
    rng = random.Random(13)
    case = big_case(rng, num_requests=5, tokens_per_request=2, k=256, num_slots=512,
                    block_size=64, num_pages=32, resident_fraction=1.0, hit_fraction=0.0)
    case.hot_blocks.fill_(-1)  # Full requests lease no hot region
    ref, gpu = run_both(case)
    assert_same(ref, gpu)
    assert torch.equal(gpu["lru"], case.lru) and torch.equal(gpu["slot_pos"], case.slot_pos)
    assert gpu["stats"][1:].tolist() == [0, 0]


def test_resolve_all_miss():
    rng = random.Random(14)
    case = big_case(rng, num_requests=4, tokens_per_request=1, k=512, num_slots=512,
                    block_size=64, num_pages=64, resident_fraction=0.0, hit_fraction=0.0)
    case.slot_pos.fill_(-1)
    # exactly D distinct host-backed positions per request
    for t in range(case.topk.shape[0]):
        case.topk[t] = torch.randperm(64 * 64)[:512].to(torch.int32)
    ref, gpu = run_both(case)
    assert_same(ref, gpu)
    assert gpu["miss_count"].tolist() == [512] * 4


@pytest.mark.parametrize("spec_tokens", [1, 4])
def test_resolve_production_shape(spec_tokens):
    """K = 2048, block 64, D = 4096 (8192 with spec), batch of requests, several steps."""
    rng = random.Random(15 + spec_tokens)
    D = 4096 if spec_tokens == 1 else 10240
    case = big_case(rng, num_requests=8, tokens_per_request=spec_tokens, k=2048,
                    num_slots=D, block_size=64, num_pages=2048, resident_fraction=0.3,
                    hit_fraction=0.6, dup=0.02, padding=0.01)
    case = cap_distinct(case)
    ref = case.clone()
    gpu = case.clone(DEV)
    for step in range(3):
        reference.resolve(*ref.args())
        cuda_ops.resolve(*gpu.args(), tuning=TUNING)
        cuda_ops.check_errors(DEV)
        assert_same(ref.state(), gpu.state(), f"step {step}")
        # drift: replace a fifth of the selections
        sel = ref.topk.clone()
        m = torch.rand(sel.shape) < 0.2
        sel[m] = torch.randint(0, 2048 * 64, (int(m.sum()),), dtype=torch.int32)
        ref.topk = sel
        ref = cap_distinct(ref)
        gpu.topk = ref.topk.to(DEV)


def test_resolve_d32768_int16_lru():
    """D = 32,768 slots: lru values up to 32,767 in int16; 4-token request; block 64."""
    rng = random.Random(16)
    case = big_case(rng, num_requests=2, tokens_per_request=4, k=2048, num_slots=32768,
                    block_size=64, num_pages=4096, resident_fraction=0.2, hit_fraction=0.5,
                    dup=0.05)
    assert int(case.lru.max()) == 32767
    check_case(case, what="D=32768")
    # and all-miss with exactly D distinct host-backed positions in one 4-token request:
    case.residency.fill_(-1)
    case.slot_pos.fill_(-1)
    perm = torch.randperm(4096 * 64)[:32768].to(torch.int32)
    case.topk = perm[:4 * 2048].reshape(4, 2048).repeat(2, 1).contiguous()
    case.topk[4:] = perm[8192:16384].reshape(4, 2048)
    case.__post_init__()
    check_case(case, what="D=32768 all miss")


def test_resolve_single_token_capacity_knob():
    rng = random.Random(17)
    case = big_case(rng, num_requests=6, tokens_per_request=1, k=2048, num_slots=4096,
                    block_size=64, num_pages=512, resident_fraction=0.5, hit_fraction=0.5)
    check_case(case, tuning=dataclasses.replace(TUNING, max_tokens_per_request=1))


def test_resolve_five_token_requests_fit():
    """More tokens per request than the default bound still resolve while the union fits."""
    rng = random.Random(18)
    case = big_case(rng, num_requests=2, tokens_per_request=5, k=256, num_slots=2048,
                    block_size=64, num_pages=64, resident_fraction=0.2, hit_fraction=0.6,
                    dup=0.3)
    check_case(cap_distinct(case))


def test_resolve_requests_past_one_register_chunk():
    """The kernel keeps 8 selections per thread in registers (8,192 per request at 1,024
    threads, 4,096 at 512); later ones are reloaded and looked up again. Requests of 4, 5
    and 6 tokens of K = 2048 cross that boundary (5+ tokens also end the 4-token lookahead),
    and 200 tokens of K = 64 load the rest of the first chunk after the run scan."""
    rng = random.Random(41)
    for tokens in (4, 5, 6):
        case = big_case(rng, num_requests=3, tokens_per_request=tokens, k=2048,
                        num_slots=8192, block_size=64, num_pages=512, resident_fraction=0.2,
                        hit_fraction=0.5, dup=0.3, padding=0.01)
        case = cap_distinct(case)
        check_case(case, what=f"{tokens} tokens")
        check_case(case, with_stats=False, what=f"{tokens} tokens, no stats")
    case = big_case(rng, num_requests=2, tokens_per_request=200, k=64, num_slots=256,
                    block_size=64, num_pages=4, resident_fraction=0.25, hit_fraction=0.5,
                    dup=0.2)
    check_case(cap_distinct(case), what="200 tokens of K = 64")


def test_resolve_requests_longer_than_the_token_bound():
    """Requests of 2-4 tokens with `max_tokens_per_request` = 1 (shared memory sized for one
    token) resolve like the reference while their union fits the 1-token bound."""
    rng = random.Random(44)
    bound_1 = dataclasses.replace(TUNING, max_tokens_per_request=1)
    for tokens in (2, 3, 4):
        case = big_case(rng, num_requests=3, tokens_per_request=tokens, k=256,
                        num_slots=512, block_size=64, num_pages=32, resident_fraction=0.2,
                        hit_fraction=0.5, dup=0.1, padding=0.02)
        # the later tokens repeat the first one's selections (permuted), so the union
        # stays within the 1-token bound
        for start in range(0, case.topk.shape[0], tokens):
            for j in range(1, tokens):
                case.topk[start + j] = case.topk[start][torch.randperm(256)]
        case = cap_distinct(case)
        check_case(case, what=f"{tokens} tokens, bound 1", tuning=bound_1)
        check_case(case, with_stats=False, what=f"{tokens} tokens, bound 1, no stats",
                   tuning=bound_1)


def chunk_boundary_case() -> ResolveCase:
    """One request of 6 tokens x 2048: selections before 8,192 (4,096 at 512 threads) use
    positions 0..63, the later ones also 64..127. No hits, lru = identity, so miss m takes
    slot m and misses 64.. fall into hot block 1."""
    bs, k, tokens = 64, 2048, 6
    g = torch.Generator().manual_seed(43)
    topk = torch.randint(0, 64, (tokens, k), generator=g, dtype=torch.int32)
    late = torch.randint(0, 128, (2, k), generator=g, dtype=torch.int32)
    topk[4:] = late
    topk[4, 0:64] = torch.arange(64, 128, dtype=torch.int32)  # first references of 64..127
    topk[:2, :64] = torch.arange(64, dtype=torch.int32)  # ... of 0..63 in token 0
    return ResolveCase(topk=topk.contiguous(), token_rows=i32([0] * tokens),
                       residency=i32([[-1, -1]]), host_blocks=i32([[7, 9]]),
                       hot_blocks=i32([[30, 31]]), slot_pos=torch.full((1, 128), -1,
                                                                       dtype=torch.int32),
                       lru=torch.arange(128, dtype=torch.int16).reshape(1, 128),
                       block_size=bs)


def test_resolve_chunk_boundary_case_and_its_errors():
    case = chunk_boundary_case()
    check_case(case, what="chunk boundary")
    # 128 distinct positions, hot block 1 not leased: 64 leased slots overflow
    bad = chunk_boundary_case()
    bad.hot_blocks = i32([[30, -1]])
    e = expect_error(bad, ResolveErrorCode.HOT_OVERFLOW)
    assert (e.detail_a, e.detail_b) == (128, 64)
    # a hit on a slot of the unleased block 1 (64 distinct positions: no overflow)
    bad = chunk_boundary_case()
    bad.hot_blocks = i32([[30, -1]])
    bad.slot_pos[0, 64] = 100
    bad.topk[:, :] = torch.where(bad.topk >= 63, torch.full_like(bad.topk, 100), bad.topk)
    e = expect_error(bad, ResolveErrorCode.HOT_BLOCK_MISSING)
    assert (e.detail_a, e.detail_b) == (64, 100)
    # a position out of range in the last token
    bad = chunk_boundary_case()
    bad.topk[5, 100] = 2 * 64 + 3
    expect_error(bad, ResolveErrorCode.POSITION_OUT_OF_RANGE)
    # a host block missing for a page first referenced in the 5th token
    bad = chunk_boundary_case()
    bad.host_blocks = i32([[7, -1]])
    expect_error(bad, ResolveErrorCode.NO_HOST_BLOCK)


# --------------------------------------------------------------------------------------
# resolve: the fast path and its hand-offs to the general path
# --------------------------------------------------------------------------------------


def run_counted(case: ResolveCase, with_stats: bool = True):
    """Like run_both, plus the number of requests the fast path handed to the general path."""
    ref = case.clone()
    gpu = case.clone(DEV)
    args_ref = ref.args()[:12] + (ref.stats if with_stats else None,) + ref.args()[13:]
    args_gpu = gpu.args()[:12] + (gpu.stats if with_stats else None,) + gpu.args()[13:]
    if not probe.has_probe_kernels():
        pytest.skip("needs the probe kernels (-DHISPARSE_PROBE_KERNELS=ON)")
    reference.resolve(*args_ref)
    dt = torch.zeros(probe.NUM_TIMES, dtype=torch.int64, device=DEV)
    probe.resolve(*args_gpu, tuning=TUNING, times=dt)
    cuda_ops.check_errors(DEV)
    return ref.state(), gpu.state(), int(dt[9])


@pytest.mark.parametrize("num_slots", [4096, 8192, 2048])
def test_resolve_fast_path_takes_single_token_requests(num_slots):
    """Single-token requests with distinct selections (residents, hits, misses, padding) are
    resolved by the fast path alone, exactly, over several steps, with and without stats."""
    rng = random.Random(51 + num_slots)
    if not fast_path_launched(2048, num_slots, 64, 1024):
        pytest.skip("no fast path in this thread configuration")
    case = big_case(rng, num_requests=6, tokens_per_request=1, k=2048, num_slots=num_slots,
                    block_size=64, num_pages=1024, resident_fraction=0.3, hit_fraction=0.7,
                    padding=0.02)
    case = distinct_rows(case)
    for step in range(3):
        ref, gpu, handed = run_counted(case, with_stats=step != 1)
        assert_same(ref, gpu, f"D {num_slots} step {step}")
        assert handed == 0, f"step {step}: {handed} requests handed off"
        case.slot_pos, case.lru = ref["slot_pos"], ref["lru"]
        sel = case.topk.clone()
        m = torch.rand(sel.shape) < 0.1
        sel[m] = torch.randint(0, 1024 * 64, (int(m.sum()),), dtype=torch.int32)
        case.topk = sel
        case = distinct_rows(case)


def rep_cell(position: int, multiplier: int, cells: int = 4096) -> int:
    """A resident position's representative cell in the fast path (resolve_fast.cuh:
    hash_index with 0x9E3779B1 for table A, rep_index_b with 0x85EBCA77 for table B; both
    tables have 2 * 2048 cells in every instantiation)."""
    return (((position * multiplier) & 0xFFFFFFFF) * cells) >> 32


def colliding_resident_case(rng: random.Random, with_host: bool) -> tuple[ResolveCase, int]:
    """One K = 2048 token whose resident positions fight over representative cells: whole
    A cells (16 positions each) with, for each, 8 positions sharing its B cell (most of them
    lose both cells and are counted through the CAS table), every pair of positions sharing
    both cells, and repeats of resident positions up to K. ``with_host``: odd pages are
    host-backed instead (distinct host selections, half of them hot hits). Returns the case
    and its number of distinct resident positions."""
    bs, P, K, D = 64, 1024, 2048, 4096
    by_a, by_b, by_ab = {}, {}, {}
    for p in range(P * bs):
        a, b = rep_cell(p, 0x9E3779B1), rep_cell(p, 0x85EBCA77)
        by_a.setdefault(a, []).append(p)
        by_b.setdefault(b, []).append(p)
        by_ab.setdefault((a, b), []).append(p)
    chosen = []
    for cell in rng.sample(sorted(by_a), 6):
        for p in by_a[cell]:
            chosen += [p] + by_b[rep_cell(p, 0x85EBCA77)][:8]
    chosen += [p for group in by_ab.values() if len(group) > 1 for p in group]
    chosen = list(dict.fromkeys(chosen))[:1400]
    host_page = (lambda p: (p // bs) % 2 == 1) if with_host else (lambda p: False)
    resident = [p for p in chosen if not host_page(p)]
    host = [p for p in chosen if host_page(p)][:D // 2]
    row = resident + host + [rng.choice(resident) for _ in range(K - len(resident) - len(host))]
    rng.shuffle(row)
    R = 3
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    pages = torch.arange(P)
    residency = torch.randperm(R * P, generator=g).reshape(R, P).to(torch.int32)
    residency[1][(pages % 2 == 1) if with_host else torch.zeros(P, dtype=torch.bool)] = -1
    host_blocks = torch.randperm(R * P, generator=g).reshape(R, P).to(torch.int32)
    hot_blocks = (torch.arange(R * (D // bs), dtype=torch.int32).reshape(R, -1) + R * P)
    slot_pos = torch.full((R, D), -1, dtype=torch.int32)
    held = torch.tensor(host[::2], dtype=torch.int32)
    slot_pos[1, torch.randperm(D, generator=g)[:held.numel()]] = held
    lru = torch.stack([torch.randperm(D, generator=g) for _ in range(R)]).to(torch.int16)
    case = ResolveCase(torch.tensor([row], dtype=torch.int32), i32([1]), residency,
                       host_blocks, hot_blocks, slot_pos, lru, bs)
    return case, len(resident)


@pytest.mark.parametrize("with_host", [False, True])
def test_resolve_counts_resident_positions_once_whatever_their_cells(with_host):
    """The fast path counts resident positions through representative cells, the CAS table
    only for positions that lost both cells: positions crowding one cell, pairs sharing both
    cells, every resident position repeated. Stats (and everything else) equal the
    reference, and nothing is handed to the general path."""
    if not fast_path_launched(2048, 4096, 64, 1024):
        pytest.skip("no fast path in this thread configuration")
    rng = random.Random(61 + with_host)
    for trial in range(3):
        case, num_resident = colliding_resident_case(rng, with_host)
        ref, gpu, handed = run_counted(case)
        assert_same(ref, gpu, f"trial {trial}")
        assert handed == 0
        assert int(gpu["stats"][0]) == num_resident


def fast_path_launched(k: int, num_slots: int, block_size: int, num_pages: int) -> bool:
    return bool(cuda_ops.resolve_launch_info(1, k, num_slots, block_size, num_pages,
                                             tuning=TUNING)["fast_path"])


def test_resolve_fast_path_hands_off_what_it_cannot_decide():
    """A repeated miss, a multi-token request, two slots holding one position: handed to the
    general path (counted), and the results still equal the reference."""
    rng = random.Random(52)
    if not fast_path_launched(512, 1024, 64, 256):
        pytest.skip("no fast path in this thread configuration")
    base = distinct_rows(big_case(rng, num_requests=4, tokens_per_request=1, k=512,
                                  num_slots=1024, block_size=64, num_pages=256,
                                  resident_fraction=0.2, hit_fraction=0.5))
    ref, gpu, handed = run_counted(base)
    assert_same(ref, gpu, "distinct")
    assert handed == 0
    # a repeated miss in request 0 (its first two host-backed misses made equal)
    rep = base.clone()
    r = int(rep.token_rows[0])
    held = set(rep.slot_pos[r].tolist())
    misses = [k for k, p in enumerate(rep.topk[0].tolist())
              if p >= 0 and int(rep.residency[r, p // 64]) < 0 and p not in held]
    rep.topk[0, misses[1]] = rep.topk[0, misses[0]]
    ref, gpu, handed = run_counted(rep)
    assert_same(ref, gpu, "repeated miss")
    assert handed == 1
    # a repeated hit or resident position stays on the fast path
    hit = base.clone()
    hits = [k for k, p in enumerate(hit.topk[0].tolist()) if p >= 0 and p in held]
    hit.topk[0, hits[1]] = hit.topk[0, hits[0]]
    ref, gpu, handed = run_counted(hit)
    assert_same(ref, gpu, "repeated hit")
    assert handed == 0
    # two slots of request 1 holding one position: no effect unless the request selects it
    # (then DUPLICATE_SLOT, reported by the general path as by the reference)
    r1 = int(base.token_rows[1])
    chosen = set(base.topk[1].tolist())
    unsel_slots = [s for s, p in enumerate(base.slot_pos[r1].tolist()) if p not in chosen]
    free = unsel_slots[0]  # a slot that no selection hits: overwriting it changes no hit
    unsel = int(base.slot_pos[r1, unsel_slots[1]])
    held1 = [p for p in base.slot_pos[r1].tolist() if p >= 0]
    dup = base.clone()
    dup.slot_pos[r1, free] = unsel
    ref, gpu, handed = run_counted(dup)
    assert_same(ref, gpu, "duplicate slot, not selected")
    assert handed == 0
    sel = next(p for p in held1 if p in chosen)
    dup = base.clone()
    dup.slot_pos[r1, free] = sel
    dup.topk = dup.topk[1:2].contiguous()
    dup.token_rows = dup.token_rows[1:2].contiguous()
    dup.out_rows = dup.miss_src = dup.miss_dst = dup.miss_count = None
    dup.__post_init__()
    expect_error(dup, ResolveErrorCode.DUPLICATE_SLOT)
    # multi-token requests: every one handed over, results exact
    multi = cap_distinct(big_case(rng, num_requests=3, tokens_per_request=2, k=512,
                                  num_slots=1024, block_size=64, num_pages=256,
                                  resident_fraction=0.2, hit_fraction=0.5, dup=0.1))
    ref, gpu, handed = run_counted(multi)
    assert_same(ref, gpu, "two tokens")
    assert handed == 3


@pytest.mark.parametrize("seed", range(2))
def test_resolve_random_partial_regions_and_classes(seed):
    """Partial hot regions (slots of -1 hot blocks never taken) and eviction classes
    (victims in (class, LRU) order): 2 x 300 random cases, bit for bit."""
    rng = random.Random(2000 + seed)
    for i in range(300):
        case = random_case(rng, partial_fraction=0.5, with_classes=i % 2 == 0)
        check_case(case, with_stats=(i % 5 != 0), what=f"seed {seed} case {i}")


def test_resolve_partial_regions_and_classes_multi_step():
    rng = random.Random(11)
    for i in range(40):
        case = random_case(rng, max_tokens_per_request=4, partial_fraction=0.5,
                           with_classes=True)
        ref = case.clone()
        gpu = case.clone(DEV)
        for step in range(4):
            if step:
                npos = case.residency.shape[1] * case.block_size
                ref.topk = torch.randint(-1, npos, tuple(case.topk.shape), dtype=torch.int32)
                ref = cap_distinct(ref)
                gpu.topk = ref.topk.to(DEV)
                classes = torch.randint(0, 6, tuple(case.slot_class.shape), dtype=torch.uint8)
                ref.slot_class = classes
                gpu.slot_class = classes.to(DEV)
            reference.resolve(*ref.args())
            cuda_ops.resolve(*gpu.args(), tuning=TUNING)
            cuda_ops.check_errors(DEV)
            assert_same(ref.state(), gpu.state(), f"case {i} step {step}")


def test_resolve_adversarial_cases():
    for name, case in adversarial_cases():
        check_case(case, what=name)


def test_resolve_classes_launch_the_general_kernel():
    """A launch with eviction classes runs the general kernel's class instantiation alone: the
    fast kernel (and its hand-off counter) is not launched."""
    rng = random.Random(5)
    case = distinct_rows(big_case(rng, num_requests=4, tokens_per_request=1, k=2048,
                                  num_slots=4096, block_size=64, num_pages=1024,
                                  resident_fraction=0.3, hit_fraction=0.6, dup=0.0))
    case.slot_class = torch.randint(0, 4, tuple(case.slot_pos.shape), dtype=torch.uint8)
    ref, gpu, handed = run_counted(case)
    assert_same(ref, gpu, "classes")
    assert handed == 0


def test_resolve_general_kernel_alone_random_cases():
    """The general path (the kernel the fast path hands over to, launched for every request
    through the probe API) on random cases, so it stays exact even where the fast path would
    take over."""
    rng = random.Random(53)
    for i in range(300):
        check_case(random_case(rng), with_stats=(i % 3 != 0), what=f"general case {i}",
                   general_only=True)
    case = big_case(rng, num_requests=4, tokens_per_request=1, k=2048, num_slots=4096,
                    block_size=64, num_pages=1024, resident_fraction=0.3, hit_fraction=0.6,
                    dup=0.05, padding=0.01)
    check_case(cap_distinct(case), what="general, production shape", general_only=True)


# --------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------


def test_cuda_graph_capture_and_replay_resolve_and_gather():
    rng = random.Random(31)
    K, D, bs, L, row_bytes = 256, 1024, 64, 2, 656
    case = big_case(rng, num_requests=6, tokens_per_request=2, k=K, num_slots=D,
                    block_size=bs, num_pages=128, resident_fraction=0.3, hit_fraction=0.5,
                    dup=0.05, padding=0.02)
    case = cap_distinct(case)
    R = case.residency.shape[0]
    P = case.residency.shape[1]
    host = layers(L, R * P * bs, row_bytes, "cpu", pinned=True, seed=32)
    dev_rows = (R * P + R * (D // bs)) * bs
    dev = layers(L, dev_rows, row_bytes, DEV, seed=33)
    dev_ref = [d.cpu().clone() for d in dev]

    gpu = case.clone(DEV)
    ref = case.clone()
    static_topk = gpu.topk
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    # warm-up outside capture (module load, error buffer)
    with torch.cuda.stream(stream):
        warm = case.clone(DEV)
        cuda_ops.resolve(*warm.args(), tuning=TUNING)
        cuda_ops.gather_rows(host, [d.clone() for d in dev], warm.miss_src, warm.miss_dst,
                             warm.miss_count)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_ops.resolve(*gpu.args(), tuning=TUNING)
        cuda_ops.gather_rows(host, dev, gpu.miss_src, gpu.miss_dst, gpu.miss_count)
    # capture executed nothing: the state is still the input
    torch.cuda.synchronize()
    assert torch.equal(gpu.lru.cpu(), case.lru)

    for step in range(5):
        if step:
            sel = ref.topk.clone()
            m = torch.rand(sel.shape) < 0.3
            sel[m] = torch.randint(0, P * bs, (int(m.sum()),), dtype=torch.int32)
            ref.topk = sel
            ref = cap_distinct(ref)
            static_topk.copy_(ref.topk.to(DEV))
        graph.replay()
        reference.resolve(*ref.args())
        reference.gather_rows(host, dev_ref, ref.miss_src, ref.miss_dst, ref.miss_count)
        torch.cuda.synchronize()
        assert_same(ref.state(), gpu.state(), f"replay {step}")
        for l in range(L):
            assert torch.equal(dev[l].cpu(), dev_ref[l]), f"replay {step} layer {l}"
    cuda_ops.check_errors(DEV)
