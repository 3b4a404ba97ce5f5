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

from vllm_hisparse import ops  # noqa: E402
from vllm_hisparse.ops import probe  # noqa: E402
from vllm_hisparse.ops.tuning import KernelTuning  # noqa: E402

CTA_512 = KernelTuning(resolve_threads=512)


def fast(k, num_slots, block_size, num_pages, num_tokens=64, tuning=KernelTuning()):
    return cuda_ops.resolve_launch_info(num_tokens, k, num_slots, block_size, num_pages,
                                        tuning=tuning)["fast_path"]


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
def test_fast_path_shapes(k, num_slots, block_size, num_pages, want):
    assert fast(k, num_slots, block_size, num_pages) is want


def test_fast_path_with_512_thread_ctas():
    assert fast(2048, 4096, 64, 2048, tuning=CTA_512)  # 4 selections, 8 slots per thread
    assert fast(2048, 8192, 64, 2048, tuning=CTA_512)  # 16 slots per thread
    # no instantiation for 2 general slots per thread
    assert not fast(512, 1024, 64, 256, tuning=CTA_512)


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


def general_layout_bytes(info, num_slots):
    """docs/kernels.md's layout of the general path's shared memory (csrc/resolve_general_smem.cuh):
    hash entries (8 B) and slot_of (4 B) per hash entry, a u16 per victim, 16-byte aligned; then
    the hit bitmask, the staged hot_blocks row and the two staged page rows, int32 arrays of
    whole 4-word groups."""
    words4 = lambda n: (n + 3) // 4 * 4  # noqa: E731
    head = (info["hash_capacity"] * 12 + info["victim_capacity"] * 2 + 15) // 16 * 16
    return (head + 4 * words4((num_slots + 31) // 32) + 4 * words4(info["hot_blocks_in_smem"])
            + 8 * words4(info["stage_pages"]))


@pytest.mark.parametrize("num_tokens, k, num_slots, block_size, num_pages", [
    (64, 2048, 4096, 64, 2048),     # fast path, pages staged
    (64, 2048, 16384, 64, 2048),    # general path alone
    (7, 96, 480, 48, 16),           # odd sizes: padding in every array
    (1, 64, 4096, 2, 5000),         # 2,048 hot blocks (not staged), pages past staging
    (300, 4096, 8192, 16, 100),     # a table the budget trims
])
def test_general_shared_memory_is_the_documented_layout(num_tokens, k, num_slots, block_size,
                                                        num_pages):
    info = cuda_ops.resolve_launch_info(num_tokens, k, num_slots, block_size, num_pages)
    assert info["general_smem_bytes"] == general_layout_bytes(info, num_slots)
    assert info["smem_bytes"] >= info["general_smem_bytes"]


def test_the_token_bound_is_the_backends_not_the_processes():
    """Two tunings in one process plan independently (no process-wide setting)."""
    one = probe.launch_info(64, 2048, 4096, 64, 2048,
                            tuning=KernelTuning(max_tokens_per_request=1))
    four = probe.launch_info(64, 2048, 4096, 64, 2048)
    assert one["union_capacity"] < four["union_capacity"]
    assert cuda_ops.resolve_launch_info(64, 2048, 4096, 64, 2048) == four
    assert ops.select("cuda", resolve_threads=512).tuning == CTA_512
    assert ops.select("cuda").tuning == KernelTuning()
    assert probe.launch_info(64, 2048, 4096, 64, 2048, tuning=CTA_512)["threads"] == 512


def test_probe_rejects_bad_arguments():
    """A stop point out of range and malformed phase-stamp buffers name the problem."""
    topk = torch.zeros((1, 4), dtype=torch.int32)
    args = (topk, torch.zeros(1, dtype=torch.int32)) + (None,) * 5 + (4,) + (None,) * 4
    for stop in (6, -1, True):
        with pytest.raises(ValueError, match="stop must be in 0..5"):
            probe.resolve(*args, stop=stop)
    for bad in (torch.zeros(9, dtype=torch.int64), torch.zeros(10, dtype=torch.int32)):
        with pytest.raises(ValueError, match="times must be an int64 tensor"):
            probe.resolve(*args, times=bad)
    with pytest.raises(ValueError, match="general_only must be a bool"):
        probe.resolve(*args, general_only=1)


@pytest.mark.parametrize("options, match", [
    ({"resolve_threads": 256}, "resolve_threads must be 0"),
    ({"max_tokens_per_request": 0}, "max_tokens_per_request must be a positive int"),
    ({"copy_rows_per_warp": 3}, "copy_rows_per_warp must be"),
    ({"copy_ctas_per_sm": -1}, "copy_ctas_per_sm must be"),
    ({"resolve_thread": 512}, "unknown kernel tuning option"),
])
def test_select_rejects_bad_tuning(options, match):
    with pytest.raises(ValueError, match=match):
        ops.select("cuda", **options)
