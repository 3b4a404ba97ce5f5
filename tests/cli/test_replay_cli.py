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


def _two_group_trace(tmp_path):
    """The partial-overlap case of tests/core/test_miss_prediction.py: capacity 4, group 1
    misses 8 rows, group 0's selections name 8 of which 5 miss."""
    rec = TraceRecorder(top_k=4, block_size=4, source="test")
    for step, (g0, g1) in enumerate([([1, 2, 3], [1, 2, 9]), ([4, 5, 6], [4, 5, 8]),
                                     ([1, 7], [7, 9, 10])]):
        rec.add(0, step, g0, group=0)
        rec.add(0, step, g1, group=1)
    path = tmp_path / "groups.npz"
    rec.trace().save(str(path))
    return path


def test_replay_predict_prints_recall_precision_and_extra_traffic(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["replay", "--trace", str(_two_group_trace(tmp_path)), "--predict", "4",
                 "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("| predictor | prefetches for group L+1 at step t | miss rows | "
                        "predicted rows | covered rows | recall | precision | extra traffic |")
    assert lines[3] == ("| previous layer | group L's selections at step t | 8 | 8 | 5 "
                        "| 62.5 % | 62.5 % | 38 % |")
    assert lines[4] == ("| previous step (own) | group L+1's selections at step t-1 | 8 | 0 "
                        "| 0 | 0.0 % | - | 0 % |")
    assert lines[-1].startswith("| 0 -> 1 | 88.89 % | 8 | 62.5 % / 62.5 % / 38 % |")
    assert not any("independent by construction" in line for line in lines)  # a recorded trace
    data = json.loads(out.read_text())
    assert data["index_groups"] == [0, 1] and data["note"] is None
    assert data["overall"]["union"] == {"miss_rows": 8, "predicted_rows": 10, "covered_rows": 5,
                                        "extra_rows": 5, "recall": 0.625, "precision": 0.5,
                                        "extra_traffic": 0.625}
    assert data["gaps"][0]["predictors"]["layer_step"]["predicted_rows"] == 2


def test_replay_predict_on_the_synthetic_trace_says_its_groups_are_independent(capsys):
    assert main(SMALL[:-4] + ["--predict", "512", "--index-groups", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 index groups, 2 requests" in out and "| 1 -> 2 |" in out
    assert "synthetic index groups are independent by construction" in out
    assert "record_trace" in out


def test_replay_predict_on_one_index_group_says_so(tmp_path, capsys):
    rec = TraceRecorder(top_k=4, block_size=4, source="test")
    rec.add(0, 0, [1, 2])
    path = tmp_path / "one.npz"
    rec.trace().save(str(path))
    out = tmp_path / "one.json"
    assert main(["replay", "--trace", str(path), "--predict", "4", "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith(
        "one index group: nothing to predict across layers")
    assert json.loads(out.read_text())["gaps"] == []


@pytest.mark.parametrize("argv,text", [
    (["replay", "--predict", "0"], "argument --predict: expected an integer > 0"),
    (["replay", "--predict", "512", "--adaptive", "512"], "separate reports"),
    (["replay", "--predict", "2", "--top-k", "256", "--context", "4096", "--steps", "2"],
     "smaller than the largest selection set"),
])
def test_replay_predict_bad_arguments_exit_2(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert text in capsys.readouterr().err
