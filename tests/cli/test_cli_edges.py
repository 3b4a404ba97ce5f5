"""The command line's edges (issue 18 item 4): argument errors before the heavy imports,
Ctrl-C, flags that only make sense together, the simulator's replaced keys, ``replay --help``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm")
# Imported here, so that torch's and vLLM's import-time warnings land before any test's stderr.
import vllm_hisparse.vllm.simulation.engine  # noqa: E402,F401

from vllm_hisparse.cli.main import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# Runs each argv in one fresh interpreter and reports, per argv, the exit status, stderr and
# whether torch or vLLM had been imported when the command gave up.
_PROBE = textwrap.dedent("""
    import contextlib, io, json, sys, time
    from vllm_hisparse.cli.main import main
    out = []
    for argv in json.loads(sys.argv[1]):
        err, started = io.StringIO(), time.perf_counter()
        with contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:
                code = exc.code
        out.append({"code": code, "stderr": err.getvalue(), "s": time.perf_counter() - started,
                    "torch": "torch" in sys.modules, "vllm": "vllm" in sys.modules})
    print(json.dumps(out))
""")


def test_simulate_rejects_bad_arguments_before_importing_torch_or_vllm(tmp_path):
    """docs/cli.md: bad input is refused while the command line is checked; importing torch
    and vLLM takes a minute or more on a loaded 2-core machine, so no check may wait for it."""
    scored = tmp_path / "score.json"
    scored.write_text(json.dumps({
        "kv_connector": "HiSparseResidencyConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pool_gib": 4, "hot_region_eviction": "score"}}))
    stock = ROOT / "examples" / "pd-nixl" / "prefill_kv_transfer_config.json"
    cases = {
        ("--requests", "0"): "--requests=0 is invalid; accepted: a positive integer",
        ("--block-size", "48"): "--block-size=48 is invalid; accepted: 16, 32 or 64",
        ("--threads", "0"): "--threads=0 is invalid",
        ("--host-pool-gib", "100000"): "--host-pool-gib=100000 does not fit",
        ("--hot-region-eviction", "score"):
            "--hot-region-eviction=score is invalid with --topk-drift=uniform: score-aware "
            "eviction needs the indexer's scores, which only --topk-drift scored computes",
        ("--connector-config", str(scored)): "--hot-region-eviction=score is invalid with "
                                             "--topk-drift=uniform",
        ("--connector-config", str(tmp_path / "none.json")):
            f"--connector-config={tmp_path / 'none.json'} is invalid",
        ("--connector-config", str(stock)): "names no HiSparseResidencyConnector",
    }
    from vllm_hisparse.cli import simulate
    from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME

    assert simulate.CONNECTOR_NAME == CONNECTOR_NAME  # its copy, kept to avoid importing vLLM
    argvs = [["simulate", "--quiet", *flags] for flags in cases]
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    assert len(results) == len(cases)
    for (flags, message), result in zip(cases.items(), results):
        assert result["code"] == 2, (flags, result)
        assert message in result["stderr"] and result["stderr"].count("\n") == 1, (flags, result)
        assert not result["vllm"] and not result["torch"], (flags, "imported before refusing")


def _interrupt_at_step(monkeypatch, label: str, step: int) -> None:
    """Ctrl-C while the run ``label`` executes step ``step`` (inside the engine's loop)."""
    from vllm_hisparse.vllm.simulation import engine

    forward = engine._Run._forward

    def interrupted(self, output):
        if self.label == label and self.step == step:
            raise KeyboardInterrupt
        return forward(self, output)

    monkeypatch.setattr(engine._Run, "_forward", interrupted)


def test_ctrl_c_in_simulate_exits_130_with_one_line_and_the_partial_report(tmp_path, capsys,
                                                                           monkeypatch):
    _interrupt_at_step(monkeypatch, "with connector", 7)
    out = tmp_path / "sim.json"
    status = main(["simulate", "--requests", "4", "--prompt-len", "256", "--output-len", "32",
                   "--device-blocks", "120", "--layers", "2", "--quiet", "--json", str(out)])
    captured = capsys.readouterr()
    assert status == 130
    assert captured.err.splitlines() == [
        "vllm-hisparse simulate: interrupted (Ctrl-C) during the run with connector, at step 6 "
        "(0/4 requests finished)", f"wrote {out}"]
    assert "Traceback" not in captured.err + captured.out
    assert "| without connector |" in captured.out  # the run that completed
    report = json.loads(out.read_text())
    assert report["status"] == "interrupted" and report["error"].startswith("interrupted (Ctrl-C)")
    assert list(report["runs"]) == ["without connector"]
    assert report["interrupted"]["label"] == "with connector"
    assert report["interrupted"]["step"] == 6  # the last step that completed


def test_ctrl_c_in_any_subcommand_is_one_line_and_status_130(monkeypatch, capsys):
    from vllm_hisparse.cli import replay

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(replay, "run", interrupted)
    with pytest.raises(SystemExit) as info:
        main(["replay"])
    assert info.value.code == 130
    assert capsys.readouterr().err == "vllm-hisparse replay: interrupted (Ctrl-C)\n"


def test_replay_help_documents_every_policy_and_when_a_plot_is_written(capsys):
    from vllm_hisparse.core.replacement import POLICIES

    with pytest.raises(SystemExit) as info:
        main(["replay", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for policy in POLICIES:
        assert f"{policy}: " in text, policy
    assert "current: keep only this step's selections" in text
    assert "without it no plot is written" in text
