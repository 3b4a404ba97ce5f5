"""``vllm-hisparse plan``: figures, the pasted config, presets, bad arguments."""

from __future__ import annotations

import json

import pytest

from vllm_hisparse.cli.main import main
from vllm_hisparse.core.capacity import DEEPSEEK_V32_FP8, GIB, concurrency_report, layout_for_geometry


def test_plan_matches_the_capacity_math_and_prints_a_pasteable_config(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--contexts", "32768", "--kv-gib", "60", "--host-gib", "384",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    c = concurrency_report(layout_for_geometry(DEEPSEEK_V32_FP8, device_kv_bytes=60 * GIB,
                                     host_pool_bytes=384 * GIB, device_buffer_size_rows=4096,
                                     admission_window_tokens=8192), 32768)
    row = plan["contexts"][0]
    assert (row["full_only"], row["hybrid_steady"], row["hybrid_at_admission"]) == \
        (c.max_concurrency_without_residency, c.max_concurrency_steady, c.max_concurrency_at_admission)
    assert (plan["num_sparse_groups"], plan["num_indexer_groups"], plan["bytes_per_block"]) == (5, 1, 545_792)
    assert "KV cache groups: 5 sparse-MLA + 1 indexer, 118,038 blocks of 545,792 B" in text
    assert row["hybrid_steady"] >= 3 * row["full_only"]  # the point of the package
    line = next(l for l in text.splitlines() if l.startswith("--kv-transfer-config"))
    config = json.loads(line.split("'")[1])
    assert config["kv_connector"] == "HiSparseResidencyConnector"
    assert config["kv_connector_extra_config"]["host_pool_gib"] == plan["recommended_host_pool_gib"]
    # The recommended pool holds the device-limited steady state of the largest context.
    assert plan["recommended_host_pool_gib"] >= row["host_gib_for_device_limit"]


def test_index_share_presets_keep_fewer_indexer_keys_on_device(capsys):
    plans = {}
    for model in ("glm-5.1", "glm-5.2"):
        assert main(["plan", "--model", model, "--contexts", "131072"]) == 0
        plans[model] = capsys.readouterr().out
    assert "(78 with an indexer)" in plans["glm-5.1"]
    assert "(21 with an indexer)" in plans["glm-5.2"]
    # IndexShare prefetch can take the followers' copies off the critical path, not the
    # leaders' launches; without IndexShare every copy stays on it.
    assert "copies of 42 of 78 layers (each group's first launch)" in plans["glm-5.2"]
    assert "no copy can be prefetched" in plans["glm-5.1"]


def test_plan_reports_the_critical_path_share_of_the_io(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "glm-5.2", "--contexts", "32768", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    row = plan["contexts"][0]
    assert plan["critical_path_layers"] == 42
    assert row["io_ms_per_step_critical_path_at_best"] == pytest.approx(
        row["io_ms_per_step_at_steady"] * 42 / 78)


def test_small_host_pool_limits_the_steady_state(tmp_path):
    out = tmp_path / "p.json"
    assert main(["plan", "--host-gib", "20", "--contexts", "131072", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["contexts"][0]
    assert row["steady_limited_by"] == "host"


def test_custom_geometry_and_spec_tokens(tmp_path):
    out = tmp_path / "p.json"
    assert main(["plan", "--model", "custom", "--layers", "4", "--row-bytes", "1152",
                 "--spec-tokens", "1", "--contexts", "65536", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["device_buffer_size"] == 3 * 2048
    assert plan["kv_transfer_config"]["kv_connector_extra_config"]["device_buffer_size"] == 6144


@pytest.mark.parametrize("argv,text", [
    (["plan", "--model", "custom", "--layers", "4"], "--model custom needs --row-bytes"),
    (["plan", "--layers", "4"], "--layers is only for --model custom"),
    (["plan", "--model", "custom", "--layers", "4", "--row-bytes", "100"], "multiple of 16"),
    (["plan", "--kv-gib", "0"], "argument --kv-gib: expected a finite number > 0, got '0'"),
    (["plan", "--kv-gib", "nan"], "argument --kv-gib: expected a finite number > 0, got 'nan'"),
    (["plan", "--host-gib", "inf"], "argument --host-gib: expected a finite number > 0"),
    (["plan", "--link-gbs", "-40"], "argument --link-gbs: expected a finite number > 0"),
    (["plan", "--miss-rate", "2"], "argument --miss-rate: expected a number in [0, 1], got '2'"),
    (["plan", "--miss-rate", "nan"], "argument --miss-rate: expected a number in [0, 1]"),
    (["plan", "--contexts", "0"], "argument --contexts: expected an integer > 0, got '0'"),
    (["plan", "--spec-tokens", "-1"], "argument --spec-tokens: expected an integer >= 0"),
    (["plan", "--top-k", "0"], "argument --top-k: expected an integer > 0"),
    (["plan", "--json", "/nonexistent-dir/p.json"], "argument --json: /nonexistent-dir/p.json: "
     "directory /nonexistent-dir does not exist"),
    (["plan", "--device-buffer-size", "100"], "multiple of the block size"),
    (["plan", "--device-buffer-size", "1024"], "cannot hold one step's selections"),
    (["plan", "--spec-tokens", "20"], "at most 32768"),
    (["plan", "--model", "llama"], "invalid choice: 'llama'"),
])
def test_bad_arguments_exit_2_with_a_message(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert text in err
    assert err.count("\n") == 1 and err.startswith("vllm-hisparse plan: error: ")  # one line


@pytest.mark.parametrize("model, layout, why", [
    ("deepseek-v3.2", "layer", "layer-major: an indexer in every layer"),
    ("glm-5.1", "layer", "layer-major: an indexer in every layer"),
    ("glm-5.2", "position", "position-major: IndexShare groups of up to 4 layers"),
])
def test_plan_names_the_host_layout_auto_picks(model, layout, why, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", model, "--contexts", "32768", "--json", str(out)]) == 0
    assert f"host pool layout (host_layout auto): {why}" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["host_layout"] == layout and data["host_layout_reason"].startswith(why)
