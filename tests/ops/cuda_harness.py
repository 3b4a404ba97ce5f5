"""What the CUDA kernel tests share (GPU only; imported by ``test_cuda_*.py``, whose
module skips it holds): the device, the tuning under test, running a resolve case on both backends and
comparing every output, the error check, large and capped cases, and random layers."""

from __future__ import annotations

import os
import random

import pytest
import torch

# The skips every CUDA test module shares: importing this harness skips the importing module
# (at collection) where there is no GPU or the extension has no kernels.
if not torch.cuda.is_available():  # pragma: no cover - CPU CI
    pytest.skip("needs a CUDA device", allow_module_level=True)
cuda_ops = pytest.importorskip("vllm_hisparse.ops.cuda")
if not cuda_ops.available():  # pragma: no cover
    pytest.skip("vllm_hisparse._C has no data-plane kernels", allow_module_level=True)

from resolve_cases import ResolveCase, i32  # noqa: E402
from vllm_hisparse.ops import probe, reference  # noqa: E402
from vllm_hisparse.ops.errors import ResolveError, ResolveErrorCode  # noqa: E402
from vllm_hisparse.ops.tuning import KernelTuning  # noqa: E402

DEV = torch.device("cuda")
# The kernels' tuning under test. scripts/gpu_session.sh runs the resolve tests a second time
# with 512-thread CTAs (HISPARSE_RESOLVE_THREADS=512): read here only, into the tuning the
# launches are given (the package has no process-wide tuning).
TUNING = KernelTuning(resolve_threads=int(os.environ.get("HISPARSE_RESOLVE_THREADS", "0") or 0))
OUTPUTS = ("out_rows", "miss_src", "miss_dst", "miss_count", "slot_pos", "lru", "stats")


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


def simple_case(**over) -> ResolveCase:
    bs, P, D = 4, 8, 8
    args = dict(
        topk=i32([[12, 16, 25, 30]]), token_rows=i32([0]),
        residency=i32([[-1] * 7 + [9]]), host_blocks=i32([[100 + p for p in range(P)]]),
        hot_blocks=i32([[20, 21]]), slot_pos=i32([list(range(10, 18))]),
        lru=torch.arange(D, dtype=torch.int16).reshape(1, D), block_size=bs)
    args.update(over)
    return ResolveCase(**args)


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
