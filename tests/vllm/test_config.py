"""Config parsing and engine-compatibility errors, on real ``vllm.config`` objects."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from tests.vllm.vllm_configs import kv_transfer_config, make_vllm_config
from vllm_hisparse.vllm.compat import CUDAGraphMode
from vllm_hisparse.vllm.config import (
    ACCEPTED_KEYS,
    CONNECTOR_NAME,
    MAX_DEVICE_BUFFER_ROWS,
    HiSparseConfigError,
    check_host_pool_holds_one_request,
    default_device_buffer_size,
    find_connector_extra_config,
    is_connector_configured,
    parse_extra_config,
    resolve_config,
)

ENGINE = dict(top_k=2048, block_size=64, max_decode_query_len=1)


def parse(extra, **engine):
    return parse_extra_config(extra, **{**ENGINE, **engine})


# ---------------------------------------------------------------- extra-config keys


def test_defaults():
    config = parse({"host_pool_gib": 384})
    assert config.host_pool_gib == 384.0
    assert config.host_pool_bytes == 384 << 30
    assert config.device_buffer_size == 4096  # (1 + 1) * 2048
    assert config.hot_blocks_per_request == 64
    assert config.eager_host_mirror is True
    assert config.ops_backend == "auto"
    assert config.record_trace is None
    assert config.index_share_prefetch is True
    assert config.prefetch_max_ctas == 16


def test_default_device_buffer_size_follows_speculative_tokens():
    # MTP with 3 speculative tokens: query length 4, (4 + 1) * 2048 rows.
    assert parse({"host_pool_gib": 1}, max_decode_query_len=4).device_buffer_size == 10240
    # Over the cap the default shrinks to the cap while one step still fits.
    assert default_device_buffer_size(2048, 64, 15) == MAX_DEVICE_BUFFER_ROWS
    with pytest.raises(HiSparseConfigError, match="default device_buffer_size"):
        parse({"host_pool_gib": 1}, max_decode_query_len=17)


def test_all_keys_accepted():
    config = parse(
        {"host_pool_gib": 1.5, "device_buffer_size": 8192, "eager_host_mirror": False,
         "ops_backend": "reference", "record_trace": None, "index_share_prefetch": False,
         "prefetch_max_ctas": 0}
    )
    assert (config.device_buffer_size, config.eager_host_mirror, config.ops_backend) == (
        8192, False, "reference")
    assert (config.index_share_prefetch, config.prefetch_max_ctas) == (False, 0)


def test_record_trace_path(tmp_path):
    path = str(tmp_path / "trace.bin")
    assert parse({"host_pool_gib": 1, "record_trace": path}).record_trace == path
    with pytest.raises(HiSparseConfigError, match=r"record_trace=.*does not exist"):
        parse({"host_pool_gib": 1, "record_trace": str(tmp_path / "no" / "trace.bin")})
    with pytest.raises(HiSparseConfigError, match="record_trace=''.*accepted: a file path"):
        parse({"host_pool_gib": 1, "record_trace": ""})


def test_unknown_key_names_key_and_accepted_keys():
    with pytest.raises(HiSparseConfigError) as err:
        parse({"host_pool_gib": 1, "host_pool_gb": 2})
    message = str(err.value)
    assert "'host_pool_gb'" in message and "did you mean 'host_pool_gib'" in message
    assert all(key in message for key in ACCEPTED_KEYS)


def test_host_pool_gib_required():
    with pytest.raises(HiSparseConfigError, match="'host_pool_gib' is required"):
        parse({})


@pytest.mark.parametrize("value", [0, -1, "4", True, None, math.nan, math.inf])
def test_host_pool_gib_bad_values(value):
    with pytest.raises(HiSparseConfigError, match=r"host_pool_gib=.* accepted: a finite number > 0"):
        parse({"host_pool_gib": value})


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (4000, "is invalid"),      # not a multiple of block_size
        (0, "is invalid"),
        (4096.0, "is invalid"),    # float
        (True, "is invalid"),
        (32768 + 64, "out of range"),
        (1024, "out of range"),    # below max_decode_query_len * top_k
    ],
)
def test_device_buffer_size_bad_values(value, reason):
    with pytest.raises(HiSparseConfigError) as err:
        parse({"host_pool_gib": 1, "device_buffer_size": value})
    message = str(err.value)
    assert reason in message and "device_buffer_size" in message
    assert "multiple of block_size=64" in message and "32768" in message


def test_bool_and_enum_keys():
    with pytest.raises(HiSparseConfigError, match="eager_host_mirror='yes'.*true or false"):
        parse({"host_pool_gib": 1, "eager_host_mirror": "yes"})
    with pytest.raises(HiSparseConfigError, match="ops_backend='triton'.*auto | cuda | reference"):
        parse({"host_pool_gib": 1, "ops_backend": "triton"})


@pytest.mark.parametrize("value", [-1, 4097, 16.0, True, "16", None])
def test_prefetch_max_ctas_bad_values(value):
    with pytest.raises(HiSparseConfigError,
                       match=r"prefetch_max_ctas=.* accepted: an integer between 0 .* and 4096"):
        parse({"host_pool_gib": 1, "prefetch_max_ctas": value})
    with pytest.raises(HiSparseConfigError, match="index_share_prefetch=1.*true or false"):
        parse({"host_pool_gib": 1, "index_share_prefetch": 1})


def test_extra_config_must_be_a_mapping():
    with pytest.raises(HiSparseConfigError, match="must be a JSON object"):
        parse([("host_pool_gib", 1)])


# ---------------------------------------------------------------- finding our entry


def test_found_alone_and_under_multiconnector(dsa_model_dir):
    alone = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 8}))
    multi = make_vllm_config(
        dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 8}, under_multi=True)
    )
    plain = make_vllm_config(dsa_model_dir)
    assert find_connector_extra_config(alone) == {"host_pool_gib": 8}
    assert find_connector_extra_config(multi) == {"host_pool_gib": 8}
    assert not is_connector_configured(plain)
    assert resolve_config(multi).host_pool_gib == 8.0
    with pytest.raises(HiSparseConfigError, match="does not name HiSparseResidencyConnector"):
        resolve_config(plain)


def test_configured_twice_is_an_error(dsa_model_dir):
    vllm_config = make_vllm_config(
        dsa_model_dir, kv_transfer=kv_transfer_config(under_multi=True)
    )
    children = vllm_config.kv_transfer_config.kv_connector_extra_config["connectors"]
    children.append(dict(children[0]))
    with pytest.raises(HiSparseConfigError, match="lists HiSparseResidencyConnector 2 times"):
        find_connector_extra_config(vllm_config)


# ---------------------------------------------------------------- unsupported engines


def test_supported_engine_resolves(dsa_model_dir):
    config = resolve_config(make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config()))
    assert (config.top_k, config.block_size, config.max_decode_query_len) == (2048, 64, 1)


def test_pipeline_parallel_rejected(dsa_model_dir):
    vllm_config = make_vllm_config(
        dsa_model_dir, kv_transfer=kv_transfer_config(), pipeline_parallel_size=2
    )
    with pytest.raises(HiSparseConfigError, match="pipeline_parallel_size=2; accepted: 1"):
        resolve_config(vllm_config)


def test_decode_context_parallel_rejected(dsa_model_dir):
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    vllm_config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(HiSparseConfigError, match="decode_context_parallel_size=2; accepted: 1"):
        resolve_config(vllm_config)


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_full_cudagraphs_rejected(dsa_model_dir, mode):
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    with pytest.raises(HiSparseConfigError,
                       match=f"cudagraph_mode={mode}; accepted: PIECEWISE or NONE"):
        resolve_config(vllm_config)


@pytest.mark.parametrize("mode", ["PIECEWISE", "NONE"])
def test_piecewise_or_no_cudagraphs_accepted(dsa_model_dir, mode):
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    resolve_config(vllm_config)


def test_v1_model_runner_rejected(dsa_model_dir, monkeypatch):
    import vllm.envs as envs
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False)
    with pytest.raises(HiSparseConfigError, match="VLLM_USE_V2_MODEL_RUNNER"):
        resolve_config(vllm_config)


def test_model_without_index_topk_rejected(mla_model_dir):
    vllm_config = make_vllm_config(mla_model_dir, kv_transfer=kv_transfer_config())
    with pytest.raises(HiSparseConfigError, match="index_topk=None; accepted: a DSA"):
        resolve_config(vllm_config)


def test_hybrid_kv_manager_disabled_rejected(dsa_model_dir):
    vllm_config = make_vllm_config(
        dsa_model_dir, kv_transfer=kv_transfer_config(), hybrid_kv_cache_manager=False
    )
    with pytest.raises(
        HiSparseConfigError, match="disable_hybrid_kv_cache_manager=True; accepted: the hybrid"
    ):
        resolve_config(vllm_config)


def test_host_pool_smaller_than_one_request():
    config = parse({"host_pool_gib": 0.5})
    # DeepSeek-V3.2: one host block = 61 layers x 64 rows x 656 B = 2,561,024 B.
    blocks = check_host_pool_holds_one_request(
        config, host_block_bytes=2_561_024, host_copies=1, max_model_len=8192
    )
    assert blocks == (1 << 29) // 2_561_024 == 209
    with pytest.raises(HiSparseConfigError) as err:
        check_host_pool_holds_one_request(
            config, host_block_bytes=2_561_024, host_copies=1, max_model_len=32768
        )
    message = str(err.value)
    assert "host_pool_gib=0.5 buys 209 host blocks" in message
    assert "max_model_len=32768" in message and "accepted: host_pool_gib >= 1.221" in message
    # TP ranks that pin their own copy divide the budget.
    with pytest.raises(HiSparseConfigError, match="x 8 copies"):
        check_host_pool_holds_one_request(
            replace(config, host_pool_gib=4.0), host_block_bytes=2_561_024,
            host_copies=8, max_model_len=32768,
        )


def test_connector_name_is_not_the_in_tree_switch():
    assert CONNECTOR_NAME == "HiSparseResidencyConnector" != "HiSparseConnector"
