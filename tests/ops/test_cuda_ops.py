"""The CUDA data-plane kernels against their pure-torch twins, bit for bit (GPU only).

resolve: >= 1,000 random cases plus adversarial ones (duplicates, padding, empty batch, all
resident, all miss, D = 32,768 with an int16 lru, K = 2048, block 64, 4-token spec-decode
requests, requests past the kernel's register chunk of 8 selections per thread, multi-step
state evolution) and every error code (also first referenced past that chunk); gather_rows / copy_blocks /
mirror_rows byte for byte with untouched destination rows checked; a CUDA-graph capture and
replay of resolve + gather.
"""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch

from resolve_cases import ResolveCase, adversarial_cases, i32, random_case
from vllm_hisparse.ops import probe, reference
from vllm_hisparse.ops.errors import ResolveError, ResolveErrorCode
from vllm_hisparse.ops.tuning import KernelTuning

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device", allow_module_level=True)

cuda_ops = pytest.importorskip("vllm_hisparse.ops.cuda")
if not cuda_ops.available():  # pragma: no cover
    pytest.skip("vllm_hisparse._C has no data-plane kernels", allow_module_level=True)

DEV = torch.device("cuda")
# The kernels' tuning under test. scripts/gpu_session.sh runs the resolve tests a second time
# with 512-thread CTAs (HISPARSE_RESOLVE_THREADS=512): read here only, into the tuning the
# launches are given (the package has no process-wide tuning).
TUNING = KernelTuning(resolve_threads=int(os.environ.get("HISPARSE_RESOLVE_THREADS", "0") or 0))
OUTPUTS = ("out_rows", "miss_src", "miss_dst", "miss_count", "slot_pos", "lru", "stats")


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def run_both(case: ResolveCase, with_stats: bool = True, tuning: KernelTuning | None = None,
             general_only: bool = False):
    """(reference result on CPU, kernel result on GPU) as dicts of CPU tensors; the kernel
    runs with `tuning` (default TUNING), the general kernel alone with `general_only`."""
    ref = case.clone()
    gpu = case.clone(DEV)
    ref_stats = ref.stats if with_stats else None
    gpu_stats = gpu.stats if with_stats else None
    args_ref = ref.args()[:12] + (ref_stats,) + ref.args()[13:]  # [13:]: slot_class, if any
    args_gpu = gpu.args()[:12] + (gpu_stats,) + gpu.args()[13:]
    reference.resolve(*args_ref)
    tuning = TUNING if tuning is None else tuning
    if general_only:
        probe.resolve(*args_gpu, tuning=tuning, general_only=True)
    else:
        cuda_ops.resolve(*args_gpu, tuning=tuning)
    cuda_ops.check_errors(DEV)
    return ref.state(), gpu.state()


def assert_same(ref: dict, gpu: dict, what: str = "") -> None:
    for name in OUTPUTS:
        a, b = ref[name], gpu[name]
        if not torch.equal(a, b):
            diff = (a != b).nonzero()[:5].tolist()
            raise AssertionError(f"{what}: {name} differs at {diff}: ref "
                                 f"{[a[tuple(i)].item() for i in diff]} gpu "
                                 f"{[b[tuple(i)].item() for i in diff]}")


def check_case(case: ResolveCase, with_stats: bool = True, what: str = "",
               tuning: KernelTuning | None = None, general_only: bool = False) -> None:
    ref, gpu = run_both(case, with_stats, tuning, general_only)
    assert_same(ref, gpu, what)


def expect_error(case: ResolveCase, code: ResolveErrorCode) -> ResolveError:
    """The reference raises `code`; the kernel records the same record (raised by
    check_errors), and leaves the failed request's hot state untouched."""
    ref = case.clone()
    with pytest.raises(ResolveError) as ref_info:
        reference.resolve(*ref.args())
    assert ref_info.value.code == code
    gpu = case.clone(DEV)
    before = gpu.state()
    cuda_ops.resolve(*gpu.args(), tuning=TUNING)
    with pytest.raises(ResolveError) as gpu_info:
        cuda_ops.check_errors(DEV)
    e = gpu_info.value
    r = ref_info.value
    assert (e.code, e.state_row, e.detail_a, e.detail_b) == (r.code, r.state_row, r.detail_a,
                                                             r.detail_b), (str(e), str(r))
    after = gpu.state()
    # Only one request in these cases: nothing of the hot state or stats changed.
    for name in ("slot_pos", "lru", "stats"):
        assert torch.equal(before[name], after[name]), name
    cuda_ops.check_errors(DEV)  # cleared: raises no more
    return e


def big_case(rng: random.Random, *, num_requests: int, tokens_per_request: int, k: int,
             num_slots: int, block_size: int, num_pages: int, resident_fraction: float,
             hit_fraction: float, padding: float = 0.0, dup: float = 0.0) -> ResolveCase:
    """A production-shaped case: every request selects `k` positions per token, a share of
    them held by hot slots (hits), the rest host-backed or resident."""
    bs = block_size
    R = num_requests + 2
    P = num_pages
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    residency = torch.where(torch.rand(R, P, generator=g) < resident_fraction,
                            torch.randperm(R * P, generator=g).reshape(R, P).to(torch.int32),
                            torch.full((R, P), -1, dtype=torch.int32))
    host_blocks = torch.randperm(R * P, generator=g).reshape(R, P).to(torch.int32)
    hot_blocks = (torch.randperm(R * (num_slots // bs), generator=g).reshape(R, -1)
                  .to(torch.int32) + R * P)
    slot_pos = torch.full((R, num_slots), -1, dtype=torch.int32)
    lru = torch.empty((R, num_slots), dtype=torch.int16)
    npos = P * bs
    host_positions = []
    for r in range(R):
        res_page = residency[r] >= 0
        pos_host = torch.nonzero(~res_page.repeat_interleave(bs)).flatten()
        host_positions.append(pos_host)
        n_held = min(num_slots, pos_host.numel())
        held = pos_host[torch.randperm(pos_host.numel(), generator=g)[:n_held]]
        slots = torch.randperm(num_slots, generator=g)[:n_held]
        slot_pos[r, slots] = held.to(torch.int32)
        lru[r] = torch.randperm(num_slots, generator=g).to(torch.int16)
    token_rows = []
    topk_rows = []
    for i in range(num_requests):
        r = i + 1
        held = slot_pos[r][slot_pos[r] >= 0]
        budget = num_slots  # distinct host-backed positions allowed
        for _ in range(tokens_per_request):
            n_hit = int(k * hit_fraction)
            sel_hit = held[torch.randint(0, max(1, held.numel()), (n_hit,), generator=g)] \
                if held.numel() else torch.empty(0, dtype=torch.int32)
            sel_other = torch.randint(0, npos, (k - sel_hit.numel(),), generator=g,
                                      dtype=torch.int32)
            sel = torch.cat([sel_hit.to(torch.int32), sel_other])
            sel = sel[torch.randperm(k, generator=g)]
            if dup:
                m = torch.rand(k, generator=g) < dup
                sel[m] = sel[torch.randint(0, k, (int(m.sum()),), generator=g)]
            if padding:
                sel[torch.rand(k, generator=g) < padding] = -1
            topk_rows.append(sel)
            token_rows.append(r)
        del budget
    topk = torch.stack(topk_rows) if topk_rows else torch.zeros((0, k), dtype=torch.int32)
    return ResolveCase(topk.contiguous(), i32(token_rows).reshape(-1), residency, host_blocks,
                       hot_blocks, slot_pos, lru, bs)


def cap_distinct(case: ResolveCase) -> ResolveCase:
    """Turn selections into padding past the leased slots' worth (D when every hot block is
    leased) of distinct host-backed positions per request."""
    bs = case.block_size
    topk = case.topk.clone()
    rows = case.token_rows.tolist()
    t = 0
    while t < len(rows):
        r = rows[t]
        t1 = t
        while t1 < len(rows) and rows[t1] == r:
            t1 += 1
        if r >= 0:
            D = int((case.hot_blocks[r] >= 0).sum()) * bs
            flat = topk[t:t1].reshape(-1)
            valid = flat >= 0
            hostb = valid.clone()
            hostb[valid] = case.residency[r][(flat[valid] // bs).long()] < 0
            seen = {}
            for i in torch.nonzero(hostb).flatten().tolist():
                p = int(flat[i])
                if p not in seen:
                    if len(seen) >= D:
                        flat[i] = -1
                        continue
                    seen[p] = True
            topk[t:t1] = flat.reshape(t1 - t, -1)
        t = t1
    case.topk = topk
    return case


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
                nxt = random_case(random.Random(rng.randrange(1 << 30)))
                # new selections within the same position range, same token layout
                npos = case.residency.shape[1] * case.block_size
                sel = torch.randint(-1, npos, tuple(case.topk.shape), dtype=torch.int32)
                del nxt
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


def distinct_rows(case: ResolveCase) -> ResolveCase:
    """Repeated positions within a token's row become padding (the indexer's top-k has none)."""
    topk = case.topk.clone()
    for t in range(topk.shape[0]):
        seen = set()
        for k, p in enumerate(topk[t].tolist()):
            if p >= 0 and p in seen:
                topk[t, k] = -1
            seen.add(p)
    case.topk = topk.contiguous()
    return case


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
# resolve: errors
# --------------------------------------------------------------------------------------


def simple_case(**over) -> ResolveCase:
    bs, P, D = 4, 8, 8
    args = dict(
        topk=i32([[12, 16, 25, 30]]), token_rows=i32([0]),
        residency=i32([[-1] * 7 + [9]]), host_blocks=i32([[100 + p for p in range(P)]]),
        hot_blocks=i32([[20, 21]]), slot_pos=i32([list(range(10, 18))]),
        lru=torch.arange(D, dtype=torch.int16).reshape(1, D), block_size=bs)
    args.update(over)
    return ResolveCase(**args)


def test_error_position_out_of_range():
    expect_error(simple_case(topk=i32([[12, 40, 25, -3]])), ResolveErrorCode.POSITION_OUT_OF_RANGE)
    expect_error(simple_case(topk=i32([[12, -2, 25, 30]])), ResolveErrorCode.POSITION_OUT_OF_RANGE)


def test_error_no_host_block():
    expect_error(simple_case(host_blocks=i32([[100, 101, 102, 103, 104, 105, -1, 107]])),
                 ResolveErrorCode.NO_HOST_BLOCK)


def test_error_hot_overflow():
    expect_error(simple_case(topk=i32([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]]),
                             slot_pos=i32([[-1] * 8])), ResolveErrorCode.HOT_OVERFLOW)


def test_error_not_contiguous():
    case = simple_case(topk=i32([[12, 16, 25, 30], [1, 2, 3, 4], [5, 6, 7, 8]]),
                       token_rows=i32([0, 1, 0]),
                       residency=i32([[-1] * 7 + [9]] * 2),
                       host_blocks=i32([[100 + p for p in range(8)]] * 2),
                       hot_blocks=i32([[20, 21], [22, 23]]),
                       slot_pos=i32([list(range(10, 18))] * 2),
                       lru=torch.arange(8, dtype=torch.int16).repeat(2, 1))
    ref = case.clone()
    with pytest.raises(ResolveError) as info:
        reference.resolve(*ref.args())
    assert info.value.code == ResolveErrorCode.NOT_CONTIGUOUS
    gpu = case.clone(DEV)
    cuda_ops.resolve(*gpu.args(), tuning=TUNING)
    with pytest.raises(ResolveError) as ginfo:
        cuda_ops.check_errors(DEV)
    g = ginfo.value
    assert (g.code, g.state_row, g.detail_a, g.detail_b) == (
        info.value.code, info.value.state_row, info.value.detail_a, info.value.detail_b)
    # row 0's tokens are all failed; row 1 resolved
    st = gpu.state()
    assert st["out_rows"][0].tolist() == [-1] * 4 and st["out_rows"][2].tolist() == [-1] * 4
    assert st["miss_count"][[0, 2]].tolist() == [0, 0]
    assert torch.equal(st["lru"][0], case.lru[0])


def test_error_state_row_out_of_range():
    expect_error(simple_case(token_rows=i32([3])), ResolveErrorCode.STATE_ROW_OUT_OF_RANGE)
    expect_error(simple_case(token_rows=i32([-4])), ResolveErrorCode.STATE_ROW_OUT_OF_RANGE)


def test_error_hot_block_missing_on_a_hit():
    """A slot of a -1 hot block still holding a position (corrupt: it must be empty) and
    selected: HOT_BLOCK_MISSING. Misses never take such slots, so they cannot fail so."""
    # the hit on slot 6 (block 1) comes first
    expect_error(simple_case(topk=i32([[16, 25, 12, 30]]), hot_blocks=i32([[20, -1]])),
                 ResolveErrorCode.HOT_BLOCK_MISSING)
    # the miss 25 comes first but takes slot 4 (block 1); the hit on slot 2 (block 0) fails
    expect_error(simple_case(topk=i32([[25, 16, 12, 30]]), hot_blocks=i32([[-1, 21]])),
                 ResolveErrorCode.HOT_BLOCK_MISSING)
    # the error is reported after a corrupt lru (the reference's check order)
    expect_error(simple_case(topk=i32([[12, 25]]), hot_blocks=i32([[-1, 21]]),
                             lru=i32([[4, 5, 6, 7, 0, 1, 2, 99]]).to(torch.int16)),
                 ResolveErrorCode.CORRUPT_LRU)


def test_error_hot_overflow_counts_leased_slots():
    empty = i32([[-1] * 8])
    expect_error(simple_case(topk=i32([[0, 1, 2, 3, 4]]), hot_blocks=i32([[-1, 21]]),
                             slot_pos=empty), ResolveErrorCode.HOT_OVERFLOW)
    expect_error(simple_case(topk=i32([[0]]), hot_blocks=i32([[-1, -1]]), slot_pos=empty),
                 ResolveErrorCode.HOT_OVERFLOW)
    check_case(simple_case(topk=i32([[0, 1, 2, 3]]), hot_blocks=i32([[-1, 21]]),
                           slot_pos=empty), what="4 misses in 4 leased slots")


def test_error_duplicate_slot():
    expect_error(simple_case(slot_pos=i32([[10, 11, 12, 13, 16, 15, 16, 17]])),
                 ResolveErrorCode.DUPLICATE_SLOT)
    expect_error(simple_case(slot_pos=i32([[16, 11, 12, 13, 16, 15, 16, 17]])),
                 ResolveErrorCode.DUPLICATE_SLOT)


def test_error_union_capacity_kernel_limit():
    bs = 64
    case = simple_case(topk=torch.arange(0, 256, dtype=torch.int32).reshape(2, 128),
                       token_rows=i32([0, 0]), residency=i32([[-1] * 8]),
                       host_blocks=i32([list(range(8))]), hot_blocks=i32([list(range(4))]),
                       slot_pos=torch.full((1, 256), -1, dtype=torch.int32),
                       lru=torch.arange(256, dtype=torch.int16).reshape(1, 256),
                       block_size=bs)
    gpu = case.clone(DEV)
    cuda_ops.resolve(*gpu.args(), tuning=dataclasses.replace(TUNING, max_tokens_per_request=1))
    with pytest.raises(ResolveError) as info:
        cuda_ops.check_errors(DEV)
    assert info.value.code == ResolveErrorCode.UNION_CAPACITY
    # with the right bound it resolves like the reference
    check_case(case, tuning=dataclasses.replace(TUNING, max_tokens_per_request=2))


def test_error_corrupt_lru():
    case = simple_case(lru=i32([[0, 1, 2, 3, 4, 5, 6, 99]]).to(torch.int16))
    gpu = case.clone(DEV)
    cuda_ops.resolve(*gpu.args(), tuning=TUNING)
    with pytest.raises(ResolveError) as info:
        cuda_ops.check_errors(DEV)
    assert info.value.code == ResolveErrorCode.CORRUPT_LRU
    assert info.value.detail_a == 99


def test_error_is_raised_by_a_later_call_without_sync():
    bad = simple_case(topk=i32([[12, 40, 25, 30]])).clone(DEV)
    good = simple_case().clone(DEV)
    cuda_ops.resolve(*bad.args(), tuning=TUNING)  # records the error; does not raise here
    torch.cuda.synchronize()
    with pytest.raises(ResolveError) as info:
        cuda_ops.resolve(*good.args(), tuning=TUNING)
    assert info.value.code == ResolveErrorCode.POSITION_OUT_OF_RANGE
    assert info.value.state_row == 0 and info.value.detail_a == 40
    cuda_ops.resolve(*good.args(), tuning=TUNING)  # cleared
    cuda_ops.check_errors()


def test_error_request_isolated_from_good_requests():
    """A failing request does not disturb the others of the launch."""
    rng = random.Random(21)
    case = big_case(rng, num_requests=4, tokens_per_request=2, k=128, num_slots=512,
                    block_size=64, num_pages=32, resident_fraction=0.3, hit_fraction=0.5)
    case = cap_distinct(case)
    good_ref = case.clone()
    reference.resolve(*good_ref.args())
    bad = case.clone()
    bad.topk[2, 5] = 10 ** 6  # request of tokens 2-3 fails
    gpu = bad.clone(DEV)
    cuda_ops.resolve(*gpu.args(), tuning=TUNING)
    with pytest.raises(ResolveError):
        cuda_ops.check_errors(DEV)
    st = gpu.state()
    ref = good_ref.state()
    bad_row = int(case.token_rows[2])
    for t in (0, 1, 4, 5, 6, 7):
        assert torch.equal(st["out_rows"][t], ref["out_rows"][t])
        assert st["miss_count"][t] == ref["miss_count"][t]
    assert st["out_rows"][2:4].eq(-1).all() and st["miss_count"][2:4].eq(0).all()
    assert torch.equal(st["lru"][bad_row], case.lru[bad_row])
    assert torch.equal(st["slot_pos"][bad_row], case.slot_pos[bad_row])
    for r in set(case.token_rows.tolist()) - {bad_row}:
        assert torch.equal(st["lru"][r], ref["lru"][r])
        assert torch.equal(st["slot_pos"][r], ref["slot_pos"][r])


# --------------------------------------------------------------------------------------
# copies
# --------------------------------------------------------------------------------------


def layers(n, rows, row_bytes, device, pinned=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)
        if device == "cpu" and pinned:
            t = t.pin_memory()
        elif device != "cpu":
            t = t.to(device)
        out.append(t)
    return out


def random_plan(T, K, src_rows, dst_rows, seed):
    g = torch.Generator().manual_seed(seed)
    count = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
    count[torch.rand(T, generator=g) < 0.3] = 0
    if T:
        count[0] = K
    total = int(count.sum())
    dst_ids = torch.randperm(dst_rows, generator=g)[:total].to(torch.int32)
    src = torch.full((T, K), -5, dtype=torch.int32)
    dst = torch.full((T, K), -5, dtype=torch.int32)
    i = 0
    for t in range(T):
        c = int(count[t])
        src[t, :c] = torch.randint(0, src_rows, (c,), generator=g, dtype=torch.int32)
        dst[t, :c] = dst_ids[i:i + c]
        i += c
    return src, dst, count


@pytest.mark.parametrize("row_bytes", [656, 1152, 64, 16, 592])
@pytest.mark.parametrize("rows_per_warp", [0, 1, 2, 4, 8, 16])
def test_gather_rows_matches_reference(row_bytes, rows_per_warp):
    L, T, K = 3, 7, 40
    src_rows, dst_rows = 2000, 600
    src_host = layers(L, src_rows, row_bytes, "cpu", pinned=True, seed=1)
    dst_dev = layers(L, dst_rows, row_bytes, DEV, seed=2)
    expected = [d.cpu().clone() for d in dst_dev]
    ms, md, mc = random_plan(T, K, src_rows, dst_rows, seed=row_bytes + rows_per_warp)
    reference.gather_rows(src_host, expected, ms, md, mc)
    cuda_ops.gather_rows_tuned(src_host, dst_dev, ms.to(DEV), md.to(DEV), mc.to(DEV),
                               rows_per_warp=rows_per_warp, ctas_per_sm=0)
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst_dev[l].cpu(), expected[l]), f"layer {l}"


@pytest.mark.parametrize("max_ctas", [1, 3, 1000])
def test_gather_rows_with_a_capped_grid_copies_every_row(max_ctas):
    # The side-stream prefetch caps the grid (a few CTAs stride over every item): a grid of
    # 1 CTA must still copy each of the 3 x ~700 rows, and a cap above the grid is a no-op.
    L, T, K = 3, 31, 48
    src_host = layers(L, 3000, 656, "cpu", pinned=True, seed=11)
    dst_dev = layers(L, 2000, 656, DEV, seed=12)
    expected = [d.cpu().clone() for d in dst_dev]
    ms, md, mc = random_plan(T, K, 3000, 2000, seed=13)
    reference.gather_rows(src_host, expected, ms, md, mc)
    cuda_ops.gather_rows_tuned(src_host, dst_dev, ms.to(DEV), md.to(DEV), mc.to(DEV),
                               rows_per_warp=None, ctas_per_sm=None, max_ctas=max_ctas)
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst_dev[l].cpu(), expected[l]), f"layer {l}"


def test_gather_rows_rejects_a_negative_grid_cap():
    t = torch.zeros((1, 1), dtype=torch.int32, device=DEV)
    lay = layers(1, 4, 656, DEV, seed=1)
    with pytest.raises(ValueError, match="max_ctas"):
        cuda_ops.gather_rows_tuned(lay, lay, t, t, t[0], rows_per_warp=None, ctas_per_sm=None,
                                   max_ctas=-1)


def test_gather_rows_default_tuning_and_device_source():
    L, T, K = 2, 33, 100
    src = layers(L, 5000, 656, DEV, seed=3)
    dst = layers(L, 4000, 656, DEV, seed=4)
    expected = [d.cpu().clone() for d in dst]
    ms, md, mc = random_plan(T, K, 5000, 4000, seed=5)
    reference.gather_rows([s.cpu() for s in src], expected, ms, md, mc)
    cuda_ops.gather_rows(src, dst, ms.to(DEV), md.to(DEV), mc.to(DEV))
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst[l].cpu(), expected[l])


def test_gather_rows_zero_counts_touch_nothing():
    src = layers(1, 100, 656, "cpu", pinned=True, seed=6)
    dst = layers(1, 100, 656, DEV, seed=7)
    before = dst[0].cpu().clone()
    ms = torch.zeros((4, 8), dtype=torch.int32, device=DEV)
    cuda_ops.gather_rows(src, dst, ms, ms.clone(), torch.zeros(4, dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(dst[0].cpu(), before)


def test_many_layers_split_launches():
    L = 70  # more than one launch's pointer table (64)
    src = layers(L, 64, 32, "cpu", pinned=True, seed=8)
    dst = layers(L, 64, 32, DEV, seed=9)
    expected = [d.cpu().clone() for d in dst]
    sr = torch.tensor([3, -1, 7, 9, 63], dtype=torch.int32)
    dr = torch.tensor([0, 5, -1, 9, 1], dtype=torch.int32)
    reference.mirror_rows(src, expected, sr, dr)
    cuda_ops.mirror_rows(src, dst, sr.to(DEV), dr.to(DEV))
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst[l].cpu(), expected[l]), l


@pytest.mark.parametrize("row_bytes", [656, 1152, 48])
@pytest.mark.parametrize("direction", ["spill", "restore"])
def test_copy_blocks_matches_reference(row_bytes, direction):
    L, bs = 2, 64
    dev_blocks, host_blocks = 20, 30
    dev = layers(L, dev_blocks * bs, row_bytes, DEV, seed=10)
    host = layers(L, host_blocks * bs, row_bytes, "cpu", pinned=True, seed=11)
    src, dst = (dev, host) if direction == "spill" else (host, dev)
    n_src = dev_blocks if direction == "spill" else host_blocks
    n_dst = host_blocks if direction == "spill" else dev_blocks
    sb = torch.randperm(n_src)[:8].to(torch.int32)
    db = torch.randperm(n_dst)[:8].to(torch.int32)
    sb[2] = -1
    db[5] = -1
    expected = [d.cpu().clone() for d in dst]
    reference.copy_blocks([s.cpu() for s in src], expected, sb, db, bs)
    cuda_ops.copy_blocks(src, dst, sb.to(DEV), db.to(DEV), bs)
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(dst[l].cpu(), expected[l])


@pytest.mark.parametrize("row_bytes", [656, 1152, 80])
def test_mirror_rows_matches_reference(row_bytes):
    L = 4
    dev = layers(L, 1000, row_bytes, DEV, seed=12)
    host = layers(L, 3000, row_bytes, "cpu", pinned=True, seed=13)
    sr = torch.randperm(1000)[:300].to(torch.int32)
    dr = torch.randperm(3000)[:300].to(torch.int32)
    sr[::7] = -1
    dr[::11] = -1
    expected = [h.clone() for h in host]
    reference.mirror_rows([d.cpu() for d in dev], expected, sr, dr)
    cuda_ops.mirror_rows(dev, host, sr.to(DEV), dr.to(DEV))
    torch.cuda.synchronize()
    for l in range(L):
        assert torch.equal(host[l], expected[l])


# row-strided layer views (position-major host pool: layer l = rows of stride L * row_bytes)


def strided(L, rows, row_bytes, device, pinned=False, seed=0, pad=0):
    """(buffer [rows, L * row_bytes + pad], L row-strided views). ``pad`` bytes per position
    after the last layer make the stride larger than L * row_bytes (still a multiple of 16)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (rows, L * row_bytes + pad), dtype=torch.uint8, generator=g)
    if device == "cpu" and pinned:
        buf = buf.pin_memory()
    elif device != "cpu":
        buf = buf.to(device)
    views = [buf[:, l * row_bytes:(l + 1) * row_bytes] for l in range(L)]
    return buf, views


def cpu_twin(buf, L, row_bytes):
    t = buf.cpu().clone()
    return t, [t[:, l * row_bytes:(l + 1) * row_bytes] for l in range(L)]


@pytest.mark.parametrize("row_bytes", [656, 1152, 48, 592])
@pytest.mark.parametrize("rows_per_warp", [0, 1, 4, 16])
@pytest.mark.parametrize("pair_major", [True, False])
def test_gather_rows_row_strided_host_and_device(row_bytes, rows_per_warp, pair_major):
    L, T, K = 3, 6, 50
    src_rows, dst_rows = 1500, 500
    sbuf, src = strided(L, src_rows, row_bytes, "cpu", pinned=True, seed=41)
    dbuf, dst = strided(L, dst_rows, row_bytes, DEV, seed=42, pad=16)
    sbuf_before = sbuf.clone()
    twin, twin_layers = cpu_twin(dbuf, L, row_bytes)
    ms, md, mc = random_plan(T, K, src_rows, dst_rows, seed=row_bytes + rows_per_warp)
    reference.gather_rows(src, twin_layers, ms, md, mc)
    cuda_ops.gather_rows_tuned(src, dst, ms.to(DEV), md.to(DEV), mc.to(DEV),
                               rows_per_warp=rows_per_warp, ctas_per_sm=0,
                               pair_major=pair_major)
    torch.cuda.synchronize()
    assert torch.equal(dbuf.cpu(), twin)  # every byte: copied rows, untouched rows, padding
    assert torch.equal(sbuf, sbuf_before)


@pytest.mark.parametrize("row_bytes", [656, 1152, 48])
def test_copy_blocks_and_mirrors_row_strided_host(row_bytes):
    L, bs = 3, 64
    hbuf, host = strided(L, 30 * bs, row_bytes, "cpu", pinned=True, seed=43)
    dev = layers(L, 20 * bs, row_bytes, DEV, seed=44)
    sb = torch.randperm(20)[:8].to(torch.int32)
    hb = torch.randperm(30)[:8].to(torch.int32)
    sb[2] = -1
    hb[5] = -1
    twin, twin_layers = cpu_twin(hbuf, L, row_bytes)
    reference.copy_blocks([d.cpu() for d in dev], twin_layers, sb, hb, bs)
    cuda_ops.copy_blocks(dev, host, sb.to(DEV), hb.to(DEV), bs)  # spill
    torch.cuda.synchronize()
    assert torch.equal(hbuf, twin)
    expect = [d.cpu() for d in dev]
    reference.copy_blocks(host, expect, hb, sb, bs)
    dev2 = [d.clone() for d in dev]
    cuda_ops.copy_blocks(host, dev2, hb.to(DEV), sb.to(DEV), bs)  # restore
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dev2, expect))
    sr = torch.randperm(20 * bs)[:200].to(torch.int32)
    dr = torch.randperm(30 * bs)[:200].to(torch.int32)
    sr[::7] = -1
    dr[::11] = -1
    reference.mirror_rows([d.cpu() for d in dev], twin_layers, sr, dr)
    cuda_ops.mirror_rows(dev, host, sr.to(DEV), dr.to(DEV))
    torch.cuda.synchronize()
    assert torch.equal(hbuf, twin)


def test_layer_list_with_mixed_strides_is_split_into_runs():
    L, rb = 4, 656
    sbuf, strided_src = strided(2, 800, rb, "cpu", pinned=True, seed=45)
    dense_src = layers(2, 800, rb, "cpu", pinned=True, seed=46)
    src = [dense_src[0], strided_src[0], strided_src[1], dense_src[1]]
    dst = layers(L, 300, rb, DEV, seed=47)
    expect = [d.cpu() for d in dst]
    ms, md, mc = random_plan(3, 64, 800, 300, seed=48)
    reference.gather_rows(src, expect, ms, md, mc)
    from vllm_hisparse import ops
    ops.gather_rows(src, dst, ms.to(DEV), md.to(DEV), mc.to(DEV))
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dst, expect))


def test_bad_row_stride_rejected():
    buf = torch.zeros((10, 3 * 656 + 8), dtype=torch.uint8).pin_memory()  # stride % 16 != 0
    src = [buf[:, :656]]
    dst = layers(1, 10, 656, DEV)
    z = torch.zeros((1, 2), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda_ops.gather_rows(src, dst, z, z, torch.zeros(1, dtype=torch.int32, device=DEV))


def test_row_size_not_multiple_of_16_rejected():
    src = layers(1, 10, 24, "cpu", pinned=True)
    dst = layers(1, 10, 24, DEV)
    z = torch.zeros((1, 2), dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="multiple of 16"):
        cuda_ops.gather_rows(src, dst, z, z, torch.zeros(1, dtype=torch.int32, device=DEV))


def test_public_ops_dispatch_to_cuda():
    from vllm_hisparse import ops
    case = simple_case()
    ref, _ = run_both(case)
    gpu = case.clone(DEV)
    ops.resolve(*gpu.args())
    torch.cuda.synchronize()
    assert_same(ref, gpu.state())


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
