"""``vllm-hisparse replay``: table, JSON, plot, and bad arguments."""

from __future__ import annotations

import json

import pytest

from vllm_hisparse.cli.main import main
from vllm_hisparse.core.trace import TraceRecorder

SMALL = ["replay", "--requests", "2", "--steps", "20", "--top-k", "256", "--context", "4096",
         "--capacities", "256", "512", "1024"]


def test_replay_prints_a_table_and_writes_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert main(SMALL + ["--json", str(out), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0] == ("| hot rows | hisparse | lru | fifo | random | current | belady | score "
                        "| frequency |")
    assert lines[6] == "share of the LRU (hisparse) -> Belady gap closed:"
    assert lines[7] == "| hot rows | lru | fifo | random | current | score | frequency |"
    assert len(lines) == 2 + 3 + 1 + 1 + 2 + 3
    data = json.loads(out.read_text())
    assert len(data["results"]) == 8 * 3
    for capacity in (256, 512, 1024):
        rates = {r["policy"]: r["miss_rate"] for r in data["results"]
                 if r["capacity_rows"] == capacity}
        assert rates["belady"] == min(rates.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_reads_a_recorded_trace(tmp_path, capsys):
    rec = TraceRecorder(top_k=4, block_size=4, source="test")
    for step, positions in enumerate([[1, 2, 3], [3, 4], [1, 5]]):
        rec.add(7, step, positions)
    path = tmp_path / "t.npz"
    rec.trace().save(str(path))
    assert main(["replay", "--trace", str(path), "--capacities", "3", "--policies", "belady",
                 "lru"]) == 0
    assert "| 3 |" in capsys.readouterr().out
    # a recorded trace has no score classes: the score policy is skipped, and said so
    assert main(["replay", "--trace", str(path), "--capacities", "3", "--policies", "score",
                 "hisparse", "belady"]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0] == "| hot rows | hisparse | belady |"
    assert "skipped score: the trace has no score classes" in captured.err


@pytest.mark.parametrize("argv,text", [
    (["replay", "--capacities", "0"], "argument --capacities: expected an integer > 0"),
    (["replay", "--policies", "clock"], "invalid choice: 'clock'"),
    (["replay", "--trace", "/nonexistent/t.npz"], "not a vllm-hisparse selection trace"),
    (["replay", "--steps", "-1"], "argument --steps: expected an integer > 0, got '-1'"),
    (["replay", "--requests", "0"], "argument --requests: expected an integer > 0"),
    (["replay", "--seed", "-3"], "argument --seed: expected an integer >= 0"),
    (["replay", "--top-k", "512", "--context", "4096", "--requests", "1", "--steps", "2",
      "--capacities", "8"], "smaller than the largest selection set"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_bad_arguments_exit_2_with_a_message(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert text in capsys.readouterr().err


def test_replay_adaptive_compares_fixed_and_per_request_sizes(tmp_path, capsys):
    out = tmp_path / "a.json"
    assert main(["replay", "--adaptive", "512", "--steps", "16", "--top-k", "256", "--context",
                 "4096", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| hot region | target miss rate | miss rate | worst request |")
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| fixed 384 rows", "| fixed 512 rows", "| fixed 640 rows", "| fixed 768 rows",
        "| fixed 896 rows", "| fixed 1024 rows", "| adaptive, target 1 x",
        "| adaptive, target 1.5 x"]
    data = json.loads(out.read_text())
    assert len(data["sizing"]) == 8 and data["sizing"][0]["concurrency"] > 0


def test_replay_adaptive_rejects_a_size_off_the_block_grid(capsys):
    with pytest.raises(SystemExit) as info:
        main(["replay", "--adaptive", "500", "--steps", "2", "--top-k", "256", "--context",
              "4096"])
    assert info.value.code == 2
    assert "not a multiple of the trace's block size 64" in capsys.readouterr().err
