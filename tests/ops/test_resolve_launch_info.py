"""resolve's launch plan: which shapes the fast path takes and the shared memory of each path.

Host code of the extension: it runs without a GPU wherever ``vllm_hisparse._C`` was built (the
CI builds it with nvcc), and is skipped where it was not.
"""

from __future__ import annotations

import pytest
import torch

cuda_ops = pytest.importorskip("vllm_hisparse.ops.cuda")
if not cuda_ops.available():  # pragma: no cover - no CUDA toolkit at install time
    pytest.skip("vllm_hisparse._C was not built", allow_module_level=True)


@pytest.fixture
def threads():
    """Set the resolve CTA size for one test and restore the default after it."""
    before = cuda_ops._resolve_threads
    yield cuda_ops.set_resolve_threads
    cuda_ops.set_resolve_threads(before)


def fast(k, num_slots, block_size, num_pages, num_tokens=64):
    return cuda_ops.resolve_launch_info(num_tokens, k, num_slots, block_size,
                                        num_pages)["fast_path"]


@pytest.mark.parametrize("k, num_slots, block_size, num_pages, want", [
    (2048, 4096, 64, 2048, True),    # DeepSeek-V3.2 / GLM-5 decode, D = 2K
    (2048, 8192, 64, 2048, True),    # D = 4K (8 slots per thread)
    (512, 1024, 64, 256, True),
    (64, 4096, 4, 256, True),        # 1,024 hot blocks: one per thread
    (2048, 1024, 64, 256, False),    # K > D: the general path reports the overflow
    (96, 480, 48, 16, False),        # block size not a power of two
    (4096, 8192, 64, 2048, False),   # K past 2 selections per thread
    (2048, 16384, 64, 2048, False),  # D past 8 slots per thread
    (64, 4096, 2, 256, False),       # 2,048 hot blocks: past one per thread
    (30, 64, 16, 8, True),
    (31, 64, 16, 8, False),          # odd K: no 8-byte selection loads
    (8, 18, 2, 8, False),            # D not a multiple of 4 slots per thread
])
def test_fast_path_shapes(threads, k, num_slots, block_size, num_pages, want):
    threads(0)
    assert fast(k, num_slots, block_size, num_pages) is want


def test_fast_path_with_512_thread_ctas(threads):
    threads(512)
    assert fast(2048, 4096, 64, 2048)  # 4 selections, 8 slots per thread
    assert fast(2048, 8192, 64, 2048)  # 16 slots per thread
    assert not fast(512, 1024, 64, 256)  # no instantiation for 2 general slots per thread


def test_shared_memory_of_the_two_paths():
    """The launch takes the larger plan; the general path's spare hash entries stay within the
    fast plan (the rest of the shared memory is left to L1); page rows are staged when they fit."""
    one = cuda_ops.resolve_launch_info(1, 2048, 4096, 64, 2048)  # planned for 1 token
    assert one["fast_path"] and one["fast_stage_pages"] == 2048
    assert one["smem_bytes"] > one["general_smem_bytes"]  # the fast plan is the larger
    assert one["hash_capacity"] > one["union_capacity"]  # spare entries within it
    four = cuda_ops.resolve_launch_info(64, 2048, 4096, 64, 2048)  # up to 4 tokens
    assert four["fast_path"] and four["smem_bytes"] == four["general_smem_bytes"]
    assert four["hash_capacity"] == four["union_capacity"]  # the bound alone: no spare entries
    alone = cuda_ops.resolve_launch_info(64, 2048, 16384, 64, 2048)  # no fast path
    assert not alone["fast_path"] and alone["fast_stage_pages"] == 0
    assert alone["smem_bytes"] == alone["general_smem_bytes"]
    assert alone["hash_capacity"] > alone["union_capacity"]  # spare entries up to the budget


def test_benchmark_hooks_reject_bad_arguments():
    """The removed previous kernel (variant 1) and malformed debug_times name the problem."""
    with pytest.raises(ValueError, match="variant must be 0 or 2"):
        cuda_ops._set_resolve_debug(variant=1)
    with pytest.raises(ValueError, match="stop in 0..5"):
        cuda_ops._set_resolve_debug(stop=6)
    topk = torch.zeros((1, 4), dtype=torch.int32)
    args = (topk, torch.zeros(1, dtype=torch.int32)) + (None,) * 5 + (4,) + (None,) * 4
    for bad in (torch.zeros(9, dtype=torch.int64), torch.zeros(10, dtype=torch.int32)):
        with pytest.raises(ValueError, match="debug_times must be an int64 tensor"):
            cuda_ops._resolve(*args, debug_times=bad)
