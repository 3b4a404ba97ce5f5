"""The CLI as an operator meets it: one-line errors naming the flag or file (exit 2, no
traceback), output files checked before the work and announced after it, the table kept when a
write fails, CPU-sized benchmark defaults, plan's refusal to recommend a losing connector, and
no vLLM / torch noise unless ``--verbose``. Every test runs the real entry point."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm_hisparse.cli.main import main
from vllm_hisparse.core.trace import TraceRecorder

REPLAY = ["replay", "--requests", "2", "--steps", "10", "--top-k", "256", "--context", "4096",
          "--capacities", "256", "1024"]
SIMULATE = ["simulate", "--requests", "2", "--prompt-len", "128", "--output-len", "16",
            "--device-blocks", "40", "--quiet"]


def _one_line_error(capsys, argv, command: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vllm-hisparse {command}: error: ") and err.count("\n") == 1, err
    return err


# ------------------------------------------------------------------ numeric flags


@pytest.mark.parametrize("argv,text", [
    (["bench", "reference", "--requests", "-1"], "argument --requests: expected an integer > 0"),
    (["bench", "reference", "--miss", "nan"], "argument --miss: expected a number in [0, 1]"),
    (["bench", "reference", "--repeats", "0"], "argument --repeats: expected an integer > 0"),
    (["bench", "reference", "--context", "100"], "--context 100 must be a multiple of"),
    (["bench", "reference", "--resident", "0.7", "--miss", "0.5"], "must be at most 1"),
    (["bench", "capacity", "--hbm-gib", "nan"], "argument --hbm-gib: expected a finite number"),
    (["bench", "capacity", "--rounds", "0"], "argument --rounds: expected an integer > 0"),
    (["bench", "capacity", "--index-group-layers", "-1"],
     "argument --index-group-layers: expected an integer >= 0"),
    (["bench", "capacity", "--contexts", "inf"], "argument --contexts: expected an integer > 0"),
])
def test_bench_numeric_flags_are_checked(argv, text, capsys):
    assert text in _one_line_error(capsys, argv, " ".join(argv[:2]))


def test_simulate_device_blocks_1_names_the_flag(capsys):
    err = _one_line_error(capsys, SIMULATE[:-3] + ["--device-blocks", "1", "--quiet"],
                          "simulate")
    assert "--device-blocks=1 is invalid" in err and "gpu_memory_utilization" not in err


@pytest.mark.parametrize("flags,text", [
    (["--adaptive-hot-region", "--hot-region-target-miss-rate", "2"],
     "hot_region_target_miss_rate=2.0 is invalid; accepted: a number greater than 0"),
    (["--hot-region-target-miss-rate", "0.1"], "adaptive_hot_region is false"),
])
def test_simulate_hot_region_flags_are_checked(flags, text, capsys):
    assert text in _one_line_error(capsys, SIMULATE + flags, "simulate")


def test_simulate_host_pool_larger_than_ram_is_refused_before_allocating(capsys):
    from vllm_hisparse.cli.memory import available_memory

    if available_memory()[0] is None:
        pytest.skip("this machine reports no available memory")
    err = _one_line_error(capsys, SIMULATE + ["--host-pool-gib", "100000"], "simulate")
    assert "--host-pool-gib=100000 does not fit" in err and "would take 100000 GiB" in err
    assert re.search(r"this machine can allocate [\d.]+ GiB \((MemAvailable|cgroup)", err)


# ------------------------------------------------------------------ trace files


def _trace_with_meta(tmp_path, meta: str):
    rec = TraceRecorder(top_k=4, block_size=4, source="test")
    rec.add(7, 0, [1, 2, 3])
    good = tmp_path / "good.npz"
    rec.trace().save(str(good))
    arrays = dict(np.load(good))
    arrays["meta"] = np.array(meta)
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("meta,text", [
    ("{not json", "malformed 'meta': not JSON"),
    ("[1, 2]", "malformed 'meta': expected a JSON object, got list"),
    ('{"format": "vllm-hisparse-trace", "version": 1, "top_k": "x", "block_size": 4}',
     "malformed 'meta': top_k must be a positive integer, got 'x'"),
    ('{"format": "other", "version": 1}', "trace format 'other'"),
])
def test_replay_malformed_meta_names_the_file(tmp_path, meta, text, capsys):
    path = _trace_with_meta(tmp_path, meta)
    err = _one_line_error(capsys, ["replay", "--trace", path, "--capacities", "3"], "replay")
    assert f"--trace {path}: " in err and text in err


# ------------------------------------------------------------------ output files


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_output_paths_are_checked_before_the_work(tmp_path, flag, capsys):
    for path, text in [(str(tmp_path), "is a directory"),
                       (str(tmp_path / "missing" / "out"), "does not exist")]:
        err = _one_line_error(capsys, REPLAY + [flag, path], "replay")
        assert f"argument {flag}: " in err and text in err


def test_every_written_file_is_announced(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(REPLAY + ["--json", str(out), "--plot", str(png)]) == 0
    err = capsys.readouterr().err
    assert f"wrote {out}\n" in err and f"wrote {png}\n" in err
    assert main(["plan", "--contexts", "32768", "--json", str(out)]) == 0
    assert f"wrote {out}\n" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failed_write_keeps_the_table_and_names_the_flag(capsys):
    assert main(REPLAY + ["--json", "/dev/full"]) == 1
    captured = capsys.readouterr()
    assert captured.out.startswith("| hot rows |") and "| 1024 |" in captured.out
    assert "vllm-hisparse replay: error: --json /dev/full: could not write" in captured.err
    assert "wrote" not in captured.err


# ------------------------------------------------------------------ plan's recommendation


def test_plan_does_not_recommend_a_losing_connector(tmp_path, capsys):
    out = tmp_path / "p.json"
    # 4K contexts: the hot region + tail is the whole request, hybrid residency saves nothing.
    assert main(["plan", "--contexts", "4096", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    plan = json.loads(out.read_text())
    row = plan["contexts"][0]
    assert row["gain"] < 1.1 and "too close to the whole 4096-token context" in \
        row["not_recommended_because"]
    assert plan["recommended"] is False and plan["kv_transfer_config"] is None
    assert "not recommended" in text and "--kv-transfer-config" not in text


def test_plan_says_when_nothing_fits(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan", "--contexts", "131072", "--kv-gib", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "no 131072-token request fits in --kv-gib 1" in text
    assert "--kv-transfer-config" not in text and not json.loads(out.read_text())["recommended"]


def test_plan_recommends_where_it_pays_and_names_the_contexts_where_it_does_not(capsys):
    assert main(["plan", "--contexts", "4096", "131072"]) == 0
    text = capsys.readouterr().out
    assert "at 4096 tokens the connector does not pay" in text
    assert "--kv-transfer-config" in text


# ------------------------------------------------------------------ bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only choice")
def test_bench_without_a_target_says_what_it_runs_and_why(monkeypatch, capsys):
    import vllm_hisparse.cli.benchmarks.reference as reference

    ran = []
    monkeypatch.setattr(reference, "main", lambda argv: ran.append(argv) or 0)
    assert main(["bench"]) == 0
    assert ran == [[]]
    assert ("vllm-hisparse bench: no target given, running reference: no CUDA device is "
            "visible" in capsys.readouterr().err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-sized defaults")
def test_bench_capacity_on_a_cpu_picks_cpu_sized_defaults(tmp_path, capsys):
    out = tmp_path / "cap.json"
    assert main(["bench", "capacity", "--contexts", "256", "--steps", "1", "--warmup", "0",
                 "--gather-modes", "single", "--json", str(out)]) == 0
    args = json.loads(out.read_text())["args"]
    assert (args["hbm_gib"], args["host_gib"], args["layers"]) == (0.01, 0.05, 2)
    assert "CPU-sized defaults" in capsys.readouterr().err


def test_bench_capacity_host_pool_larger_than_ram_is_one_line(capsys):
    err = _one_line_error(capsys, ["bench", "capacity", "--host-gib", "100000"],
                          "bench capacity")
    assert "--host-gib=100000 does not fit" in err and "this machine can allocate" in err


# ------------------------------------------------------------------ plots


def test_replay_plot_and_simulate_plot_write_pngs(tmp_path, capsys):
    png = tmp_path / "r.png"
    assert main(REPLAY + ["--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    png = tmp_path / "s.png"
    assert main(SIMULATE + ["--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in capsys.readouterr().err


def test_simulate_series_are_per_step_counts():
    """``--plot`` turns the engine's cumulative counters into each step's share."""
    from vllm_hisparse.cli.simulate import StepSeries
    from vllm_hisparse.vllm.simulation.results import Progress

    series = StepSeries()
    for step, (resident, hits, misses) in enumerate([(5, 0, 0), (9, 2, 1), (9, 5, 1)], 1):
        series(Progress("with connector", step, 2, 0, 0, 2, 30 - step, resident, hits, misses))
    run = series.runs["with connector"]
    assert run["resident"] == [5, 4, 0] and run["hot_hits"] == [0, 2, 3]
    assert run["misses"] == [0, 1, 0] and run["free_blocks"] == [29, 28, 27]


# ------------------------------------------------------------------ import noise

NOISE = ("deprecated", "Failed to import from vllm._C", "KVConnectorBase_V1", "INFO",
         "WARNING", "Warning", "W1")


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_hisparse.cli.main", *argv],
                          capture_output=True, text=True, timeout=600)


def test_plan_output_is_only_its_own():
    r = _cli("plan", "--contexts", "32768")
    assert r.returncode == 0 and r.stderr == ""
    assert not [n for n in NOISE if n in r.stdout]


@pytest.mark.slow
def test_simulate_output_has_no_vllm_or_torch_noise(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "s.json"
    r = _cli(*SIMULATE, "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert r.stderr == f"wrote {out}\n", r.stderr
    assert not [n for n in NOISE if n in r.stdout], r.stdout
    assert r.stdout.startswith("workload: 2 requests")
