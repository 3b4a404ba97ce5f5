"""``bench throughput``'s fused stand-ins (sparse MLA decode, indexer logits) against their
torch twins: on CPU through Triton's interpreter (a subprocess: the interpreter is chosen when
a kernel is defined), on the GPU at the real geometries' sizes."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm_hisparse.cli.benchmarks.indexer_logits import IndexerLogits, indexer_logits_reference
from vllm_hisparse.cli.benchmarks.mla_decode import (MlaRowLayout, SparseMlaDecode,
                                                     sparse_mla_decode_reference)
from vllm_hisparse.cli.benchmarks.model_layer import GEOMETRIES

triton = pytest.importorskip("triton")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_rows(layout: MlaRowLayout, n: int, g: torch.Generator) -> torch.Tensor:
    """``n`` rows of ``layout`` with finite values (scales in [0.5, 1.5))."""
    rows = torch.zeros(n, layout.row_bytes, dtype=torch.uint8)
    nope = torch.randn(n, layout.nope_dim, generator=g)
    if layout.fp8:
        rows[:, :layout.nope_dim] = nope.to(torch.float8_e4m3fn).view(torch.uint8)
        scales = torch.rand(n, layout.scale_groups, generator=g) + 0.5
        rows[:, layout.nope_dim:layout.rope_offset_bytes] = scales.view(torch.uint8)
    else:
        rows[:, :2 * layout.nope_dim] = nope.bfloat16().view(torch.uint8)
    rope = torch.randn(n, layout.rope_dim, generator=g).bfloat16()
    rows[:, layout.rope_offset_bytes:layout.used_bytes] = rope.view(torch.uint8)
    return rows


def adversarial_indices(B: int, K: int, num_rows: int, g: torch.Generator) -> torch.Tensor:
    """Random rows with duplicates, a token padded half way, a token with no valid row."""
    idx = torch.randint(0, num_rows, (B, K), generator=g, dtype=torch.int32)
    idx[0, : K // 4] = 3  # duplicates
    if B > 1:
        idx[1, K // 2:] = -1
    if B > 2:
        idx[2] = -1
    return idx


def test_row_layouts_of_the_geometries():
    dsv32, glm = GEOMETRIES["dsv32"], GEOMETRIES["glm51"]
    fp8 = MlaRowLayout.fitting(dsv32["kv_lora_rank"], dsv32["rope_dim"], dsv32["mla_row_bytes"])
    assert (fp8.fp8, fp8.scale_groups, fp8.rope_offset_bytes, fp8.used_bytes) == (True, 4, 528, 656)
    bf16 = MlaRowLayout.fitting(glm["kv_lora_rank"], glm["rope_dim"], glm["mla_row_bytes"])
    assert (bf16.fp8, bf16.rope_offset_bytes, bf16.used_bytes) == (False, 1024, 1152)
    with pytest.raises(ValueError, match="cannot hold 512 latent"):
        MlaRowLayout.fitting(512, 64, 600)
    with pytest.raises(ValueError, match="multiple of 128"):
        MlaRowLayout(100, 64, True, 656)


def test_fp8_row_dequantizes_by_its_group_scales():
    g = torch.Generator().manual_seed(1)
    layout = MlaRowLayout(256, 16, True, 256 + 8 + 32)
    rows = make_rows(layout, 2, g)
    values = layout.dequantize(rows)
    scales = rows[:, 256:264].contiguous().view(torch.float32)
    raw = rows[:, :256].contiguous().view(torch.float8_e4m3fn).float()
    assert torch.equal(values[:, 200], (raw[:, 200] * scales[:, 1]).bfloat16().float())
    assert torch.equal(values[:, 256:], rows[:, 264:296].contiguous().view(torch.bfloat16).float())


def test_reference_attends_only_valid_rows():
    g = torch.Generator().manual_seed(2)
    layout = MlaRowLayout(128, 16, False, 288)
    rows = make_rows(layout, 8, g)
    q = torch.randn(2, 16, 144, generator=g).bfloat16()
    idx = torch.tensor([[5, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    out = sparse_mla_decode_reference(q, rows, idx, layout, 0.1)
    assert torch.equal(out[0], layout.dequantize(rows[5])[:128].expand(16, 128))  # one row: it
    assert not out[1].any()  # nothing valid: zeros


def test_launch_checks_name_the_argument():
    layout = MlaRowLayout(128, 16, False, 288)
    mla = SparseMlaDecode(layout, 16, 0.1)
    q = torch.zeros(2, 16, 144, dtype=torch.bfloat16)
    rows = torch.zeros(4, 288, dtype=torch.uint8)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="out: expected bf16"):
        mla(q, rows, idx, torch.zeros(2, 16, 128))
    with pytest.raises(ValueError, match="indices: expected int32"):
        mla(q, rows, idx.long(), torch.zeros(2, 16, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="kv_rows: expected uint8"):
        mla(q, rows[:, :200], idx, torch.zeros(2, 16, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="heads 12"):
        SparseMlaDecode(layout, 12, 0.1)
    logits = IndexerLogits(16, 32)
    with pytest.raises(ValueError, match="key_scales: expected contiguous"):
        logits(torch.zeros(1, 16, 32, dtype=torch.uint8), torch.zeros(1, 16),
               torch.zeros(1, 10, 32, dtype=torch.uint8), torch.zeros(1, 11), torch.zeros(1, 10))


INTERPRETED = textwrap.dedent("""
    import torch
    from tests.cli.test_standin_kernels import check_kernels
    check_kernels(torch.device("cpu"), small=True)
    print("KERNELS AGREE")
""")


def check_kernels(device: torch.device, small: bool) -> None:
    """Both kernels against their twins: fp8 and bf16 rows, split and unsplit, adversarial
    indices; the indexer over a context that is not a multiple of its tile."""
    g = torch.Generator().manual_seed(0)
    if small:
        layouts = [(MlaRowLayout(128, 32, True, 200), 16), (MlaRowLayout(128, 32, False, 320), 32)]
        batches, K, num_rows = [(3, 1), (3, 3)], 40, 50
        index_shapes, context = [(16, 32)], 300
    else:
        layouts = [(MlaRowLayout.fitting(512, 64, GEOMETRIES[k]["mla_row_bytes"]),
                    GEOMETRIES[k]["heads"]) for k in ("dsv32", "glm51")]
        batches, K, num_rows = [(4, None), (4, 1), (64, None), (3, 5)], 2048, 20000
        index_shapes, context = [(64, 128), (32, 128)], 4099
    for layout, heads in layouts:
        rows = make_rows(layout, num_rows, g).to(device)
        mla = SparseMlaDecode(layout, heads, 0.07)
        for B, splits in batches:
            q = torch.randn(B, heads, layout.nope_dim + layout.rope_dim, generator=g)
            q = q.bfloat16().to(device)
            idx = adversarial_indices(B, K, num_rows, g).to(device)
            out = torch.full((B, heads, layout.nope_dim), 7.0, dtype=torch.bfloat16,
                             device=device)
            mla(q, rows, idx, out, splits=splits)
            want = sparse_mla_decode_reference(q.cpu(), rows.cpu(), idx.cpu(), layout, 0.07)
            err = (out.float().cpu() - want).abs().max().item()
            # bf16 output and, on the GPU, bf16 probabilities
            assert err <= 0.02 * max(1.0, want.abs().max().item()), (layout, B, splits, err)
            if B > 2:
                assert not out[2].any()
    for heads, dim in index_shapes:
        B = 3
        q = torch.randn(B, heads, dim, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
        keys = torch.randn(B, context, dim, generator=g).to(torch.float8_e4m3fn)
        keys = keys.view(torch.uint8)
        weights, scales = torch.rand(B, heads, generator=g), torch.rand(B, context, generator=g)
        out = torch.full((B, context), 7.0, device=device)
        IndexerLogits(heads, dim)(q.to(device), weights.to(device), keys.to(device),
                                  scales.to(device), out)
        want = indexer_logits_reference(q, weights, keys, scales)
        err = (out.cpu() - want).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), (heads, dim, err)


def test_kernels_agree_with_their_twins_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "KERNELS AGREE" in done.stdout, done.stderr[-3000:]


@pytest.mark.gpu
@gpu
def test_kernels_agree_with_their_twins_on_the_gpu():
    check_kernels(torch.device("cuda"), small=False)
