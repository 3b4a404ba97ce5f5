"""``simulate --topk-drift scored``: decode selections from synthetic indexer scores through
vLLM's real ``SparseIndexerTopk`` (``vllm/simulation/scored_indexer.py``), on vLLM's real
Scheduler with both connector roles. Every row read is checked against the ground truth by
the engine (a mismatch raises)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm_hisparse.core.trace import ScoreProcess  # noqa: E402
from vllm_hisparse.vllm import compat  # noqa: E402
from vllm_hisparse.vllm.simulation.engine import SimulationEngine  # noqa: E402
from vllm_hisparse.vllm.simulation.scored_indexer import (  # noqa: E402
    RECENT_BONUS,
    RequestScores,
    ScoredIndexer,
    decodes_first,
)
from vllm_hisparse.vllm.simulation.spec import RequestPlan, SimulationSpec  # noqa: E402

# 6 requests of 320 + 64 tokens on 80 blocks: every request is demoted (host-backed reads);
# one index unit of 2 layers, top-k 32 over contexts of 320-384 positions.
SCORED = SimulationSpec(num_layers=2, layers_per_indexer=2, block_size=16, top_k=32,
                        prefill_top_k=4, device_blocks=80, max_num_seqs=8,
                        max_num_batched_tokens=512, num_requests=6, prompt_len=320,
                        output_len=64, topk_drift="scored")


def _run(spec: SimulationSpec, monkeypatch, eviction: str = "lru"):
    """One run with the connector; returns (result, [(logits, top-k) of every call of vLLM's
    SparseIndexerTopk.forward])."""
    cls = compat.indexer_topk_class()
    original = cls.forward
    calls = []

    def forward(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len):
        original(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)
        calls.append((logits.clone(), topk_indices.clone()))

    monkeypatch.setattr(cls, "forward", forward)
    spec = dataclasses.replace(spec, connector_extra={"hot_region_eviction": eviction})
    engine = SimulationEngine(spec)
    try:
        result = engine.run(True)
    finally:
        engine.close()
        monkeypatch.setattr(cls, "forward", original)
    return result, calls


def test_scored_run_is_exact_deterministic_and_selected_by_vllms_topk(monkeypatch):
    first, calls = _run(SCORED, monkeypatch)
    assert first.finished == 6 and first.rows_checked > 0
    assert first.demotions > 0 and first.misses > 0 and first.hot_hits > 0
    # One call per index unit leader and step with decode tokens: a decode row per token.
    decode_tokens = 6 * (64 - 1)  # the first output token comes from the prefill
    assert sum(topk.shape[0] for _, topk in calls) == decode_tokens
    for logits, topk in calls:
        assert logits.dtype == torch.float32 and topk.dtype == torch.int32
        assert topk.shape[1] == 32 and (topk >= 0).all()
        # The selections are the K best finite scores of each row.
        best = torch.topk(logits, 32, dim=1).values
        assert torch.equal(torch.gather(logits, 1, topk.long()).sort(dim=1).values,
                           best.sort(dim=1).values)
        assert torch.isfinite(best).all()
    second, again = _run(SCORED, monkeypatch)
    assert dataclasses.replace(first, wall_s=0.0) == dataclasses.replace(second, wall_s=0.0)
    assert len(again) == len(calls)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(calls, again))


def test_score_eviction_misses_less_than_lru_on_the_scored_workload(monkeypatch):
    """A tight hot region (48 rows for top-k 32): evicting the slots the indexer scored lowest
    keeps the positions near the selection threshold that LRU drops (docs/core.md, "Beyond
    LRU"). Same workload, same selections, both exact; fewer misses with ``score``."""
    tight = dataclasses.replace(SCORED, device_buffer_size=48)
    lru, lru_calls = _run(tight, monkeypatch, "lru")
    score, score_calls = _run(tight, monkeypatch, "score")
    assert lru.misses > 0 and lru.rows_checked == score.rows_checked > 0
    assert all(torch.equal(a[1], b[1]) for a, b in zip(lru_calls, score_calls))
    assert score.misses < lru.misses, (score.misses, lru.misses)


def test_scores_are_the_replay_traces_plus_the_recency_bonus():
    """The simulator's scores are the calibrated trace's score process (same draws), plus
    RECENT_BONUS on the newest positions instead of the trace's forced selection."""
    scores = RequestScores(300, (7, 1), recent_tokens=16)
    twin = ScoreProcess(300, np.random.default_rng(np.random.SeedSequence([7, 1])))
    got, want = np.empty(300, np.float32), np.empty(300, np.float32)
    for ctx in (100, 101, 102):
        scores.step(ctx, got)
        twin.step(ctx, want)
        want[ctx - 16:ctx] += np.float32(RECENT_BONUS)
        assert np.array_equal(got[:ctx], want[:ctx])


def test_logits_are_the_same_bits_on_every_run_and_masked_past_each_context():
    def logits():
        indexer = ScoredIndexer(32, seed=5, device=torch.device("cpu"))
        a, b = indexer.request_scores(1, 200), indexer.request_scores(2, 200)
        return [indexer.logits([(a, 100 + s), (b, 20 + s)]) for s in range(3)]

    one, two = logits(), logits()
    for x, y in zip(one, two):
        assert np.array_equal(x.logits.numpy(), y.logits.numpy())
    step = one[2]
    assert step.seq_lens.flatten().tolist() == [102, 22] and step.max_seq_len == 102
    assert step.logits.shape == (2, 128)  # the longest context, rounded up to 64 columns
    assert torch.isfinite(step.logits[0, :102]).all() and torch.isinf(step.logits[0, 102:]).all()
    assert torch.isfinite(step.logits[1, :22]).all() and torch.isinf(step.logits[1, 22:]).all()
    # vLLM's top-k: K positions of the long row; the short row's 22 positions, then -1.
    out = torch.empty((2, 32), dtype=torch.int32)
    ScoredIndexer(32, seed=5, device=torch.device("cpu")).select(step, out)
    assert sorted(out[0].tolist()) == sorted(torch.topk(step.logits[0], 32).indices.tolist())
    assert sorted(out[1, :22].tolist()) == list(range(22)) and (out[1, 22:] == -1).all()


def test_decodes_come_first_in_scheduled_order():
    def entry(rid, prompt, start, n):
        return (rid, type("S", (), {"plan": RequestPlan(rid, 1, 0, prompt, 8)})(), start, n)

    batch = [entry("p1", 100, 0, 64), entry("d1", 10, 12, 1), entry("last", 100, 99, 1),
             entry("d2", 10, 10, 1), entry("p2", 100, 64, 36)]
    # "last" is the prompt's last token (a prefill token), not a decode.
    assert [e[0] for e in decodes_first(batch)] == ["d1", "d2", "p1", "last", "p2"]


@pytest.mark.parametrize("flag, in_file, want", [
    ([], None, "lru"), (["--hot-region-eviction", "score"], None, "score"),
    ([], "score", "score"), (["--hot-region-eviction", "lru"], "score", "lru")])
def test_cli_sets_and_reports_hot_region_eviction(flag, in_file, want, tmp_path, capsys):
    import json

    from vllm_hisparse.cli.main import main

    argv = ["simulate", "--requests", "2", "--prompt-len", "96", "--output-len", "8",
            "--block-size", "16", "--top-k", "16", "--layers", "2", "--device-blocks", "60",
            "--topk-drift", "scored", "--runs", "with", "--quiet", "--json",
            str(tmp_path / "sim.json")] + flag
    if in_file is not None:
        config = tmp_path / "kv.json"
        config.write_text(json.dumps({
            "kv_connector": "HiSparseResidencyConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"hot_region_eviction": in_file}}))
        argv += ["--connector-config", str(config)]
    assert main(argv) == 0
    spec = json.loads((tmp_path / "sim.json").read_text())["spec"]
    assert spec["topk_drift"] == "scored"
    assert spec["connector_extra"]["hot_region_eviction"] == want
    out = capsys.readouterr().out
    assert "scored top-k drift" in out and ("score hot-slot eviction" in out) == (want == "score")
