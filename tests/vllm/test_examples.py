"""``examples/``: every deployment's JSON goes through vLLM's config validation and this
package's parser, and the ones that can run on a CPU run through ``vllm-hisparse simulate``.
The plan-sizing example's config is the one ``vllm-hisparse plan`` prints for its command."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402

from vllm_hisparse.vllm.simulation.model import make_vllm_config  # noqa: E402
from vllm_hisparse.cli.main import main  # noqa: E402
from vllm_hisparse.vllm.setup.config import find_connector_extra_config  # noqa: E402
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.plugin import register  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = sorted(EXAMPLES.glob("*/*.json"))
# Runnable here through the simulator (our connector's part of the composition).
SIMULATED = ["colocated/kv_transfer_config.json", "colocated-offloading/kv_transfer_config.json"]
TINY = ["--requests", "6", "--prompt-len", "384", "--output-len", "48", "--device-blocks", "120",
        "--layers", "2", "--runs", "with", "--quiet"]


@pytest.fixture
def big_host(monkeypatch):
    """A deployment host of 2 TiB, stated as examples/README.md says (the examples' 384 GiB
    pools are then accepted on this machine)."""
    monkeypatch.setenv("VLLM_HISPARSE_HOST_MEMORY_GIB", "2048")


def test_every_deployment_has_its_folder():
    folders = {p.name for p in EXAMPLES.iterdir() if p.is_dir()}
    assert folders == {"colocated", "colocated-offloading", "pd-nixl", "plan-sizing"}
    for folder in folders:
        readme = (EXAMPLES / folder / "README.md").read_text()
        assert "```bash" in readme and "What the logs show" in readme, folder


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_config_passes_vllm_validation_and_our_parser(path, big_host, dsa_model_dir):
    register()  # the plugin, as vLLM loads it: registers the connector and the config check
    raw = json.loads(path.read_text())
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=KVTransferConfig(**raw))
    extra = find_connector_extra_config(vllm_config)
    if path.name == "prefill_kv_transfer_config.json":
        # The prefill node is stock vLLM: nothing of this package is configured there.
        assert extra is None and raw["kv_role"] == "kv_producer"
        return
    config = resolve_config(vllm_config)
    assert config.host_pool_gib == extra["host_pool_gib"] > 0
    if path.parent.name == "pd-nixl":
        assert vllm_config.kv_transfer_config.kv_role == "kv_consumer"


@pytest.mark.parametrize("name", SIMULATED)
def test_runnable_examples_run_exact_through_simulate(name, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--connector-config", str(EXAMPLES / name), "--json", str(out)]
                + TINY) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"exact: all [\d,]+ rows read", stdout)
    # The file's host pool is replaced by the simulator's, and the output says so.
    assert re.search(rf"--connector-config {re.escape(str(EXAMPLES / name))}: host_pool_gib=384 "
                     r"replaced by [\d.]+ GiB \(the simulator's default: enough for every "
                     r"request at once\)", stdout)
    report = json.loads(out.read_text())
    assert report["status"] == "ok"
    assert report["connector_config_overridden"]["host_pool_gib"][0] == 384
    # host_pool_gib is the simulator's own; the report always names the eviction it ran
    assert report["spec"]["connector_extra"] == {"hot_region_eviction": "lru"}


def test_connector_config_keys_reach_the_connector(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kv_connector": "HiSparseResidencyConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"host_pool_gib": 1,
                                                             "device_buffer_rows": 512}}))
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--connector-config", str(bad)] + TINY)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unknown kv_connector_extra_config key 'device_buffer_rows'" in err
    assert "ArgsKwargs" not in err  # our message, not pydantic's report of the whole input


def test_connector_config_without_our_connector_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["simulate", "--connector-config",
              str(EXAMPLES / "pd-nixl/prefill_kv_transfer_config.json")] + TINY)
    assert exited.value.code == 2
    assert "names no HiSparseResidencyConnector" in capsys.readouterr().err


def test_plan_sizing_config_is_what_plan_prints(capsys):
    readme = (EXAMPLES / "plan-sizing" / "README.md").read_text()
    command = re.search(r"^vllm-hisparse (plan .*)$", readme, re.M).group(1)
    assert main(shlex.split(command)) == 0
    printed = re.search(r"--kv-transfer-config '(.*)'", capsys.readouterr().out).group(1)
    expected = json.loads((EXAMPLES / "plan-sizing" / "kv_transfer_config.json").read_text())
    assert json.loads(printed) == expected


def _proxy_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pd_proxy", EXAMPLES / "pd-nixl" / "proxy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("stream", [False, True])
def test_pd_proxy_sends_the_prefill_first_then_the_decode_with_its_kv_transfer_params(stream):
    """examples/pd-nixl/proxy.py against stand-ins of both nodes (httpx's mock transport)."""
    import httpx
    from fastapi.testclient import TestClient

    proxy = _proxy_module()
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
              "remote_block_ids": [[1, 2]], "remote_host": "10.0.0.1", "remote_port": 5600,
              "remote_request_id": "cmpl-1"}
    seen = []

    def nodes(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.host, body))
        if request.url.host == "prefill":
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": params})
        if body.get("stream"):
            return httpx.Response(200, content=b"data: {\"text\": \"ok\"}\n\ndata: [DONE]\n\n")
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    upstream = httpx.AsyncClient(transport=httpx.MockTransport(nodes))
    app = proxy.make_app(["http://prefill:8100"], ["http://decode:8200"], client=upstream)
    request = {"model": "m", "prompt": "hello", "max_tokens": 64, "stream": stream}
    response = TestClient(app).post("/v1/completions", json=request)
    assert response.status_code == 200
    assert (b"[DONE]" in response.content) if stream else (
        response.json()["choices"][0]["text"] == "decoded")
    (p_host, p_body), (d_host, d_body) = seen
    assert (p_host, d_host) == ("prefill", "decode")
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert d_body == {**request, "kv_transfer_params": params}


def test_pd_proxy_names_a_prefill_that_is_not_a_nixl_producer():
    proxy = _proxy_module()
    with pytest.raises(ValueError, match="returned no kv_transfer_params"):
        proxy.decode_request({"prompt": "x"}, {"choices": []})
