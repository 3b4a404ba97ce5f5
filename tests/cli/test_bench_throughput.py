"""``bench throughput``: the model-shaped layer's sizes, the concurrency schedule, and a CPU
smoke run through vLLM's real Scheduler and both connector roles (the GPU run replays the
same steps from CUDA graphs; its figures are in docs/benchmarks.md)."""

import json

import pytest
import torch

from vllm_hisparse.cli.benchmarks import (host_link, throughput, throughput_report,
                                          throughput_table)
from vllm_hisparse.cli.benchmarks.indexer_logits import indexer_logits_reference
from vllm_hisparse.cli.benchmarks.mla_decode import sparse_mla_decode_reference
from vllm_hisparse.cli.benchmarks.model_layer import (PRE_ATTENTION_GEMM, LayerShape,
                                                      ModelLayerWork, log_points, split_batch,
                                                      tokens_per_expert)
from vllm_hisparse.cli.benchmarks.throughput_probe import GraphStepProbe


def test_layer_weight_bytes_are_the_models_served_bytes():
    s = LayerShape.named("dsv32")
    # fp8: q_a 1536 + kv_a 576 + indexer wk 128 + weights_proj 64 from 7168; q_b (128 x 192 +
    # the indexer's 64 x 128) from 1536; o_proj 128 x 128 -> 7168; shared expert
    # 3 x 7168 x 2048; 32 local experts. bf16: kv_b 128 x 256 from 512 (vLLM dequantizes it
    # for the absorbed BMMs) and the router 7168 x 256.
    dense = (7168 * 2304 + 1536 * (128 * 192 + 64 * 128) + 2 * 512 * 128 * 256 + 16384 * 7168
             + 3 * 7168 * 2048 + 2 * 7168 * 256)
    experts = 32 * 3 * 7168 * 2048
    assert s.weight_bytes() == dense + experts
    assert LayerShape.named("glm52").layers_per_indexer == 4
    with pytest.raises(ValueError, match="geometry 'x'"):
        LayerShape.named("x")


def test_tokens_per_expert_is_the_busiest_local_expert():
    s = LayerShape.named("dsv32")
    # 8 ranks x 64 tokens x 8 experts over 256 experts: 16 per expert on average
    t = tokens_per_expert(s, 64)
    assert 16 <= t <= 40
    assert tokens_per_expert(s, 0) == 0
    assert tokens_per_expert(s, 64, seed=1) == tokens_per_expert(s, 64, seed=1)


def test_points_step_down_by_powers_of_two():
    assert log_points(97) == [97, 64, 32, 16, 8]
    assert log_points(64) == [64, 32, 16, 8]
    assert log_points(5, 2) == [5, 4, 2]


@pytest.mark.parametrize("attention", ["matmul", "fused"])
def test_layer_work_runs_every_stand_in_on_cpu(attention):
    shape = LayerShape.named("dsv32", **throughput.TINY)
    # bf16 values (the TINY shape's rows are bf16 MLA rows), no NaN among them
    kv = [torch.randn(4096, shape.mla_row_bytes // 2).bfloat16().view(torch.uint8)]
    work = ModelLayerWork(shape, max_batch=4, context=256, top_k=32, kv_rows=kv,
                          device=torch.device("cpu"), attention=attention)
    rows = torch.randint(-1, 4096, (4, 32), dtype=torch.int32)
    work.indexer(1, 3)  # the second key set
    want = indexer_logits_reference(work.index_q[:3], work.index_weights[:3],
                                    work.index_keys[1][:3], work.index_key_scales[1][:3])
    assert torch.equal(work.logits[:3], want)
    assert torch.equal(work.topk_values[:3], want.topk(32, dim=1).values)
    work.new_kv[0].random_(0, 255)
    work.before_attention(0, 3)  # the KV write and the absorbed query projection
    assert torch.equal(work.new_kv[1, :3], work.new_kv[0, :3]) and not work.new_kv[1, 3].any()
    j = [name for name, _, _ in work.gemm_shapes].index(PRE_ATTENTION_GEMM)
    _, i, o = work.gemm_shapes[j]
    assert torch.equal(work.act_out[:3, :o], work.act_in[:3, :i] @ work.sets[0][0][j])
    work.attn_out.zero_()
    work.attention(0, rows, 3)
    if attention == "fused":  # off the GPU: the fused kernel's torch twin
        want = sparse_mla_decode_reference(work.attn_q[:3], kv[0], rows[:3], work.mla_layout,
                                           work.sm_scale)
        assert torch.equal(work.attn_out[:3], want.bfloat16())
    else:  # the gathered rows, then the products over one row set's values
        flat = rows[:3].reshape(-1).clamp_min(0).long()
        assert torch.equal(work.reads[:flat.numel()], kv[0][flat])
        assert work.attn_out[:3].any()
    assert not work.attn_out[3].any()
    with pytest.raises(ValueError, match="attention stand-in 'x'"):
        ModelLayerWork(shape, max_batch=1, context=8, top_k=4, kv_rows=kv,
                       device=torch.device("cpu"), attention="x")
    work.mlp(0, 3)


@pytest.mark.slow  # ~30 s: four engines (two plans, two runs) on 2 cores
def test_cpu_smoke_run_through_the_scheduler(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = throughput.main(["--geometries", "dsv32", "--json", str(out), "--timed-steps", "2"])
    assert rc == 0
    data = json.loads(out.read_text())
    (case,) = data["cases"]
    runs = case["runs"]
    assert case["hybrid_requests"] > case["full_requests"] > 0
    assert runs["full"]["peak_running"] == case["full_requests"]
    assert runs["hybrid"]["peak_running"] == case["hybrid_requests"]
    # the departures step the batch through every point, each timed (hybrid and oracle)
    for kind, n in (("full", case["full_requests"]), ("hybrid", case["hybrid_requests"])):
        points = runs[kind]["points"]
        top = max(map(int, points))  # the running count when decoding began (vLLM's
        assert 0.9 * n <= top <= n   # watermark may hold back the last request)
        assert sorted(map(int, points), reverse=True) == log_points(top, 2)
        for p in points.values():
            assert all(s["timed_steps"] == (2 if kind == "full" else 1) for s in p.values())
    top = runs["hybrid"]["points"][str(case["hybrid_requests"])]
    assert top["hybrid"]["miss_rate"] > 0
    printed = capsys.readouterr().out
    assert "hybrid / oracle" in printed and "DeepSeek-V3.2" in printed
    # without --dbo-ceiling nothing of the two-micro-batch ceiling is run, stored or printed
    assert "dbo" not in out.read_text().replace('"dbo_ceiling": false', "")
    assert "dbo" not in printed
    # no CUDA: no host link measured, none printed
    assert data["host_link"] == {} and "host link" not in printed
    # the docs' table over two starts, the second with a recorded link
    second = dict(data, host_link=dict(dma_h2d_gbps=53.1, dma_d2h_gbps=54.2,
                                       gather_gbps={"656": 31.5},
                                       default_grid_gather_gbps={"656": 29.0},
                                       gather_rows=16384,
                                       span_bytes=2 << 30, ctas_per_sm=1))
    other = tmp_path / "u.json"
    other.write_text(json.dumps(second))
    assert throughput_table.main([str(out), str(other)]) == 0
    table = capsys.readouterr().out.splitlines()
    (row,) = [line for line in table if line.startswith("| DeepSeek-V3.2 |")]
    h = throughput_report.headline(case)
    assert f"**{h['hybrid_over_full']:.2f} / {h['hybrid_over_full']:.2f}**" in row
    assert "largest gap between the starts' ratios: 0.0 %" in "\n".join(table)
    # a start that did not run the case keeps its place in every cell
    none = tmp_path / "none.json"
    none.write_text(json.dumps(dict(data, cases=[])))
    assert throughput_table.main([str(out), str(none)]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("| DeepSeek-V3.2 |")]
    assert f"**{h['hybrid_over_full']:.2f} / –**" in row
    links = [line for line in table if "host link" in line]
    assert links == [f"{other}: host link of this start: DMA H2D 53.1 / D2H 54.2 GB/s; 16384 "
                     "random rows from 2 GiB pinned, 1 CTA per SM: 656 B 31.5 (default grid "
                     "29.0) GB/s"]


def test_device_plan_counts_one_backing_allocation():
    """Every KVCacheTensor of a plan views one backing allocation, so a block id costs
    545,792 B for DeepSeek-V3.2 (what ``vllm-hisparse plan`` and vLLM's allocation say), not
    the sum over the six tensors (3,274,752 B: the bug sized benchmark pools 6x too small)."""
    import argparse

    a = argparse.Namespace(block_size=64, top_k=2048, host_layout="layer",
                           hot_region_eviction=None, adaptive_hot_region=False,
                           gather_ctas_per_sm=None, inline_conversion=False)
    spec = throughput.sim_spec(a, LayerShape.named("dsv32"), 61, 32768, 1, 64, "cpu")
    assert spec.connector_extra == {"host_layout": "layer"}  # --host-layout's plumbing
    plan = throughput.device_plan(spec)
    assert plan["bytes_per_block"] == 545_792
    assert (plan["num_sparse_groups"], plan["num_indexer_groups"]) == (5, 1)


def test_residency_options_reach_the_connector_extra_config():
    """--hot-region-eviction / --adaptive-hot-region / --gather-ctas-per-sm /
    --inline-conversion become the
    connector's extra-config keys (as simulate passes them); an eviction given runs the scored
    drift for lru and score."""
    import argparse

    def spec(**options):
        a = argparse.Namespace(block_size=64, top_k=2048, host_layout="auto",
                               hot_region_eviction=None, adaptive_hot_region=False,
                               gather_ctas_per_sm=None, inline_conversion=False)
        vars(a).update(options)
        return throughput.sim_spec(a, LayerShape.named("dsv32"), 2, 4096, 1, 64, "cpu")

    assert spec().connector_extra == {"host_layout": "auto"}
    assert spec().topk_drift == "uniform"
    assert spec(host_layout="layer").connector_extra == {"host_layout": "layer"}
    assert spec(gather_ctas_per_sm=1).connector_extra == {"host_layout": "auto",
                                                          "gather_ctas_per_sm": 1}
    assert spec(inline_conversion=True).connector_extra == {"host_layout": "auto",
                                                            "overlap_conversion": False}
    for eviction in ("lru", "score"):
        s = spec(hot_region_eviction=eviction, adaptive_hot_region=True)
        assert s.connector_extra == {"host_layout": "auto", "adaptive_hot_region": True,
                                     "hot_region_eviction": eviction}
        assert s.topk_drift == "scored"


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_split_batch_covers_every_token_exactly_once(parts):
    for batch in range(0, 41):
        spans = split_batch(batch, parts)
        tokens = [t for first, stop in spans for t in range(first, stop)]
        assert tokens == list(range(batch))  # consecutive, each token once, in order
        sizes = [stop - first for first, stop in spans]
        assert all(size > 0 for size in sizes)  # no empty micro-batch
        assert len(spans) == min(parts, batch)
        assert sizes == sorted(sizes, reverse=True) and max(sizes, default=0) - min(
            sizes, default=0) <= 1
    assert split_batch(1) == [(0, 1)]  # nothing to overlap one token with
    assert split_batch(5) == [(0, 3), (3, 5)]
    assert split_batch(8) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="parts=0"):
        split_batch(4, 0)


def test_layer_work_over_halves_is_the_whole_batch_read_twice():
    """Each stand-in run over the two halves writes what it writes over the whole batch (every
    token once), while the EP wait runs once per half and each half's experts get the router
    stand-in's token count for that half."""
    shape = LayerShape.named("dsv32", **throughput.TINY)
    # bf16 values (the TINY shape's rows are bf16 MLA rows), no NaN among them
    kv = [torch.randn(4096, shape.mla_row_bytes // 2).bfloat16().view(torch.uint8)]
    work = ModelLayerWork(shape, max_batch=5, context=256, top_k=32, kv_rows=kv,
                          device=torch.device("cpu"))
    rows = torch.randint(-1, 4096, (5, 32), dtype=torch.int32)
    waits = []
    work.spin = waits.append

    def outputs(spans):
        for buf in (work.logits, work.topk_indices, work.attn_out, work.act_out):
            buf.zero_()
        for first, stop in spans:
            work.indexer(0, stop, first)
            work.before_attention(0, stop, first)
            work.attention(0, rows, stop, first)
            work.mlp(0, stop, first)
        return [t[:5].clone() for t in (work.logits, work.topk_indices)] + [
            work.attn_out[:5 * shape.heads].clone(), work.act_out[:5].clone()]

    whole = outputs([(0, 5)])
    assert len(waits) == 2 and sorted(work._expert_tokens) == [5]
    halves = outputs(split_batch(5))
    assert len(waits) == 6  # dispatch and combine per half
    assert sorted(work._expert_tokens) == [2, 3, 5]
    assert work.expert_tokens(3) == min(work.max_expert_tokens, tokens_per_expert(shape, 3))
    for a, b in zip(whole, halves):
        assert torch.allclose(a.float(), b.float(), rtol=0.02, atol=1e-3)
    # a half alone leaves the other half's tokens untouched
    outputs([(3, 5)])
    assert not work.act_out[:3].any() and work.act_out[3:5].any()


def test_dbo_ceiling_is_off_by_default():
    import argparse

    a = argparse.Namespace(timed_steps=6)
    assert throughput.timed_steps(a, "hybrid") == 6
    a.dbo_ceiling = True
    assert throughput.timed_steps(a, "full") == 6
    assert throughput.timed_steps(a, "hybrid") == 9  # hybrid and oracle keep 3 each
    a.timed_steps = 5
    assert throughput.timed_steps(a, "hybrid") == 9
    probe = GraphStepProbe(None, 1, 2)
    assert probe.connector_kinds == ("hybrid", "oracle")
    probe.dbo_ceiling = True
    assert probe.connector_kinds == ("hybrid", "oracle", "dbo_ceiling")


def test_cpu_smoke_run_with_the_dbo_ceiling(tmp_path, capsys, monkeypatch):
    """--dbo-ceiling through the real path: the ceiling's steps run each layer's MLP once per
    half of the batch, and every connector point gets the third system with finite figures."""
    import math

    calls = []
    forward = GraphStepProbe._forward

    def recording(self, n, **kw):
        calls.append((n, kw.get("micro_batches", 1), kw.get("oracle", False)))
        return forward(self, n, **kw)

    monkeypatch.setattr(GraphStepProbe, "_forward", recording)
    mlp_calls = []
    mlp = ModelLayerWork.mlp

    def recording_mlp(self, layer, batch, first=0):
        mlp_calls.append((batch, first))
        return mlp(self, layer, batch, first)

    monkeypatch.setattr(ModelLayerWork, "mlp", recording_mlp)
    out = tmp_path / "t.json"
    rc = throughput.main(["--geometries", "glm52", "--max-requests", "4", "--timed-steps", "2",
                          "--dbo-ceiling", "--json", str(out)])
    assert rc == 0
    (case,) = json.loads(out.read_text())["cases"]
    hybrid = case["runs"]["hybrid"]["points"]
    assert hybrid and all(sorted(p) == ["dbo_ceiling", "hybrid", "oracle"]
                          for p in hybrid.values())
    for p in hybrid.values():
        assert all(s["timed_steps"] == 1 for s in p.values())  # one each: 3 x ceil(2 / 2)
        d = p["dbo_ceiling"]
        for key in ("tokens_per_s", "gpu_ms_median", "host_ms_median"):
            assert math.isfinite(d[key]) and d[key] > 0
    assert all("dbo_ceiling" not in p for p in case["runs"]["full"]["points"].values())
    rows = case["dbo_ceiling"]
    assert [r["concurrency"] for r in rows] == sorted(map(int, hybrid), reverse=True)
    for r in rows:
        assert math.isfinite(r["dbo_ceiling_over_hybrid"]) and r["dbo_ceiling_over_hybrid"] > 0
        assert r["range"][0] <= r["tokens_per_s"] <= r["range"][1]
    # the ceiling's forward: the oracle's (no miss copies), split in two micro-batches
    ceiling = [(n, oracle) for n, parts, oracle in calls if parts == 2]
    assert ceiling and all(oracle for _, oracle in ceiling)
    assert {n for n, _ in ceiling} == set(map(int, hybrid))
    for n in {n for n, _ in ceiling if n > 1}:
        assert (n, (n + 1) // 2) in mlp_calls  # the second half's MLP
    printed = capsys.readouterr().out
    assert "dbo ceiling tok/s" in printed and "dbo ceiling / hybrid" in printed


@pytest.mark.slow  # ~10 s: one full and one hybrid run
def test_a_pool_of_one_full_request_holds_the_runs_longest_request(tmp_path):
    """At 2K tokens the tiny KV budget plans one full request; the run decodes more than the
    plan's 64 tokens, so a pool of exactly the plan was short of vLLM's one-request check."""
    out = tmp_path / "t.json"
    assert throughput.main(["--geometries", "dsv32", "--contexts", "2048", "--max-requests",
                            "32", "--timed-steps", "2", "--json", str(out)]) == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["full_requests"] == 1 and case["runs"]["full"]["peak_running"] == 1
    assert throughput.pool_blocks(99) == 101


def test_host_link_is_not_measured_without_cuda():
    assert host_link.measure([656, 1152], torch.device("cpu")) == {}
    assert host_link.describe({}) == ""


@pytest.mark.gpu
def test_host_link_measures_every_row_size_on_the_gpu():
    link = host_link.measure([1152, 656, 656], torch.device("cuda"))
    assert sorted(link["gather_gbps"]) == sorted(link["default_grid_gather_gbps"]) == ["1152",
                                                                                     "656"]
    # a PCIe link: each figure positive and below what any x16 Gen5/Gen6 link carries
    for gbps in (link["dma_h2d_gbps"], link["dma_d2h_gbps"], *link["gather_gbps"].values(),
                 *link["default_grid_gather_gbps"].values()):
        assert 1.0 < gbps < 260.0
