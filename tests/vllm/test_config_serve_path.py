"""Every unsupported setup is refused when ``vllm serve`` builds its ``VllmConfig`` (issue 18).

The config is built exactly as ``vllm serve`` builds it in the API-server process:
``make_arg_parser`` → ``parse_args`` → ``AsyncEngineArgs.from_cli_args`` →
``create_engine_config``, over a tiny generated DSA ``config.json`` (nothing downloaded). No
engine process starts and no weights load: each error below is raised while the
``VllmConfig`` is built, and it names the key or option.

This machine has no accelerator, so vLLM resolves its ``UnspecifiedPlatform``, which names no
device type (``create_engine_config`` would stop at "Failed to infer device type") and reports
no hybrid KV cache manager. The ``gpu_host`` fixture gives that platform object a device type
and a GPU platform's hybrid-manager support, which is what an API server on a GPU host has;
everything else is vLLM's own code path.
"""

from __future__ import annotations

import json

import pytest

from vllm_hisparse.vllm.setup.config import HiSparseConfigError

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})


@pytest.fixture(scope="module")
def gpu_host():
    from vllm.platforms import current_platform

    platform = type(current_platform)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(platform, "device_type", "cpu")
        patch.setattr(platform, "support_hybrid_kv_cache", classmethod(lambda cls: True))
        yield


@pytest.fixture(scope="module")
def serve_parser(gpu_host):
    """``vllm serve``'s argument parser (built once: adding vLLM's arguments takes seconds)."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def kv_config(extra: dict | None = None, role: str = "kv_both", *, under_multi: bool = False) -> str:
    ours = {"kv_connector": "HiSparseResidencyConnector", "kv_role": role,
            "kv_connector_extra_config": {"host_pool_gib": 4} if extra is None else extra}
    if not under_multi:
        return json.dumps(ours)
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"connectors": [
                           ours, {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 28}}]}})


def serve_config(parser, model_dir, *flags: str, kv: str | None = None):
    """``vllm serve MODEL --kv-transfer-config KV FLAGS``, up to the built VllmConfig."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parser.parse_args(["--model", str(model_dir), "--skip-tokenizer-init",
                              "--max-model-len", "8192", "--kv-transfer-config",
                              kv or kv_config(), *flags])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def refused(parser, model_dir, *flags: str, kv: str | None = None) -> str:
    """The message of the HiSparseConfigError building the config raised."""
    with pytest.raises(ValueError) as err:
        serve_config(parser, model_dir, *flags, kv=kv)
    cause = err.value.errors()[0]["ctx"]["error"]  # vLLM's pydantic dataclass wraps ours
    assert isinstance(cause, HiSparseConfigError), repr(err.value)
    return str(cause)


def test_a_supported_config_builds(serve_parser, dsa_model_dir, gpu_host):
    for under_multi in (False, True):
        config = serve_config(serve_parser, dsa_model_dir, kv=kv_config(under_multi=under_multi))
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
    # Speculative decoding is supported without async scheduling.
    config = serve_config(serve_parser, dsa_model_dir, "--no-async-scheduling",
                          "--speculative-config", NGRAM)
    assert config.speculative_config.num_speculative_tokens == 2


@pytest.mark.parametrize(("flags", "extra", "role", "message"), [
    (["--pipeline-parallel-size", "2"], None, "kv_both",
     "does not support pipeline_parallel_size=2; accepted: 1"),
    (["--tensor-parallel-size", "2", "--decode-context-parallel-size", "2"], None, "kv_both",
     "does not support decode_context_parallel_size=2; accepted: 1"),
    (["--disable-hybrid-kv-cache-manager"], None, "kv_both",
     "does not support disable_hybrid_kv_cache_manager=True; accepted: the hybrid KV cache "
     "manager enabled (remove --disable-hybrid-kv-cache-manager)"),
    ([], {"host_pool_gib": 4, "device_buffer_size": 1024}, "kv_both",
     "device_buffer_size=1024 is out of range (one decode step can select more distinct rows "
     "than the hot region holds: the model's index_topk=2048)"),
    (["--speculative-config", NGRAM], None, "kv_both",  # vLLM turns async scheduling on
     "does not support async_scheduling=True with speculative decoding "
     "(num_speculative_tokens=2); accepted: --no-async-scheduling"),
    (["--async-scheduling", "--speculative-config", NGRAM], None, "kv_both",
     "does not support async_scheduling=True with speculative decoding"),
    ([], {"host_pool_gib": 0.01}, "kv_both",
     "host_pool_gib=0.01 cannot hold one max_model_len=8192 request: it needs at least 8192 "
     "tokens x 3152 B"),
    ([], None, "kv_producer", "does not support kv_role='kv_producer': it is a decode-side "
     "connector"),
], ids=["pipeline-parallel", "decode-context-parallel", "hybrid-manager-off",
        "device-buffer-below-top-k", "spec-decode-default-async", "spec-decode-async",
        "host-pool-below-one-request", "kv-producer"])
@pytest.mark.parametrize("under_multi", [False, True], ids=["alone", "multiconnector"])
def test_unsupported_setups_fail_while_the_config_is_built(serve_parser, dsa_model_dir, gpu_host,
                                                           flags, extra, role, message, under_multi):
    assert message in refused(serve_parser, dsa_model_dir, *flags,
                              kv=kv_config(extra, role, under_multi=under_multi))


def test_a_model_without_index_topk_fails_while_the_config_is_built(serve_parser, mla_model_dir,
                                                                    gpu_host):
    assert "its HF config has index_topk=None; accepted: a DSA" in refused(serve_parser,
                                                                           mla_model_dir)


def test_the_v1_model_runner_fails_with_one_readable_sentence(serve_parser, dsa_model_dir,
                                                             gpu_host, monkeypatch):
    import vllm.envs as envs

    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False)
    message = refused(serve_parser, dsa_model_dir)
    assert message.startswith("HiSparseResidencyConnector needs vLLM's Model Runner V2, but this "
                              "config runs the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
    assert "=True;" not in message


def test_the_host_pool_bound_counts_index_share_layers(serve_parser, tmp_path, gpu_host):
    """GLM-5.x IndexShare: only the layers that keep an indexer add indexer rows, so a pool
    that holds the sparse-MLA rows and those indexer rows is accepted."""
    from vllm_hisparse.vllm.setup.engine_checks import host_bytes_per_token_lower_bound
    from vllm_hisparse.vllm.simulation.model import write_model_dir

    model_dir = write_model_dir(tmp_path / "share", num_hidden_layers=8)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.update(index_topk_freq=4, index_skip_topk_offset=1)  # layers 0 and 4 keep one
    config_path.write_text(json.dumps(config))
    built = serve_config(serve_parser, model_dir)
    assert host_bytes_per_token_lower_bound(built.model_config.hf_text_config, "auto") == \
        8 * 656 + 2 * 132
    need_gib = 8192 * (8 * 656 + 2 * 132) / (1 << 30)  # 0.0427 GiB
    serve_config(serve_parser, model_dir, kv=kv_config({"host_pool_gib": round(need_gib + 0.001, 3)}))
    assert "cannot hold one max_model_len=8192 request" in refused(
        serve_parser, model_dir, kv=kv_config({"host_pool_gib": round(need_gib - 0.001, 3)}))
