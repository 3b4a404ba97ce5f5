"""``vllm-hisparse bench tp-gather`` on a CPU-only machine: argument handling, the device and
pool planning, and the ranks' protocol (shared segment, barriers, exactness check, host
memory) with the CPU reference gather. The ranks run as threads here (the same body as the
spawned processes); the slow tier runs the command itself."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import uuid

import pytest
import torch

from tests.worker.test_host_pool_shared import shm_dir  # noqa: F401 (fixture)
from vllm_hisparse.cli.benchmarks import tp_gather
from vllm_hisparse.cli.main import main


def rank_config(shm_dir, **kw):
    return dict(ranks=2, row_bytes=656, seconds=0.01, devices=["cpu", "cpu"], shm_dir=shm_dir,
                name=f"test-{uuid.uuid4().hex[:12]}", **kw)


def run_ranks(cfg):
    """``rank_main`` of every rank in a thread; their reports, one per rank."""
    barrier, out = threading.Barrier(cfg["ranks"]), queue.Queue()
    ranks = [threading.Thread(target=tp_gather.rank_main, args=(r, cfg, barrier, out))
             for r in range(cfg["ranks"])]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join(120)
        assert not t.is_alive(), "a rank hangs"
    return [out.get_nowait() for _ in ranks]


@pytest.mark.parametrize("argv,text", [
    (["--row-bytes", "650"], "--row-bytes=650 is invalid; accepted: a multiple of 16"),
    (["--ranks", "9"], "--ranks=9 is invalid; accepted: 1 to 8"),
    (["--ranks", "0"], "argument --ranks: expected an integer > 0"),
    (["--seconds", "-1"], "argument --seconds: expected a finite number > 0"),
    (["--rows"], "argument --rows: expected at least one argument"),
    (["--shm-dir", "/no/such/dir"], "--shm-dir=/no/such/dir is not a directory"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    # Refused against this machine's memory like every command's pool (it used to shrink
    # silently to /dev/shm's room).
    (["--pool-gib", "100000"], "--pool-gib=100000 does not fit: the shared host pool would take "
     "100000 GiB, this machine can allocate"),
])
def test_bad_arguments_exit_2_with_a_message(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "tp-gather", *argv])
    assert info.value.code == 2
    assert text in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_devices_without_a_gpu():
    devices, meaning = tp_gather.plan_devices("auto", 2)
    assert devices == ["cpu", "cpu"] and "not PCIe" in meaning
    with pytest.raises(ValueError, match="--device=cuda is invalid: no CUDA device"):
        tp_gather.plan_devices("cuda", 2)


def test_pool_is_shrunk_to_the_room_of_the_segment_directory(monkeypatch, shm_dir):
    args = tp_gather.build_parser().parse_args(["--pool-gib", "4", "--shm-dir", shm_dir])

    class Room:  # 1 GiB free
        f_bavail, f_frsize = 1 << 18, 4096

    monkeypatch.setattr(tp_gather.os, "statvfs", lambda path: Room())
    blocks, note = tp_gather.pool_blocks(args)
    assert 0 < blocks * 64 * 656 <= 0.9 * (1 << 30) and "pool shrunk from 4.00 GiB" in note
    Room.f_bavail = 1000
    with pytest.raises(ValueError, match=r"has room for 0 MiB, less than 64 MiB"):
        tp_gather.pool_blocks(args)


def test_ranks_gather_exact_rows_from_one_segment_held_once(shm_dir):
    """Two ranks (threads, CPU reference gathers) through the whole protocol."""
    cfg = rank_config(shm_dir, rows=[300, 2048], layers=2, blocks=64)
    reports = {}
    for status, rank, body in run_ranks(cfg):
        assert status == "ok", body
        reports[rank] = body
    ordered = [reports[0], reports[1]]
    assert ordered[0]["segment"] == ordered[1]["segment"]
    summary = tp_gather.summarize(ordered, cfg)
    assert summary["exact"]
    assert [row["rows"] for row in summary["table"]] == [300, 2048]
    for row in summary["table"]:
        assert all(g > 0 for g in row["alone_gbps"] + row["together_gbps"])
        assert row["aggregate_gbps"] > 0 and 0 <= row["overlap"] <= 1
    memory = summary["memory"]
    assert all(m["shared"] and m["logical_bytes"] == 64 * 64 * 2 * 656 for m in memory)
    # One copy: the segment's pages; the ranks' Pss add up to them.
    assert memory[0]["segment_bytes"] >= memory[0]["logical_bytes"]
    held = sum(m["pss_bytes"] for m in memory)
    assert abs(held - memory[0]["segment_bytes"]) <= 64 << 10
    text = tp_gather.format_report(summary, cfg)
    assert "| rows/launch | rank 0 alone | rank 1 alone | rank 0 both | rank 1 both |" in text
    assert "exact: every rank's gathered rows equal the pool's bytes" in text
    assert "(held once)" in text
    assert os.listdir(shm_dir) == [], "the creator unlinked the segment"


def test_a_failing_rank_releases_the_others(shm_dir):
    """A rank that fails aborts the barrier: the other ranks report instead of hanging."""
    cfg = rank_config(shm_dir, rows=[256], layers=1, blocks=0)  # rank 0 cannot make the pool
    assert sorted(status for status, _, _ in run_ranks(cfg)) == ["error", "error"]


@pytest.mark.slow
def test_the_command_runs_on_cpu_and_writes_json(tmp_path, shm_dir):
    path = tmp_path / "tp.json"
    r = subprocess.run([sys.executable, "-m", "vllm_hisparse.cli.main", "bench", "tp-gather",
                        "--device", "cpu", "--pool-gib", "0.1", "--rows", "512",
                        "--seconds", "0.05", "--shm-dir", shm_dir, "--json", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "exact: every rank's gathered rows equal the pool's bytes" in r.stdout
    data = json.loads(path.read_text())
    assert data["config"]["devices"] == ["cpu", "cpu"] and data["exact"]
    assert len(data["ranks"]) == 2 and data["table"][0]["rows"] == 512
    assert data["design"]["gather_gbps"]["656B/2048"] == 38.0
