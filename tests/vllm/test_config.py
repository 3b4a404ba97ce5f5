"""Config parsing and engine-compatibility errors, on real ``vllm.config`` objects."""

from __future__ import annotations

import math
import os
from dataclasses import replace

import pytest
from vllm.config import KVTransferConfig

from vllm_hisparse.vllm.simulation.model import kv_transfer_config, make_vllm_config
from vllm_hisparse.core import capacity
from vllm_hisparse.core.capacity import HostMemoryLimit
from vllm_hisparse.worker.hot_state import DEFAULT_LEADER_CTAS_PER_SM
from vllm_hisparse.vllm.setup import config as config_module
from vllm_hisparse.vllm import patches
from vllm_hisparse.vllm.plugin import register
from vllm_hisparse.vllm.compat import CUDAGraphMode
from vllm_hisparse.vllm.setup.config import (
    ACCEPTED_KEYS,
    CONNECTOR_NAME,
    MAX_DEVICE_BUFFER_ROWS,
    HiSparseConfigError,
    default_device_buffer_size,
    find_connector_extra_config,
    is_connector_configured,
    parse_extra_config,
)
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.setup.kv_plan import check_host_pool_holds_one_request

ENGINE = dict(top_k=2048, block_size=64, max_decode_query_len=1)
GIB = 1 << 30


@pytest.fixture
def machine(monkeypatch):
    """Pretend this machine has ``physical`` GiB of RAM and a ``cgroup`` GiB limit."""

    def set_machine(physical_gib, cgroup_gib=None):
        limit = HostMemoryLimit(
            None if physical_gib is None else int(physical_gib * GIB),
            None if cgroup_gib is None else int(cgroup_gib * GIB),
            None if cgroup_gib is None else "/sys/fs/cgroup/memory.max",
        )
        monkeypatch.setattr(config_module, "host_memory_limit", lambda: limit)

    return set_machine


def parse(extra, **engine):
    return parse_extra_config(extra, **{**ENGINE, **engine})


# ---------------------------------------------------------------- extra-config keys


def test_defaults(machine):
    machine(2048)
    config = parse({"host_pool_gib": 384})
    assert config.host_pool_gib == 384.0
    assert config.host_pool_bytes == 384 << 30
    assert config.device_buffer_size == 4096  # (1 + 1) * 2048
    assert config.hot_blocks_per_request == 64
    assert config.eager_host_mirror is True
    assert config.ops_backend == "auto"
    assert config.record_trace is None
    assert config.index_share_prefetch is True
    assert config.overlap_conversion is True
    assert config.prefetch_max_ctas == 16
    assert config.gather_ctas_per_sm == DEFAULT_LEADER_CTAS_PER_SM
    assert config.hot_region_eviction == "lru"


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
         "prefetch_max_ctas": 0, "overlap_conversion": False}
    )
    assert (config.device_buffer_size, config.eager_host_mirror, config.ops_backend) == (
        8192, False, "reference")
    assert (config.index_share_prefetch, config.prefetch_max_ctas) == (False, 0)
    assert config.overlap_conversion is False
    with pytest.raises(HiSparseConfigError, match=r"overlap_conversion='yes' is invalid; "
                                                  r"accepted: true or false"):
        parse({"host_pool_gib": 1, "overlap_conversion": "yes"})


def test_record_trace_path(tmp_path):
    path = str(tmp_path / "trace.bin")
    assert parse({"host_pool_gib": 1, "record_trace": path}).record_trace == path
    with pytest.raises(HiSparseConfigError, match=r"record_trace=.*does not exist"):
        parse({"host_pool_gib": 1, "record_trace": str(tmp_path / "no" / "trace.bin")})
    with pytest.raises(HiSparseConfigError, match="record_trace=''.*accepted: a file path"):
        parse({"host_pool_gib": 1, "record_trace": ""})


def test_record_trace_must_be_a_writable_file(tmp_path, monkeypatch):
    for directory in (str(tmp_path), str(tmp_path) + "/"):
        with pytest.raises(HiSparseConfigError, match=r"record_trace=.* is a directory; accepted: "
                           "a writable file path"):
            parse({"host_pool_gib": 1, "record_trace": directory})
    existing = tmp_path / "old.trace"
    existing.write_bytes(b"")
    assert parse({"host_pool_gib": 1, "record_trace": str(existing)}).record_trace == str(existing)
    # Permission bits do not bind root, so the kernel's answer is simulated.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if os.path.samefile(
        path, tmp_path) or os.path.samefile(path, existing) else real_access(path, mode))
    with pytest.raises(HiSparseConfigError, match=r"old.trace' exists and is not writable"):
        parse({"host_pool_gib": 1, "record_trace": str(existing)})
    with pytest.raises(HiSparseConfigError, match=rf"directory '{tmp_path}' is not writable"):
        parse({"host_pool_gib": 1, "record_trace": str(tmp_path / "new.trace")})


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


@pytest.mark.parametrize("value", [1e6, 1e30, 10**400, 9])
def test_host_pool_gib_bounded_by_ram_and_cgroup(machine, value):
    """Larger than the machine: a named error with both numbers, not MemoryError /
    ValueError / OverflowError later."""
    machine(16, 8)
    with pytest.raises(HiSparseConfigError) as err:
        parse({"host_pool_gib": value})
    message = str(err.value)
    assert "more than this machine can pin" in message
    assert "physical RAM 16.00 GiB" in message and "cgroup memory limit 8.00 GiB" in message
    assert "accepted: host_pool_gib <= 8.00" in message
    machine(16)
    assert parse({"host_pool_gib": 9}).host_pool_gib == 9.0
    machine(None)  # the OS does not say: no bound to check against
    assert parse({"host_pool_gib": 17}).host_pool_gib == 17.0


def test_host_memory_can_be_stated_to_validate_a_config_for_a_larger_node(machine, monkeypatch):
    """VLLM_HISPARSE_HOST_MEMORY_GIB: the deployment node's memory, so a deployment's config
    (examples/: 384 GiB pools) validates on a small machine; still a bound."""
    machine(16, 8)
    with pytest.raises(HiSparseConfigError, match="set VLLM_HISPARSE_HOST_MEMORY_GIB to that "
                       "node's memory"):
        parse({"host_pool_gib": 384})
    monkeypatch.setenv("VLLM_HISPARSE_HOST_MEMORY_GIB", "2048")
    assert parse({"host_pool_gib": 384}).host_pool_gib == 384.0
    with pytest.raises(HiSparseConfigError, match=r"more than this machine can pin "
                       r"\(VLLM_HISPARSE_HOST_MEMORY_GIB=2048\)"):
        parse({"host_pool_gib": 4096})
    for bad in ("lots", "0", "-1", "nan", "inf"):
        monkeypatch.setenv("VLLM_HISPARSE_HOST_MEMORY_GIB", bad)
        with pytest.raises(HiSparseConfigError, match=r"VLLM_HISPARSE_HOST_MEMORY_GIB=.* is "
                           "invalid; accepted: a finite number > 0"):
            parse({"host_pool_gib": 1})


def test_host_memory_limit_reads_cgroup_v2_and_v1(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/app/worker\n")
    (cg / "app" / "worker").mkdir(parents=True)
    (cg / "app" / "worker" / "memory.max").write_text("max\n")
    (cg / "app" / "memory.max").write_text(f"{6 * GIB}\n")
    limit = capacity.host_memory_limit(proc_root=str(proc), cgroup_root=str(cg))
    assert limit.cgroup_bytes == 6 * GIB
    assert limit.cgroup_file == str(cg / "app" / "memory.max")
    assert limit.physical_bytes == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert limit.limit_bytes == min(6 * GIB, limit.physical_bytes)
    # v1, in a container whose cgroup path does not exist under the namespaced mount.
    (proc / "self" / "cgroup").write_text("4:memory:/docker/abc\n0::/\n")
    (cg / "memory").mkdir()
    (cg / "memory" / "memory.limit_in_bytes").write_text(f"{3 * GIB}\n")
    limit = capacity.host_memory_limit(proc_root=str(proc), cgroup_root=str(cg))
    assert (limit.cgroup_bytes, limit.cgroup_file) == (
        3 * GIB, str(cg / "memory" / "memory.limit_in_bytes"))
    (cg / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    assert capacity.host_memory_limit(proc_root=str(proc), cgroup_root=str(cg)).cgroup_bytes is None
    assert "no cgroup memory limit" in capacity.host_memory_limit(
        proc_root=str(tmp_path / "none"), cgroup_root=str(cg)).describe()


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
    assert parse({"host_pool_gib": 1, "hot_region_eviction": "score"}).hot_region_eviction \
        == "score"
    with pytest.raises(HiSparseConfigError,
                       match=r"hot_region_eviction='lfu' is invalid; accepted: lru \| score"):
        parse({"host_pool_gib": 1, "hot_region_eviction": "lfu"})


def test_host_layout_key():
    assert parse({"host_pool_gib": 1}).host_layout == "auto"
    for value in ("auto", "position", "layer"):
        assert parse({"host_pool_gib": 1, "host_layout": value}).host_layout == value
    for bad in ("page", "Layer", 1, None):
        with pytest.raises(HiSparseConfigError, match=rf"host_layout={bad!r} is invalid; "
                                                      r"accepted: auto \| position \| layer"):
            parse({"host_pool_gib": 1, "host_layout": bad})


def test_gather_ctas_per_sm():
    assert parse({"host_pool_gib": 1, "gather_ctas_per_sm": 1}).gather_ctas_per_sm == 1
    assert parse({"host_pool_gib": 1, "gather_ctas_per_sm": 0}).gather_ctas_per_sm == 0
    for bad in (-1, 33, 1.0, True, "1", None):
        with pytest.raises(HiSparseConfigError, match=r"gather_ctas_per_sm=.* accepted: an "
                                                      r"integer between 0 .* and 32"):
            parse({"host_pool_gib": 1, "gather_ctas_per_sm": bad})


@pytest.mark.parametrize("value", [-1, 4097, 16.0, True, "16", None])
def test_prefetch_max_ctas_bad_values(value):
    with pytest.raises(HiSparseConfigError,
                       match=r"prefetch_max_ctas=.* accepted: an integer between 0 .* and 4096"):
        parse({"host_pool_gib": 1, "prefetch_max_ctas": value})
    with pytest.raises(HiSparseConfigError, match="index_share_prefetch=1.*true or false"):
        parse({"host_pool_gib": 1, "index_share_prefetch": 1})


def test_adaptive_hot_region_keys():
    fixed = parse({"host_pool_gib": 1})
    assert fixed.adaptive_hot_region is False and fixed.hot_sizing() is None
    assert fixed.hot_table_rows == fixed.device_buffer_size == 4096
    config = parse({"host_pool_gib": 1, "adaptive_hot_region": True,
                    "hot_region_target_miss_rate": 0.2})
    sizing = config.hot_sizing()
    # One step's selections (2048 rows) up to twice the default region (2 * 4096 rows).
    assert (sizing.min_blocks, sizing.max_blocks, sizing.target_miss_rate) == (32, 128, 0.2)
    assert config.hot_table_rows == 8192
    capped = parse({"host_pool_gib": 1, "adaptive_hot_region": True,
                    "device_buffer_size": 20480})
    assert capped.hot_table_rows == MAX_DEVICE_BUFFER_ROWS
    assert parse({"host_pool_gib": 1, "adaptive_hot_region": True},
                 max_decode_query_len=2).hot_sizing().min_blocks == 64


@pytest.mark.parametrize("extra, message", [
    ({"adaptive_hot_region": "true"}, "adaptive_hot_region='true'.*true or false"),
    ({"adaptive_hot_region": True, "hot_region_target_miss_rate": 0},
     "hot_region_target_miss_rate=0 is invalid.*greater than 0 and less than 1"),
    ({"adaptive_hot_region": True, "hot_region_target_miss_rate": 1.5},
     "hot_region_target_miss_rate=1.5 is invalid"),
    ({"adaptive_hot_region": True, "hot_region_target_miss_rate": True},
     "hot_region_target_miss_rate=True is invalid"),
    ({"hot_region_target_miss_rate": 0.1}, "adaptive_hot_region is false"),
])
def test_adaptive_hot_region_bad_values(extra, message):
    with pytest.raises(HiSparseConfigError, match=message):
        parse({"host_pool_gib": 1, **extra})


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


MALFORMED_MULTI = [
    ({"a": 1}, r"kv_connector_extra_config.connectors is a dict; accepted: a list"),
    (["x"], r"connectors\[0\] is 'x' \(str\); accepted: an object"),
    ([None], r"connectors\[0\] is None \(NoneType\)"),
    ([{"kv_role": "kv_both"}], r"connectors\[0\].kv_connector is None; accepted: a connector name"),
    ([{"kv_connector": CONNECTOR_NAME, "kv_connector_extra_config": [["host_pool_gib", 1]]}],
     r"connectors\[0\].kv_connector_extra_config is a list; accepted: an object or null"),
]


def _nested(levels: int) -> dict:
    extra = {"connectors": [{"kv_connector": CONNECTOR_NAME, "kv_role": "kv_both",
                             "kv_connector_extra_config": {"host_pool_gib": 1}}]}
    for _ in range(levels - 1):
        extra = {"connectors": [{"kv_connector": "MultiConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": extra}]}
    return extra


@pytest.mark.parametrize(("connectors", "message"), MALFORMED_MULTI)
def test_malformed_multiconnector_children_are_named(dsa_model_dir, connectors, message):
    """Shapes vLLM's KVTransferConfig accepts: rejected with the path of the bad entry,
    when the VllmConfig is built (vLLM's own checks would raise AttributeError)."""
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                             kv_connector_extra_config={"connectors": connectors})
    with pytest.raises(ValueError, match=message) as err:
        make_vllm_config(dsa_model_dir, kv_transfer=multi)
    assert isinstance(err.value.errors()[0]["ctx"]["error"], HiSparseConfigError)


def test_multiconnector_nesting_is_bounded(dsa_model_dir):
    nested = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                              kv_connector_extra_config=_nested(2))
    assert find_connector_extra_config(
        make_vllm_config(dsa_model_dir, kv_transfer=nested)) == {"host_pool_gib": 1}
    deep = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config=_nested(50))
    with pytest.raises(ValueError, match=r"nests MultiConnector more than 4 levels deep"):
        make_vllm_config(dsa_model_dir, kv_transfer=deep)


# ---------------------------------------------------------------- checked when VllmConfig is built


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"host_pool_gib": 1, "host_pool_gb": 2}, r"unknown kv_connector_extra_config key "
         r"'host_pool_gb' \(did you mean 'host_pool_gib'\?\)"),
        ({"host_pool_gib": -1}, r"host_pool_gib=-1 is invalid"),
        ({"host_pool_gib": 1, "ops_backend": "triton"}, r"ops_backend='triton' is invalid"),
        ({"host_pool_gib": 1, "device_buffer_size": "4096"}, r"device_buffer_size='4096'"),
        ({"host_pool_gib": 1, "record_trace": "/"}, r"record_trace='/' is a directory"),
    ],
)
@pytest.mark.parametrize("under_multi", [False, True])
def test_bad_extra_config_fails_when_vllm_config_is_built(dsa_model_dir, extra, message, under_multi):
    """Issue 14: the API-server process builds the VllmConfig; the error is ours and names
    the key (pydantic wraps it in a ValidationError, itself a ValueError)."""
    with pytest.raises(ValueError, match=message) as err:
        make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config(extra, under_multi=under_multi))
    assert isinstance(err.value.errors()[0]["ctx"]["error"], HiSparseConfigError)


def test_config_check_patch_install_remove(dsa_model_dir):
    bad = {"host_pool_gib": 1, "host_pool_gb": 2}
    assert patches.CONFIG_CHECK.installed()
    assert not patches.CONFIG_CHECK.install(config_module.check_extra_config)  # idempotent
    assert patches.CONFIG_CHECK.remove()
    try:
        assert not patches.CONFIG_CHECK.installed() and not patches.CONFIG_CHECK.remove()
        make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config(bad))  # vLLM alone: accepted
    finally:
        register()  # reinstalls the plugin's check
    assert patches.CONFIG_CHECK.installed()
    with pytest.raises(ValueError, match="host_pool_gb"):
        make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config(bad))
    # Configs that do not name the connector are untouched.
    make_vllm_config(dsa_model_dir)


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


def _our_error(excinfo) -> HiSparseConfigError:
    """The HiSparseConfigError inside the ValidationError vLLM's pydantic config raised."""
    error = excinfo.value.errors()[0]["ctx"]["error"]
    assert isinstance(error, HiSparseConfigError)
    return error


def test_pipeline_parallel_rejected(dsa_model_dir):
    """Refused when the VllmConfig is built (tests/vllm/test_config_serve_path.py builds it
    as `vllm serve` does); the engine's second line refuses a config changed afterwards."""
    with pytest.raises(ValueError, match="pipeline_parallel_size=2; accepted: 1") as err:
        make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config(), pipeline_parallel_size=2)
    _our_error(err)
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    vllm_config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(HiSparseConfigError, match="pipeline_parallel_size=2; accepted: 1"):
        resolve_config(vllm_config)


def test_decode_context_parallel_rejected(dsa_model_dir):
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    vllm_config.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(HiSparseConfigError, match="decode_context_parallel_size=2; accepted: 1"):
        resolve_config(vllm_config)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY",
                                  "PIECEWISE", "NONE"])
def test_every_cudagraph_mode_accepted(dsa_model_dir, mode):
    """vLLM's default FULL_AND_PIECEWISE included: captured forwards read each step's values
    from fixed buffers (attention_hook.py; tests/vllm/test_cuda_graph_steps.py)."""
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    resolve_config(vllm_config)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY"])
def test_trace_recording_with_full_cudagraphs_rejected(dsa_model_dir, mode, tmp_path):
    path = str(tmp_path / "trace.npz")
    vllm_config = make_vllm_config(dsa_model_dir,
                                   kv_transfer=kv_transfer_config({"host_pool_gib": 4,
                                                                "record_trace": path}))
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode[mode]
    with pytest.raises(HiSparseConfigError,
                       match=rf"record_trace cannot record steps replayed in full CUDA graphs "
                             rf"\(cudagraph_mode={mode}\); accepted: cudagraph_mode PIECEWISE"):
        resolve_config(vllm_config)
    vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    assert resolve_config(vllm_config).record_trace == path


def test_v1_model_runner_rejected(dsa_model_dir, monkeypatch):
    import vllm.envs as envs
    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", False)
    with pytest.raises(HiSparseConfigError) as err:
        resolve_config(vllm_config)
    # One sentence that says what runs, why, and what to change (it used to read
    # "...(VLLM_USE_V2_MODEL_RUNNER=0 or a feature V2 lacks)=True; accepted: ...").
    assert str(err.value) == (
        "HiSparseResidencyConnector needs vLLM's Model Runner V2, but this config runs the V1 "
        "model runner (VLLM_USE_V2_MODEL_RUNNER=0); accepted: Model Runner V2 (unset "
        "VLLM_USE_V2_MODEL_RUNNER or set it to 1, and drop the options V2 does not support).")
    with pytest.raises(ValueError, match=r"runs the V1 model runner \(VLLM_USE_V2_MODEL_RUNNER=0\)"):
        make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())


def test_model_without_index_topk_rejected(mla_model_dir):
    with pytest.raises(ValueError, match="index_topk=None; accepted: a DSA") as err:
        make_vllm_config(mla_model_dir, kv_transfer=kv_transfer_config())
    _our_error(err)


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
