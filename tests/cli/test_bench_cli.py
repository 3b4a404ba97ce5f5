"""``vllm-hisparse bench`` on a CPU-only machine."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_hisparse.cli.main import main


def test_reference_target_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "ref.json"
    assert main(["bench", "reference", "--requests", "2", "--topk", "128", "--hot-slots", "256",
                 "--context", "2048", "--repeats", "1", "--json", str(out)]) == 0
    assert "reference.resolve" in capsys.readouterr().out
    assert json.loads(out.read_text())["topk"] == 128


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
@pytest.mark.parametrize("target", ["kernels", "graphs"])
def test_gpu_targets_say_they_need_a_gpu(capsys, target):
    assert main(["bench", target]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_arguments_without_a_target_are_refused(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--", "--quick"])
    assert info.value.code == 2


def test_unknown_target(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "everything"])
    assert info.value.code == 2
    assert "invalid choice: 'everything'" in capsys.readouterr().err


def test_clustering_target_prints_rows_per_host_page(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert main(["bench", "clustering", "--steps", "30", "--requests", "1",
                 "--group-layers", "1", "8", "--json", str(out)]) == 0
    assert "rows per host page: position-major" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 4 and all(r["misses"] > 0 for r in rows)
    single = next(r for r in rows if r["gather_layers"] == 1)
    group = next(r for r in rows if r["gather_layers"] == 8 and r["trace"] == single["trace"])
    # eight layers of a position are adjacent in the position-major pool: fewer pages per row
    assert group["rows_per_host_page"]["position"] > 2 * single["rows_per_host_page"]["position"]


@pytest.mark.slow
def test_connector_target_smoke_run_alternates_hybrid_and_oracle_steps(tmp_path, capsys):
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the GPU sizes are for scripts/gpu_session.sh")
    out = tmp_path / "conn.json"
    assert main(["bench", "connector", "--geometries", "1", "--context", "256",
                 "--timed-steps", "4", "--warmup-steps", "1", "--max-requests", "6", "--hbm-gib", "0.0024",
                 "--json", str(out)]) == 0
    assert "hybrid / oracle" in capsys.readouterr().out
    (r,) = json.loads(out.read_text())["results"]
    assert [s["kind"] for s in r["steps"]] == ["hybrid", "oracle"] * 2
    assert r["full"]["timed_steps"] == 4
    assert r["hybrid_requests"] > r["full_requests"], (r["full_requests"], r["hybrid_requests"])
    assert r["hybrid"]["mean_batch"] == r["hybrid_requests"]  # every request decodes together
    assert r["hybrid"]["miss_rate"] > 0 and "hybrid_over_oracle" in r
