"""``vllm-hisparse simulate``: vLLM's real scheduler + both connector roles + the synthetic DSA
model on CPU. A small run is exact and the connector raises concurrency; planted corruptions
fail loudly with the request, step and layer; bad arguments exit 2; the JSON report."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from vllm_hisparse.cli.main import main  # noqa: E402

# ~12 requests of 768 + 128 tokens on 240 blocks: about 6 fit without the connector, 9 with.
SMALL = ["simulate", "--requests", "12", "--prompt-len", "768", "--output-len", "128",
         "--device-blocks", "240", "--max-num-batched-tokens", "1024", "--quiet"]
# Just enough to make the connector demote (a corruption test needs host-backed reads).
TINY = ["simulate", "--requests", "6", "--prompt-len", "384", "--output-len", "96",
        "--device-blocks", "120", "--max-num-batched-tokens", "512", "--layers", "2",
        "--runs", "with", "--quiet"]


def test_small_run_is_exact_and_the_connector_raises_concurrency(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(SMALL + ["--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "| | without connector | with connector |" in stdout
    assert re.search(r"exact: all [\d,]+ rows read", stdout)
    data = json.loads(out.read_text())
    assert data["status"] == "ok" and data["error"] is None
    assert data["spec"]["num_requests"] == 12 and len(data["workload"]) == 12
    without, with_ = data["runs"]["without connector"], data["runs"]["with connector"]
    for run in (without, with_):
        assert run["finished"] == 12
        assert run["generated_tokens"] == 12 * 128
        assert run["rows_checked"] > 0
    # The connector matters: more requests decode together (and the run is shorter).
    assert with_["peak_running"] > without["peak_running"]
    assert with_["mean_running"] > without["mean_running"]
    assert with_["preemptions"] <= without["preemptions"]
    assert with_["steps"] < without["steps"]
    # ... and host-backed reads really happened, through hits and gathered misses.
    assert with_["demotions"] > 0 and with_["misses"] > 0 and with_["hot_hits"] > 0
    assert with_["bytes_h2d"] > 0 and with_["bytes_d2h"] > 0
    assert without["misses"] == 0 and without["bytes_d2h"] == 0


def test_both_attention_paths_are_exact_and_the_direct_one_is_routed(monkeypatch, capsys):
    """``--attention direct`` converts batches with prefill tokens at the backend's direct
    site (routed to the resolver for tracked requests); ``group`` through the index group."""
    import functools

    import vllm_hisparse.vllm.simulation.synthetic_attention as synthetic_attention

    calls = []
    original = synthetic_attention.cpu_direct_conversion

    @functools.wraps(original)  # the routing binds arguments by vLLM's signature
    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(synthetic_attention, "cpu_direct_conversion", counting)
    argv = TINY[:-3] + ["--quiet"]  # both runs
    assert main(argv + ["--attention", "direct"]) == 0
    assert calls, "no batch took the direct conversion"
    calls.clear()
    assert main(argv + ["--attention", "group"]) == 0
    assert not calls
    assert capsys.readouterr().out.count("exact: all") == 2


def test_cpu_direct_conversion_has_vllms_signature():
    import inspect

    from vllm.v1.attention.backends.mla import sparse_utils

    from vllm_hisparse.vllm.simulation.synthetic_attention import cpu_direct_conversion

    assert inspect.signature(cpu_direct_conversion).parameters.keys() == \
        inspect.signature(sparse_utils.triton_convert_req_index_to_global_index).parameters.keys()
    # The runs put vLLM's function back.
    from vllm_hisparse.vllm import patches

    assert not patches.CPU_DIRECT_CONVERSION.installed()


def _assert_loud_mismatch(capsys, argv):
    assert main(argv) == 1
    err = capsys.readouterr().err
    match = re.search(r"FAILED: MISMATCH with connector: request (sim-\d+), step (\d+), "
                      r"layer (\d+), token at position (\d+): ", err)
    assert match, err
    return err


def test_skipped_miss_gather_fails_naming_request_step_and_layer(monkeypatch, tmp_path, capsys):
    from vllm_hisparse.worker.hot_state import GroupGather

    monkeypatch.setattr(GroupGather, "launch", lambda self, *args, **kwargs: None)
    out = tmp_path / "bad.json"
    err = _assert_loud_mismatch(capsys, TINY + ["--json", str(out)])
    assert "read row" in err and "[request residency MIXED]" in err
    data = json.loads(out.read_text())
    assert data["status"] == "failed" and "MISMATCH" in data["error"]
    assert set(data["mismatch"]) == {"request", "step", "layer", "position"}


def test_flipped_host_pool_byte_fails(monkeypatch, capsys):
    """A byte flipped in every mirrored host row: the rows gathered back are caught."""
    from vllm_hisparse.worker.transfer import TransferEngine

    original = TransferEngine.mirror

    def corrupting_mirror(self, transfer_id, device_rows, host_rows):
        result = original(self, transfer_id, device_rows, host_rows)
        self.wait_all() if self.device.type == "cuda" else None
        rows = list(host_rows)
        for layer in self.host_layers:
            layer[rows, 100] ^= 0x5A
        return result

    monkeypatch.setattr(TransferEngine, "mirror", corrupting_mirror)
    err = _assert_loud_mismatch(capsys, TINY)
    assert "the right row header but 1 corrupted bytes (first at byte 100)" in err


def test_prompts_longer_than_one_step_are_prefilled_in_chunks(capsys):
    """Regression: a chunked prefill must never be demoted mid-prompt (requirement R1), or the
    worker role refuses its next chunk over host-only pages and the run fails."""
    argv = ["simulate", "--requests", "16", "--prompt-len", "1024", "--output-len", "64",
            "--device-blocks", "400", "--max-num-batched-tokens", "512", "--runs", "with",
            "--quiet"]
    status = main(argv)
    err = capsys.readouterr().err
    assert status == 0, err


@pytest.mark.parametrize("argv,text", [
    (["--requests", "0"], "--requests=0 is invalid; accepted: a positive integer"),
    (["--block-size", "48"], "--block-size=48 is invalid; accepted: 16, 32 or 64"),
    (["--top-k", "100"], "--top-k=100 is invalid; accepted: a multiple of --block-size"),
    (["--layers", "2", "--layers-per-indexer", "3"], "--layers-per-indexer=3 is invalid"),
    (["--length-jitter", "1.5"], "--length-jitter=1.5 is invalid"),
    (["--arrival", "uniform"], "invalid choice: 'uniform'"),
    (["--device", "tpu"], "--device=tpu is invalid; accepted: cpu | cuda | cuda:N"),
    (["--threads", "0"], "--threads=0 is invalid"),
    (["--prompt-len", "x"], "invalid int value: 'x'"),
    (["--device-buffer-size", "100"], "device_buffer_size=100 is invalid (not a multiple of block_size=64)"),
    (["--device-blocks", "10"], "--device-blocks=10 cannot hold one request"),
    (["--host-pool-gib", "0.001"], "host_pool_gib=0.001 cannot hold one max_model_len=1280 request"),
    (["--shared-prefix-len", "-1"], "--shared-prefix-len=-1 is invalid"),
    (["--tensor-parallel-size", "0"],
     "--tensor-parallel-size=0 is invalid; accepted: an integer in [1, 8]"),
    (["--tensor-parallel-size", "2", "--device", "cuda:1"],
     "--device=cuda:1 is invalid; accepted: cpu or cuda with --tensor-parallel-size > 1"),
])
def test_bad_arguments_exit_2_with_a_message(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        main(["simulate", "--quiet"] + argv)
    assert info.value.code == 2
    assert text in capsys.readouterr().err


def test_cli_without_the_simulator_never_imports_vllm():
    code = ("import sys\nfrom vllm_hisparse.cli.main import build_parser\n"
            "p = build_parser()\np.parse_args(['simulate', '--requests', '3'])\n"
            "assert 'vllm' not in sys.modules, 'vllm imported'\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# Shared prefixes (issue 13, defect 5): vLLM's prefix cache hands a request blocks that
# another request computes in the same step, and decode positions whose tokens are equal.
SHARED = ["simulate", "--requests", "2", "--prompt-len", "768", "--output-len", "128",
          "--device-blocks", "220", "--seed", "3", "--quiet"]


@pytest.mark.parametrize("shared,hit_tokens", [(512, 512), (768, 704)])
def test_shared_prefix_hit_in_the_same_step_is_exact(shared, hit_tokens, tmp_path, capsys):
    out = tmp_path / "shared.json"
    status = main(SHARED + ["--shared-prefix-len", str(shared), "--json", str(out)])
    assert status == 0, capsys.readouterr().err
    for run in json.loads(out.read_text())["runs"].values():
        # sim-2 started on sim-1's blocks of the very same step (2 indexer layers checked).
        assert run["indexer_rows_checked"] == 2 * hit_tokens
        assert run["generated_tokens"] == 2 * 128


def test_decode_blocks_shared_through_equal_sampled_tokens_are_exact(capsys):
    """Identical prompts and sampled tokens: a preempted request resumes on blocks holding
    another request's decode positions (same tokens, so the same KV)."""
    argv = ["simulate", "--requests", "6", "--prompt-len", "256", "--output-len", "256",
            "--shared-prefix-len", "256", "--arrival", "poisson", "--arrival-rate", "0.1",
            "--device-blocks", "60", "--runs", "without", "--quiet"]
    status = main(argv)
    assert status == 0, capsys.readouterr().err


def test_wrong_row_in_a_shared_block_fails(monkeypatch, capsys):
    """The prefix-aware ground truth still sees one planted wrong row: position 5 of the
    first shared block holds position 6's KV in every sparse layer."""
    from vllm_hisparse.vllm.simulation.synthetic_attention import SyntheticModel

    original = SyntheticModel.write_kv

    def planting(self, batch, step, slots=None):
        original(self, batch, step, slots)
        for rid, state, start, n in batch:
            if rid == "sim-1" and start <= 6 < start + n:
                for g, _, view, stride in self.layers.values():
                    block = state.block_ids[self.sparse_groups.index(g)][0]
                    view[block * stride + 5] = view[block * stride + 6]

    monkeypatch.setattr(SyntheticModel, "write_kv", planting)
    assert main(SHARED + ["--shared-prefix-len", "512", "--runs", "without"]) == 1
    err = capsys.readouterr().err
    assert "FAILED: MISMATCH without connector: request sim-" in err
    assert ("selected position 5 (page 0) read row" in err
            and "holding (request 1, position 6, layer" in err
            and "not (request 1, position 5, layer" in err), err


@pytest.mark.parametrize("host_layout", ["position", "layer"])
def test_both_host_layouts_are_exact(host_layout, tmp_path, monkeypatch, capsys):
    """Mirrors, spills and miss gathers through a layer-major and a position-major pool."""
    from vllm_hisparse.vllm.worker_side import role as worker_side

    layouts = []
    real_pool = worker_side.HostPool

    def recording_pool(*args, **kwargs):
        layouts.append(kwargs["layout"])
        return real_pool(*args, **kwargs)

    monkeypatch.setattr(worker_side, "HostPool", recording_pool)
    out = tmp_path / "sim.json"
    assert main(TINY + ["--host-layout", host_layout, "--json", str(out)]) == 0
    assert re.search(r"exact: all [\d,]+ rows read", capsys.readouterr().out)
    data = json.loads(out.read_text())
    assert data["spec"]["connector_extra"]["host_layout"] == host_layout
    assert data["runs"]["with connector"]["misses"] > 0
    assert layouts and set(layouts) == {host_layout}
