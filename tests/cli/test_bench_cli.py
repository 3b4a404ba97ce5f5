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
