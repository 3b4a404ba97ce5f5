"""The benchmarks still run (tiny sizes, CPU): a smoke check, not a timing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_bench(target: str, *args: str) -> subprocess.CompletedProcess:
    """`vllm-hisparse bench TARGET ARGS` (vllm_hisparse/cli/benchmarks)."""
    return subprocess.run([sys.executable, "-m", "vllm_hisparse.cli.main", "bench", target,
                           *args], capture_output=True, text=True, timeout=300)


def test_bench_reference_runs(tmp_path):
    out = tmp_path / "ref.json"
    r = run_bench("reference", "--requests", "2", "--topk", "256", "--hot-slots", "512",
            "--context", "4096", "--repeats", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["requests"] == 2 and data["median_ms"] > 0
    assert sum(data["distinct_resident_hit_miss"]) > 0


def test_bench_decode_capacity_runs_on_cpu(tmp_path):
    out = tmp_path / "cap.json"
    r = run_bench("capacity", "--contexts", "256", "2048", "--hbm-gib", "0.01",
            "--host-gib", "0.05", "--layers", "2", "--topk", "64", "--hot-rows", "256",
            "--block-size", "16", "--steps", "2", "--warmup", "1",
            "--weights-gib-per-layer", "0.001", "--index-group-layers", "0", "1",
            "--gather-modes", "single", "side", "side:1,99@0#2", "noio", "--rounds", "2",
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    results = json.loads(out.read_text())["results"]
    assert [x["context"] for x in results] == [256, 2048, 256, 2048]
    assert [x["index_group_layers"] for x in results] == [[2], [2], [1, 1], [1, 1]]
    # Same HBM: short requests stay fully resident, long ones fit more in hybrid mode.
    assert results[0]["hybrid_batch"] == results[0]["full_batch"]
    assert results[1]["hybrid_batch"] > results[1]["full_batch"]
    modes = results[1]["modes"]
    assert list(modes) == ["single", "side", "side:1,99@0#2", "noio"]
    assert modes["single"]["chunks"] == [[2]] and modes["side"]["chunks"] == [[2]]
    assert modes["side:1,99@0#2"]["chunks"] == [[1, 1]]
    # Two interleaved rounds: the tables show their median, the JSON keeps each.
    assert len(results[1]["full_step_ms_rounds"]) == 2
    assert all(len(m["step_ms_rounds"]) == 2 and len(m["tokens_per_s_ratio_rounds"]) == 2
               for m in modes.values())
    # Every mode replays the same selections from fresh hot regions: same misses.
    assert len({m["miss_rate"] for m in modes.values()}) == 1
    # The weight pass is timed at each batch that runs it (JSON keys are strings).
    assert set(results[1]["weight_pass_ms"]) == {str(results[1]["full_batch"]),
                                                 str(results[1]["hybrid_batch"])}


@pytest.mark.slow  # a second capacity run in a fresh interpreter (the one above covers the run)
def test_bench_decode_capacity_sum_weight_pass_and_trace_flag_run_on_cpu(tmp_path):
    out = tmp_path / "cap.json"
    r = run_bench("capacity", "--contexts", "2048", "--hbm-gib", "0.01",
            "--host-gib", "0.05", "--layers", "2", "--topk", "64", "--hot-rows", "256",
            "--block-size", "16", "--steps", "2", "--warmup", "1", "--weight-pass", "sum",
            "--weights-gib-per-layer", "0.001", "--gather-modes", "single", "--trace",
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["args"]["weight_pass"] == "sum" and data["weight_pass_batch1_ms"] > 0
    # --trace needs CUDA (torch.profiler's kernel times); on the CPU it is skipped.
    assert "timeline" not in data["results"][0]["modes"]["single"]


def test_bench_decode_capacity_rejects_a_bad_gather_mode(capsys):
    from vllm_hisparse.cli.main import main

    with pytest.raises(SystemExit) as info:  # in this process: an argument error needs no run
        main(["bench", "capacity", "--gather-modes", "side:0"])
    assert info.value.code == 2
    assert "expected side[:C1,C2,...][@N][#M][~P]" in capsys.readouterr().err


def test_ncu_phases_sums_each_barrier_delimited_phase(tmp_path):
    """Executed instructions and stall samples add up per phase; a barrier closes a phase."""
    rows = [
        ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
         "stall_wait", "stall_barrier", "stall_wait (Not Issued)"],
        ["0x10", "LDG.E R2, [R4]", "3", "4", "1", "0", "0"],
        ["0x20", "BAR.SYNC.DEFER_BLOCKING 0x0", "5", "4", "0", "5", "0"],
        ["0x30", "ATOMS.CAS R9, [R9], R22, R23", "2", "12", "2", "0", "0"],
        ["0x40", "EXIT", "0", "0", "0", "0", "0"],
    ]
    path = tmp_path / "src.csv"
    path.write_text('"report header"\n' + "\n".join(",".join(f'"{c}"' for c in r) for r in rows))
    r = run_bench("ncu-phases", str(path), "--warps", "4")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "executed warp instructions per warp: 5"
    assert lines[1].startswith("phase 0: static     2  executed/warp      2  samples     8")
    assert "barrier 5" in lines[1] and "wait 1" in lines[1]
    assert lines[2].startswith("phase 1: static     2  executed/warp      3  samples     2")


@pytest.mark.slow
def test_bench_pd_import_runs(tmp_path):
    """Two processes over NIXL (UCX on CPU memory); skipped without the nixl package."""
    pytest.importorskip("nixl._api")
    out = tmp_path / "pd.json"
    r = run_bench("pd-import", "--pages", "4", "--layers", "2", "--staging-pages", "2",
            "--repeats", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    results = {x["path"]: x for x in json.loads(out.read_text())["results"]}
    assert results["direct"]["descriptors"] == 4 * 2 * 64
    assert results["staged-read"]["descriptors"] == 4 * 2
