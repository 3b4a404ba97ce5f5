"""The reference ``resolve`` against docs/design.md, "Op contracts", `resolve`: the worked example, one case per rule,
every error case, and random cases against a deliberately naive implementation."""

from __future__ import annotations

import random
import re

import pytest
import torch

from resolve_cases import (ResolveCase, adversarial_cases, i32, input_defect_cases,
                          random_case)
from vllm_hisparse import ops
from vllm_hisparse.ops import errors, reference
from vllm_hisparse.ops.errors import ResolveError, ResolveErrorCode


# --------------------------------------------------------------------------------------
# A naive implementation: plain Python lists and dicts, written straight from the rules.
# --------------------------------------------------------------------------------------

class NaiveError(Exception):
    def __init__(self, code):
        self.code = code


def naive_resolve(case: ResolveCase):
    topk = case.topk.tolist()
    token_rows = case.token_rows.tolist()
    residency = case.residency.tolist()
    host_blocks = case.host_blocks.tolist()
    hot_blocks = case.hot_blocks.tolist()
    slot_pos = case.slot_pos.tolist()
    lru = case.lru.tolist()
    classes = None if case.slot_class is None else case.slot_class.tolist()
    bs = case.block_size
    num_rows = len(residency)
    num_positions = (len(residency[0]) if residency else 0) * bs
    num_slots = len(slot_pos[0]) if slot_pos else 0
    k = case.topk.shape[1]

    # requests
    requests = []  # (row, [token indices])
    done = set()
    t = 0
    while t < len(token_rows):
        r = token_rows[t]
        if r < -1 or r >= num_rows:
            raise NaiveError(ResolveErrorCode.STATE_ROW_OUT_OF_RANGE)
        if r == -1:
            t += 1
            continue
        toks = []
        while t < len(token_rows) and token_rows[t] == r:
            toks.append(t)
            t += 1
        if r in done:
            raise NaiveError(ResolveErrorCode.NOT_CONTIGUOUS)
        done.add(r)
        requests.append((r, toks))

    out = [[-1] * k for _ in topk]
    copies = {}  # first token -> list of (src, dst)
    new_slot_pos = [list(x) for x in slot_pos]
    new_lru = [list(x) for x in lru]
    stats = [0, 0, 0]
    for r, toks in requests:
        order = []
        for tt in toks:
            for p in topk[tt]:
                if p < -1 or p >= num_positions:
                    raise NaiveError(ResolveErrorCode.POSITION_OUT_OF_RANGE)
                if p >= 0 and p not in order:
                    order.append(p)
        row_of = {}
        host_backed = []
        for p in order:
            blk = residency[r][p // bs]
            if blk >= 0:
                row_of[p] = blk * bs + p % bs
                stats[0] += 1
            else:
                if host_blocks[r][p // bs] < 0:
                    raise NaiveError(ResolveErrorCode.NO_HOST_BLOCK)
                host_backed.append(p)
        leased = [s for s in range(num_slots) if hot_blocks[r][s // bs] >= 0]
        if len(host_backed) > len(leased):
            raise NaiveError(ResolveErrorCode.HOT_OVERFLOW)
        plan = []
        if host_backed:
            hit_slot = {}
            for p in host_backed:
                holders = [s for s in range(num_slots) if slot_pos[r][s] == p]
                if len(holders) > 1:
                    raise NaiveError(ResolveErrorCode.DUPLICATE_SLOT)
                if holders:
                    hit_slot[p] = holders[0]
            if any(not 0 <= s < num_slots for s in lru[r]):
                raise NaiveError(ResolveErrorCode.CORRUPT_LRU)
            if len(set(lru[r])) != num_slots:
                raise NaiveError(ResolveErrorCode.DUPLICATE_LRU_SLOT)
            for p in host_backed:  # a hit on a slot without a hot block
                if p in hit_slot and hot_blocks[r][hit_slot[p] // bs] < 0:
                    raise NaiveError(ResolveErrorCode.HOT_BLOCK_MISSING)
            hit_slots = set(hit_slot.values())
            unleased = [s for s in lru[r] if s not in hit_slots and s not in leased]
            evictable = [s for s in lru[r] if s not in hit_slots and s in leased]
            misses = [p for p in host_backed if p not in hit_slot]
            # lowest class first (values above 3 are 3), LRU order within a class
            by_class = sorted(evictable, key=lambda s: min(classes[r][s], 3) if classes else 0)
            taken = by_class[:len(misses)]
            slot_of = dict(hit_slot)
            for p, s in zip(misses, taken):
                slot_of[p] = s
            for p in host_backed:
                s = slot_of[p]
                row_of[p] = hot_blocks[r][s // bs] * bs + s % bs
            for p, s in zip(misses, taken):
                new_slot_pos[r][s] = p
                plan.append((host_blocks[r][p // bs] * bs + p % bs, row_of[p]))
            new_lru[r] = (unleased + [s for s in evictable if s not in taken] + taken
                          + [s for s in lru[r] if s in hit_slots])
            stats[1] += len(hit_slot)
            stats[2] += len(misses)
        for tt in toks:
            out[tt] = [row_of[p] if p >= 0 else -1 for p in topk[tt]]
        copies[toks[0]] = (plan, len(toks))
    return out, copies, new_slot_pos, new_lru, stats


def check_against_naive(case: ResolveCase) -> None:
    before = case.state()
    try:
        expected = naive_resolve(case)
    except NaiveError as e:
        with pytest.raises(ResolveError) as info:
            reference.resolve(*case.args())
        assert info.value.code == e.code
        after = case.state()
        for name in before:
            assert torch.equal(before[name], after[name]), f"{name} written despite the error"
        return
    reference.resolve(*case.args())
    out, copies, slot_pos, lru, stats = expected
    k = case.topk.shape[1]
    assert case.out_rows.tolist() == out
    assert case.slot_pos.tolist() == slot_pos
    assert case.lru.tolist() == lru
    assert case.stats.tolist() == [a + b for a, b in zip(before["stats"].tolist(), stats)]
    counts = case.miss_count.tolist()
    planned_tokens = set()
    for t0, (plan, n) in copies.items():
        got = []
        for j in range(n):
            planned_tokens.add(t0 + j)
            c = counts[t0 + j]
            got += list(zip(case.miss_src[t0 + j, :c].tolist(), case.miss_dst[t0 + j, :c].tolist()))
        assert got == plan
        assert counts[t0:t0 + n] == [max(0, min(k, len(plan) - j * k)) for j in range(n)]
    for t, c in enumerate(counts):
        if t not in planned_tokens:
            assert c == 0


# --------------------------------------------------------------------------------------
# Worked example of docs/design.md, "Op contracts", `resolve`, and one case per rule
# --------------------------------------------------------------------------------------

def worked_example() -> ResolveCase:
    """D = 8 hot slots, K = 4, bs = 4: slots s0..s7 hold 10..17 in LRU order; top-k
    {12, 16, 25, 30} with page 7 (positions 28..31) resident in device block 9."""
    bs, num_pages = 4, 8
    residency = torch.full((1, num_pages), -1, dtype=torch.int32)
    residency[0, 7] = 9
    host_blocks = i32([[100 + p for p in range(num_pages)]])
    return ResolveCase(
        topk=i32([[12, 16, 25, 30]]), token_rows=i32([0]), residency=residency,
        host_blocks=host_blocks, hot_blocks=i32([[20, 21]]),
        slot_pos=i32([list(range(10, 18))]),
        lru=torch.arange(8, dtype=torch.int16).reshape(1, 8), block_size=bs)


def hot_row(case: ResolveCase, row: int, slot: int) -> int:
    bs = case.block_size
    return int(case.hot_blocks[row, slot // bs]) * bs + slot % bs


def test_worked_example():
    case = worked_example()
    reference.resolve(*case.args())
    s = lambda i: hot_row(case, 0, i)  # noqa: E731
    assert case.out_rows.tolist() == [[s(2), s(6), s(0), 9 * 4 + 30 % 4]]
    assert case.lru.tolist() == [[1, 3, 4, 5, 7, 0, 2, 6]]
    assert case.slot_pos.tolist() == [[25, 11, 12, 13, 14, 15, 16, 17]]
    assert case.miss_count.tolist() == [1]
    assert case.miss_src[0, 0].item() == (100 + 25 // 4) * 4 + 25 % 4
    assert case.miss_dst[0, 0].item() == s(0)
    assert case.stats.tolist() == [1, 2, 1]


def test_public_op_matches_reference_on_cpu():
    case = worked_example()
    twin = case.clone()
    ops.resolve(*case.args())
    reference.resolve(*twin.args())
    assert case.state().keys() == twin.state().keys()
    for name, value in case.state().items():
        assert torch.equal(value, twin.state()[name]), name


def test_hits_become_more_recent_than_misses_across_steps():
    case = worked_example()
    reference.resolve(*case.args())
    # Next step selects 25 (now in s0) and two new host-backed positions.
    case.topk = i32([[25, 4, 5, 30]])
    reference.resolve(*case.args())
    # Evictable order was s1 s3 s4 s5 s7 s2 s6 (s0 hit): misses 4, 5 take s1, s3.
    assert case.lru.tolist() == [[4, 5, 7, 2, 6, 1, 3, 0]]
    assert case.slot_pos[0, 1].item() == 4 and case.slot_pos[0, 3].item() == 5
    assert case.stats.tolist() == [2, 3, 3]


def test_resident_only_request_leaves_hot_state_untouched():
    case = worked_example()
    case.residency[0, :] = torch.arange(30, 38, dtype=torch.int32)
    case.hot_blocks[0, :] = -1  # a Full request has no hot region at all
    before = case.state()
    reference.resolve(*case.args())
    assert torch.equal(case.lru, before["lru"]) and torch.equal(case.slot_pos, before["slot_pos"])
    expected = [(30 + p // 4) * 4 + p % 4 for p in (12, 16, 25, 30)]
    assert case.out_rows.tolist() == [expected]
    assert case.miss_count.tolist() == [0]
    assert case.stats.tolist() == [4, 0, 0]


def test_duplicate_positions_resolve_once():
    case = worked_example()
    case.topk = i32([[25, 25, 12, 25]])
    reference.resolve(*case.args())
    r25 = hot_row(case, 0, 0)
    assert case.out_rows.tolist() == [[r25, r25, hot_row(case, 0, 2), r25]]
    assert case.miss_count.tolist() == [1]
    assert case.stats.tolist() == [0, 1, 1]


def test_padding_selections_and_padding_tokens():
    case = worked_example()
    case.topk = i32([[-1, 12, -1, -1], [25, 25, 25, 25], [-1, -1, -1, -1]])
    case.token_rows = i32([0, -1, -1])
    case.__post_init__()
    case.out_rows = torch.full((3, 4), -7, dtype=torch.int32)
    case.miss_src = torch.full((3, 4), -7, dtype=torch.int32)
    case.miss_dst = torch.full((3, 4), -7, dtype=torch.int32)
    case.miss_count = torch.full((3,), -7, dtype=torch.int32)
    reference.resolve(*case.args())
    assert case.out_rows.tolist() == [[-1, hot_row(case, 0, 2), -1, -1], [-1] * 4, [-1] * 4]
    assert case.miss_count.tolist() == [0, 0, 0]
    assert case.stats.tolist() == [0, 1, 0]


def test_request_of_only_padding_selections_is_untouched():
    case = worked_example()
    case.topk = i32([[-1, -1, -1, -1]])
    before = case.state()
    reference.resolve(*case.args())
    assert case.out_rows.tolist() == [[-1] * 4]
    assert torch.equal(case.lru, before["lru"])
    assert case.stats.tolist() == [0, 0, 0]


def test_spec_decode_union_spills_copies_into_later_rows():
    """A 4-token request with 6 distinct misses and K = 4: copies 0..3 in the first token's
    row, 4..5 in the second's; a position selected by tokens 0 and 2 maps to one slot."""
    bs, num_pages, d = 4, 16, 8
    case = ResolveCase(
        topk=i32([[40, 41, 42, 43], [44, 40, 45, -1], [41, 30, 45, 40], [30, 30, 30, 30]]),
        token_rows=i32([3, 3, 3, 3]),
        residency=torch.full((4, num_pages), -1, dtype=torch.int32),
        host_blocks=torch.arange(4 * num_pages, dtype=torch.int32).reshape(4, num_pages),
        hot_blocks=i32([[60, 61], [62, 63], [64, 65], [66, 67]]),
        slot_pos=torch.full((4, d), -1, dtype=torch.int32),
        lru=torch.arange(d, dtype=torch.int16).repeat(4, 1), block_size=bs)
    case.residency[3, 30 // bs] = 5
    reference.resolve(*case.args())
    assert case.miss_count.tolist() == [4, 2, 0, 0]
    # Misses in first-reference order: 40 41 42 43 44 45 take slots 0..5.
    dst = [hot_row(case, 3, s) for s in range(6)]
    assert case.miss_dst[0].tolist() + case.miss_dst[1, :2].tolist() == dst
    src = [int(case.host_blocks[3, p // bs]) * bs + p % bs for p in (40, 41, 42, 43, 44, 45)]
    assert case.miss_src[0].tolist() + case.miss_src[1, :2].tolist() == src
    assert case.out_rows[2].tolist() == [dst[1], 5 * bs + 2, dst[5], dst[0]]
    assert case.out_rows[3].tolist() == [5 * bs + 2] * 4
    assert case.lru[3].tolist() == [6, 7, 0, 1, 2, 3, 4, 5]
    assert case.stats.tolist() == [1, 0, 6]


def test_two_requests_copy_into_their_own_rows():
    case = worked_example()
    case.topk = i32([[12, 25, 26, 27], [1, 2, 3, -1]])
    case.token_rows = i32([0, 1])
    case.residency = case.residency.repeat(2, 1)
    case.host_blocks = torch.cat([case.host_blocks, case.host_blocks + 50])
    case.hot_blocks = i32([[20, 21], [22, 23]])
    case.slot_pos = torch.cat([case.slot_pos, torch.full((1, 8), -1, dtype=torch.int32)])
    case.lru = case.lru.repeat(2, 1)
    case.__post_init__()
    case.out_rows = torch.full((2, 4), -7, dtype=torch.int32)
    case.miss_src = torch.full((2, 4), -7, dtype=torch.int32)
    case.miss_dst = torch.full((2, 4), -7, dtype=torch.int32)
    case.miss_count = torch.full((2,), -7, dtype=torch.int32)
    reference.resolve(*case.args())
    assert case.miss_count.tolist() == [3, 3]
    assert case.miss_dst[1, :3].tolist() == [22 * 4 + 0, 22 * 4 + 1, 22 * 4 + 2]
    assert case.miss_src[1, :3].tolist() == [150 * 4 + 1, 150 * 4 + 2, 150 * 4 + 3]


# --------------------------------------------------------------------------------------
# Errors: each one raised, named, and nothing written
# --------------------------------------------------------------------------------------

def _error_cases():
    c = worked_example()
    c.topk = i32([[12, 32, 25, 30]])  # 32 = P * bs
    yield "position past the end", c, ResolveErrorCode.POSITION_OUT_OF_RANGE, "outside [0, 32)"
    c = worked_example()
    c.topk = i32([[12, -2, 25, 30]])
    yield "negative position", c, ResolveErrorCode.POSITION_OUT_OF_RANGE, "-2"
    c = worked_example()
    c.host_blocks[0, 25 // 4] = -1
    yield "no host block", c, ResolveErrorCode.NO_HOST_BLOCK, "host_blocks == -1"
    c = worked_example()
    c.topk = i32([[0, 1, 2, 3, 4, 5, 6, 7, 8]])
    c.__post_init__()
    c.out_rows, c.miss_src, c.miss_dst = (torch.zeros((1, 9), dtype=torch.int32) for _ in range(3))
    yield "more misses than D", c, ResolveErrorCode.HOT_OVERFLOW, "(8 leased slots)"
    c = worked_example()
    c.topk = i32([[12, 12, 12, 12]] * 3)
    c.token_rows = i32([0, 1, 0])
    c.residency = c.residency.repeat(2, 1)
    c.host_blocks = c.host_blocks.repeat(2, 1)
    c.hot_blocks = i32([[20, 21], [22, 23]])
    c.slot_pos = c.slot_pos.repeat(2, 1)
    c.lru = c.lru.repeat(2, 1)
    c.out_rows, c.miss_src, c.miss_dst = (torch.zeros((3, 4), dtype=torch.int32) for _ in range(3))
    c.miss_count = torch.zeros(3, dtype=torch.int32)
    yield "request not contiguous", c, ResolveErrorCode.NOT_CONTIGUOUS, "not contiguous"
    c = worked_example()
    c.hot_blocks[0, 0] = -1
    yield "hot block missing", c, ResolveErrorCode.HOT_BLOCK_MISSING, "hot block is -1"
    c = worked_example()
    c.slot_pos[0, 5] = 12
    yield "position in two slots", c, ResolveErrorCode.DUPLICATE_SLOT, "more than one slot"
    c = worked_example()
    c.token_rows = i32([1])
    yield "state row out of range", c, ResolveErrorCode.STATE_ROW_OUT_OF_RANGE, "outside [-1, 1)"


@pytest.mark.parametrize("name,case,code,text", list(_error_cases()),
                         ids=[c[0] for c in _error_cases()])
def test_error_cases_raise_and_write_nothing(name, case, code, text):
    before = case.state()
    with pytest.raises(ResolveError, match=re.escape(text)) as info:
        ops.resolve(*case.args())
    assert info.value.code == code
    assert isinstance(info.value, ValueError)
    for key, value in case.state().items():
        assert torch.equal(value, before[key]), f"{key} was written"


def test_overflow_counts_only_host_backed_positions():
    """Nine distinct positions, one of them resident: 8 host-backed fit D = 8."""
    c = worked_example()
    c.topk = i32([[0, 1, 2, 3, 4, 5, 6, 7, 30]])
    c.__post_init__()
    c.out_rows, c.miss_src, c.miss_dst = (torch.zeros((1, 9), dtype=torch.int32) for _ in range(3))
    reference.resolve(*c.args())
    assert c.miss_count.tolist() == [8]
    assert sorted(c.lru[0].tolist()) == list(range(8))


# --------------------------------------------------------------------------------------
# Data checks: corrupt lru, negative and overflowing block ids (issue 13, defect 6)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,case,error,code,text", list(input_defect_cases()),
                         ids=[c[0] for c in input_defect_cases()])
def test_input_defects_raise_named_errors_and_write_nothing(name, case, error, code, text):
    before = case.state()
    with pytest.raises(error, match=re.escape(text)) as info:
        ops.resolve(*case.args())
    assert isinstance(info.value, ValueError)
    if code is not None:
        assert info.value.code == code and info.value.state_row == 0
    else:
        assert info.value.argument == name.split()[0]
    for key, value in case.state().items():
        assert torch.equal(value, before[key]), f"{key} was written"


def _corrupt_lru(case: ResolveCase) -> ResolveCase:
    case.lru[0, 2] = 99
    return case


def test_corrupt_lru_of_a_fully_resident_request_is_not_read():
    """As in the kernel: a request without a host-backed selection never reads its lru."""
    c = _corrupt_lru(worked_example())
    c.topk = i32([[30, 29, -1, 28]])
    lru = c.lru.clone()
    reference.resolve(*c.args())
    assert c.out_rows.tolist() == [[9 * 4 + 2, 9 * 4 + 1, -1, 9 * 4 + 0]]
    assert torch.equal(c.lru, lru)


def test_corrupt_lru_of_a_padding_request_is_not_read():
    c = _corrupt_lru(worked_example())
    c.topk = i32([[-1, -1, -1, -1]])
    reference.resolve(*c.args())
    assert c.miss_count.tolist() == [0]


@pytest.mark.parametrize("mutate,code", [
    (lambda c: setattr(c, "topk", i32([[12, 40, 25, 30]])), ResolveErrorCode.POSITION_OUT_OF_RANGE),
    (lambda c: c.host_blocks.__setitem__((0, 6), -1), ResolveErrorCode.NO_HOST_BLOCK),
    (lambda c: c.slot_pos.__setitem__((0, 5), 12), ResolveErrorCode.DUPLICATE_SLOT),
    (lambda c: c.hot_blocks.__setitem__((0, 0), -1), ResolveErrorCode.CORRUPT_LRU),
])
def test_corrupt_lru_is_reported_in_the_kernels_order(mutate, code):
    """The kernel checks lru after positions, host blocks, overflow and duplicate slots, and
    before hot blocks; with two defects the reference reports the one the kernel does."""
    c = _corrupt_lru(worked_example())
    mutate(c)
    with pytest.raises(ResolveError) as info:
        reference.resolve(*c.args())
    assert info.value.code == code


def test_corrupt_lru_names_the_request_that_reads_it():
    c = worked_example()
    c.topk = i32([[30, 30, 30, 30], [12, 16, 25, 30]])
    c.token_rows = i32([0, 1])
    for name in ("residency", "host_blocks", "hot_blocks", "slot_pos", "lru"):
        setattr(c, name, getattr(c, name).repeat(2, 1).contiguous())
    c.hot_blocks[1] = i32([22, 23])
    c.lru[0, 0] = 77  # row 0 is fully resident: never read
    c.lru[1, 7] = -1
    c.__post_init__()
    c.out_rows, c.miss_src, c.miss_dst = (torch.zeros((2, 4), dtype=torch.int32) for _ in range(3))
    c.miss_count = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ResolveError, match=re.escape("lru of state row 1 holds -1")) as info:
        reference.resolve(*c.args())
    assert (info.value.code, info.value.detail_a, info.value.detail_b) == (
        ResolveErrorCode.CORRUPT_LRU, -1, 8)


def test_block_tables_of_rows_outside_the_batch_are_not_checked():
    c = worked_example()
    for name in ("residency", "host_blocks", "hot_blocks", "slot_pos", "lru"):
        setattr(c, name, getattr(c, name).repeat(2, 1).contiguous())
    c.residency[1, 0] = -9
    c.host_blocks[1, 0] = 1 << 30
    reference.resolve(*c.args())
    assert c.miss_count.tolist() == [1]


@pytest.mark.parametrize("seed", range(200))
def test_random_corrupt_lru_against_naive(seed):
    """One state row's lru broken at random: raised exactly when its request reads it."""
    rng = random.Random(50_000 + seed)
    case = random_case(rng, allow_overflow=(seed % 5 == 0))
    row = rng.randrange(case.lru.shape[0])
    j = rng.randrange(case.lru.shape[1])
    d = case.lru.shape[1]
    kind = seed % 3
    if kind == 0:
        case.lru[row, j] = rng.choice([d, d + 1, 32767, -1, -32768])
    elif d > 1:
        case.lru[row, j] = case.lru[row, (j + 1) % d]  # a slot twice, another one missing
    check_against_naive(case)


#: Cases whose pure-Python naive check takes seconds (the largest sizes: D = 32768, K = 2048):
#: the slow tier runs them; the GPU tests compare the kernel with the reference on every case.
_SLOW_CASES = ("max sizes, ids at the int32 edge",)


@pytest.mark.parametrize("name,case", [
    pytest.param(name, case, marks=[pytest.mark.slow] if name in _SLOW_CASES else [])
    for name, case in adversarial_cases()], ids=[c[0] for c in adversarial_cases()])
def test_adversarial_valid_cases_against_naive(name, case):
    check_against_naive(case)


# --------------------------------------------------------------------------------------
# Aliased outputs and meta tensors (metadata checks, both backends)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mutate,text", [
    (lambda c: setattr(c, "out_rows", c.topk), "out_rows shares memory with topk"),
    (lambda c: setattr(c, "miss_dst", c.miss_src), "miss_dst shares memory with miss_src"),
    (lambda c: setattr(c, "miss_count", c.token_rows), "miss_count shares memory with token_rows"),
    (lambda c: setattr(c, "slot_pos", c.residency), "slot_pos shares memory with residency"),
    (lambda c: setattr(c, "miss_src", torch.cat([c.out_rows, c.out_rows], 1)[:, 2:6].contiguous()),
     None),
])
def test_outputs_aliasing_other_arguments_are_rejected(mutate, text):
    case = worked_example()
    mutate(case)
    if text is None:  # distinct memory: accepted
        ops.resolve(*case.args())
        return
    before = case.state()
    with pytest.raises(errors.AliasedOutputError, match=re.escape(text)):
        ops.resolve(*case.args())
    for key, value in case.state().items():
        assert torch.equal(value, before[key]), f"{key} was written"


def test_overlapping_slices_of_one_buffer_are_rejected_and_disjoint_ones_accepted():
    case = worked_example()
    buf = torch.full((3, 1, 4), -7, dtype=torch.int32)
    case.out_rows, case.miss_src, case.miss_dst = buf[0], buf[1], buf[2]
    ops.resolve(*case.args())
    assert case.miss_count.tolist() == [1]
    flat = torch.zeros(9, dtype=torch.int32)
    case.out_rows, case.miss_src = flat[0:4].view(1, 4), flat[3:7].view(1, 4)
    with pytest.raises(errors.AliasedOutputError, match="miss_src shares memory with out_rows"):
        ops.resolve(*case.args())


@pytest.mark.parametrize("name", ["topk", "residency", "lru", "miss_count", "stats"])
def test_meta_tensors_are_rejected(name):
    case = worked_example()
    setattr(case, name, getattr(case, name).to("meta"))
    with pytest.raises(errors.MetaTensorError, match=f"{name} is a meta tensor"):
        ops.resolve(*case.args())


# --------------------------------------------------------------------------------------
# Argument validation (metadata)
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mutate,text", [
    (lambda c: setattr(c, "topk", c.topk.to(torch.int64)), "topk must have dtype torch.int32"),
    (lambda c: setattr(c, "lru", c.lru.to(torch.int32)), "lru must have dtype torch.int16"),
    (lambda c: setattr(c, "token_rows", i32([0, 0])), "token_rows must have shape"),
    (lambda c: setattr(c, "hot_blocks", i32([[20]])), r"hot_blocks must have shape \(1, 2\)"),
    (lambda c: setattr(c, "block_size", 0), "block_size must be a positive int"),
    (lambda c: setattr(c, "block_size", 3), "not a multiple of block_size"),
    (lambda c: setattr(c, "out_rows", torch.zeros((1, 8), dtype=torch.int32)[:, ::2]),
     "out_rows must be contiguous"),
    (lambda c: setattr(c, "stats", torch.zeros(2, dtype=torch.int64)), "stats must have shape"),
    (lambda c: setattr(c, "host_blocks", c.host_blocks[:, :4].contiguous()),
     "host_blocks must have shape"),
])
def test_bad_arguments_are_named(mutate, text):
    case = worked_example()
    mutate(case)
    with pytest.raises(ValueError, match=text):
        ops.resolve(*case.args())


def test_hot_region_larger_than_int16_is_rejected():
    case = worked_example()
    d = 32768 + 64
    case.slot_pos = torch.full((1, d), -1, dtype=torch.int32)
    case.lru = torch.zeros((1, d), dtype=torch.int16)
    case.hot_blocks = torch.zeros((1, d // 4), dtype=torch.int32)
    with pytest.raises(ValueError, match="int16 lru"):
        ops.resolve(*case.args())


def test_select_rejects_unknown_backend():
    with pytest.raises(ValueError, match="auto, cuda, reference"):
        ops.select("triton")


def test_cuda_backend_on_cpu_tensors_is_an_error():
    case = worked_example()
    with pytest.raises(ValueError, match="needs CUDA index tensors"):
        ops.select("cuda").resolve(*case.args())


# --------------------------------------------------------------------------------------
# Random cases against the naive implementation
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(300))
def test_random_against_naive(seed):
    rng = random.Random(seed)
    case = random_case(rng, allow_overflow=(seed % 7 == 0))
    check_against_naive(case)


@pytest.mark.parametrize("seed", range(200))
def test_random_partial_regions_and_classes_against_naive(seed):
    rng = random.Random(50_000 + seed)
    case = random_case(rng, allow_overflow=(seed % 7 == 0), partial_fraction=0.5,
                       with_classes=seed % 2 == 0)
    check_against_naive(case)


def test_eviction_classes_pick_the_lowest_class_then_the_least_recent():
    """Worked example with classes: s0 s1 s3 s4 s5 s7 evictable; s4 and s7 class 0, the rest
    class 2: miss 25 takes s4 (class 0, older than s7), not s0 (least recent)."""
    case = worked_example()
    case.slot_class = torch.full((1, 8), 2, dtype=torch.uint8)
    case.slot_class[0, [4, 7]] = 0
    case.slot_class[0, 2] = 0  # a hit: its class does not matter
    reference.resolve(*case.args())
    assert case.miss_dst[0, 0].item() == hot_row(case, 0, 4)
    assert case.slot_pos[0].tolist() == [10, 11, 12, 13, 25, 15, 16, 17]
    assert case.lru[0].tolist() == [0, 1, 3, 5, 7, 4, 2, 6]


def test_eviction_classes_above_three_count_as_three():
    case = worked_example()
    case.slot_class = torch.tensor([[200, 3, 0, 7, 9, 3, 0, 4]], dtype=torch.uint8)
    reference.resolve(*case.args())  # evictable s0 s1 s3 s4 s5 s7 all class 3: LRU, s0
    assert case.slot_pos[0, 0].item() == 25
    assert case.lru[0].tolist() == [1, 3, 4, 5, 7, 0, 2, 6]


def test_unleased_slots_are_never_taken_and_move_to_the_front():
    """Hot block 0 (slots s0..s3) not leased, its slots empty: misses take s4.. in LRU order,
    the unleased slots lead the new order (a region that grows uses them first)."""
    case = worked_example()
    case.hot_blocks[0, 0] = -1
    case.slot_pos[0, :4] = -1
    case.topk = i32([[14, 16, 25, 3]])  # 14 hits s4, 16 s6; 25 and 3 miss
    case.lru = torch.tensor([[4, 0, 5, 1, 6, 2, 7, 3]], dtype=torch.int16)
    reference.resolve(*case.args())
    assert case.miss_count.tolist() == [2]
    assert case.miss_dst[0, :2].tolist() == [hot_row(case, 0, 5), hot_row(case, 0, 7)]
    assert case.slot_pos[0].tolist() == [-1, -1, -1, -1, 14, 25, 16, 3]
    assert case.lru[0].tolist() == [0, 1, 2, 3, 5, 7, 4, 6]


def test_a_partial_region_overflows_at_its_leased_slots():
    case = worked_example()
    case.hot_blocks[0, 1] = -1
    case.slot_pos[0, 4:] = -1
    case.topk = i32([[0, 1, 2, 3, 4]])  # 5 host-backed positions, 4 leased slots
    case.__post_init__()
    case.out_rows, case.miss_src, case.miss_dst = (torch.zeros((1, 5), dtype=torch.int32)
                                                   for _ in range(3))
    with pytest.raises(ResolveError, match=r"selects 5 .* \(4 leased slots\)") as info:
        reference.resolve(*case.args())
    assert info.value.code == ResolveErrorCode.HOT_OVERFLOW
    case.topk = i32([[0, 1, 2, 3, -1]])
    reference.resolve(*case.args())  # 4 fit
    assert sorted(case.slot_pos[0, :4].tolist()) == [0, 1, 2, 3]


def test_no_region_at_all_overflows():
    case = worked_example()
    case.hot_blocks.fill_(-1)
    case.slot_pos.fill_(-1)
    with pytest.raises(ResolveError) as info:
        reference.resolve(*case.args())
    assert info.value.code == ResolveErrorCode.HOT_OVERFLOW


@pytest.mark.parametrize("seed", range(40))
def test_random_multistep_against_naive(seed):
    """The hot state carried over several steps stays equal to the naive one."""
    rng = random.Random(10_000 + seed)
    case = random_case(rng)
    for step in range(5):
        check_against_naive(case)
        fresh = random_case(random.Random(rng.random()), k=case.topk.shape[1])
        # New selections for the same rows (kept within D by construction of the rows).
        if fresh.topk.shape[0] == 0 or case.topk.shape[0] == 0:
            break
        n = case.topk.shape[0]
        num_positions = case.residency.shape[1] * case.block_size
        case.topk = torch.randint(-1, num_positions, case.topk.shape, dtype=torch.int32,
                                  generator=torch.Generator().manual_seed(seed * 31 + step))
        case.out_rows = torch.full((n, case.topk.shape[1]), -7, dtype=torch.int32)
