"""resolve's error codes on the CUDA kernels: the record the reference twin raises, the
request that failed left untouched, the others resolved (GPU only; also first referenced
past the register chunk: test_cuda_resolve.py's chunk-boundary case)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from resolve_cases import i32
from vllm_hisparse.ops import reference
from vllm_hisparse.ops.errors import ResolveError, ResolveErrorCode

from cuda_harness import (DEV, TUNING, big_case, cap_distinct, check_case, cuda_ops, expect_error,
                          simple_case)

pytestmark = pytest.mark.gpu


# --------------------------------------------------------------------------------------
# resolve: errors
# --------------------------------------------------------------------------------------


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
