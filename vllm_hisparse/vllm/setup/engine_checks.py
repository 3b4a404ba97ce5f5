"""Every unsupported setup refused while vLLM builds its ``VllmConfig``, before weights load.

``vllm serve`` builds the ``VllmConfig`` in the API-server process (``make_arg_parser`` →
``AsyncEngineArgs.from_cli_args`` → ``create_engine_config``), long before the engine core
loads weights and plans the KV cache. The plugin's config check (``patches.CONFIG_CHECK``)
wraps ``VllmConfig.__post_init__`` and runs the two functions below around vLLM's own body:

* :func:`check_before_vllm`, on the options as the user gave them: the extra config
  (``config.check_extra_config``), ``kv_role``, pipeline and decode context parallelism, an
  explicit ``--disable-hybrid-kv-cache-manager``, the model's ``index_topk``, and
  ``device_buffer_size`` against one decode step's selections. Before vLLM's body because
  that body rewrites some of them (``disable_hybrid_kv_cache_manager`` None becomes False or
  True, ``async_scheduling`` None becomes a bool) and fails on malformed MultiConnector
  entries with an ``AttributeError``.
* :func:`check_after_vllm`, on what vLLM resolved: async scheduling with speculative
  decoding, the model runner (V2 required), the hybrid KV cache manager turned off by vLLM on
  a platform that has it, ``record_trace`` with full CUDA graphs, and the host pool against
  one ``max_model_len`` request.

The engine core checks again when it plans (:func:`resolve_config`, ``kv_planner``):
that second line costs nothing and catches what only the planned layers tell (layer kinds,
KV layout, the exact host-block rounding).

The host pool check here uses a lower bound of the bytes one token needs on the host, from
the HF config (every sparse-MLA layer's row plus the indexer rows of the layers that keep
an indexer, :func:`host_bytes_per_token_lower_bound`) and ``max_model_len`` tokens without
rounding to whole blocks, so it never refuses a pool the planner would accept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_hisparse.core.units import GIB, cdiv
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.compat import VllmConfig
from vllm_hisparse.vllm.setup.config import (
    CONNECTOR_NAME,
    MAX_DEVICE_BUFFER_ROWS,
    HiSparseConfigError,
    HiSparseResidencyConfig,
    check_extra_config,
    find_connector_entry,
    find_connector_extra_config,
    max_decode_query_len,
    model_top_k,
    parse_extra_config,
)
from vllm_hisparse.vllm.setup.connector_entries import ConnectorEntry
from vllm_hisparse.vllm.setup.kv_plan import host_copies_per_replica

#: KV cache dtypes whose sparse-MLA row size the check knows: the ``fp8_ds_mla`` row
#: (``auto`` included: the smallest row a DSA backend picks for it) and 16-bit rows.
_FP8_ROW_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla")
_BF16_ROW_DTYPES = ("bfloat16", "float16")


# --------------------------------------------------------------------------------------
# The checks (each also part of the engine's second line, check_engine_compatible)
# --------------------------------------------------------------------------------------


def unsupported(option: str, value: Any, accepted: str) -> HiSparseConfigError:
    """``does not support OPTION=VALUE; accepted: ...``: an engine option we cannot run."""
    return HiSparseConfigError(
        f"{CONNECTOR_NAME} does not support {option}={value}; accepted: {accepted}."
    )


#: ``kv_role`` values of our entry with a meaning: ``kv_both`` (colocated) and
#: ``kv_consumer`` (P/D decode node, docs/vllm-integration.md "P/D decode consumer").
ACCEPTED_KV_ROLES = ("kv_both", "kv_consumer")


def check_kv_role(vllm_config: VllmConfig, entry: ConnectorEntry) -> None:
    """Our entry's ``kv_role`` (a MultiConnector child's own, else the top level's)."""
    role = vllm_config.kv_transfer_config.kv_role
    if entry.child is not None:
        role = entry.child.get("kv_role", role)
    if role in ACCEPTED_KV_ROLES:
        return
    raise HiSparseConfigError(
        f"{CONNECTOR_NAME} does not support kv_role={role!r}: it is a decode-side connector "
        "(kv_both: prefill and decode on one instance; kv_consumer: a P/D decode node that "
        "reads a NixlConnector prefill). The prefill node of a P/D deployment runs stock vLLM "
        'with {"kv_connector": "NixlConnector", "kv_role": "kv_producer"} and nothing of '
        f"this package; accepted: kv_role {' or '.join(ACCEPTED_KV_ROLES)}.")


def check_parallelism(vllm_config: VllmConfig) -> None:
    """Residency runs on one pipeline stage, without decode context parallelism."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise unsupported("pipeline_parallel_size", parallel.pipeline_parallel_size,
                          "1 (--pipeline-parallel-size 1; use tensor or data parallelism)")
    if parallel.decode_context_parallel_size > 1:
        raise unsupported("decode_context_parallel_size", parallel.decode_context_parallel_size,
                          "1 (--decode-context-parallel-size 1)")


def hybrid_manager_disabled(why: str) -> HiSparseConfigError:
    return unsupported(
        "disable_hybrid_kv_cache_manager", True,
        f"the hybrid KV cache manager enabled ({why}): residency keeps sparse-MLA and indexer "
        "KV in separate KV cache groups")


def check_runner_and_scheduling(vllm_config: VllmConfig) -> None:
    """Model Runner V2, and no async scheduling with speculative decoding (both as vLLM
    resolved them: after ``VllmConfig.__post_init__``)."""
    # The worker role maps batch rows to request-state rows with the request ids that only
    # Model Runner V2 passes to start_load_kv.
    if not vllm_config.use_v2_model_runner:
        features = compat.v2_model_runner_unsupported_features(vllm_config)
        why = ("VLLM_USE_V2_MODEL_RUNNER=0" if envs_v2_runner_off() else
               f"options Model Runner V2 does not support: {', '.join(features)}" if features
               else "vLLM chose it for this platform or options; its log says why")
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME} needs vLLM's Model Runner V2, but this config runs the V1 model "
            f"runner ({why}); accepted: Model Runner V2 (unset VLLM_USE_V2_MODEL_RUNNER or set "
            "it to 1, and drop the options V2 does not support).")
    # Rejected drafts are rolled back when their step's output arrives (scheduler_side/drafts.py).
    # Under async scheduling the next step is planned before that, and the worker moves
    # its positions on the GPU, so the rows a step writes are unknown when it is planned.
    spec_tokens = max_decode_query_len(vllm_config) - 1
    if spec_tokens and vllm_config.scheduler_config.async_scheduling:
        raise unsupported(
            "async_scheduling", f"True with speculative decoding (num_speculative_tokens="
            f"{spec_tokens})", "--no-async-scheduling when speculative decoding is on (vLLM "
            "turns async scheduling on by default)")


def envs_v2_runner_off() -> bool:
    """Whether ``VLLM_USE_V2_MODEL_RUNNER`` was set to a false value."""
    return compat.v2_model_runner_env_off()


def check_trace_recording(vllm_config: VllmConfig, record_trace: Any) -> None:
    """Every cudagraph_mode runs (worker_side/read_path.py: a captured forward reads each step's
    values from fixed buffers), but the trace recorder reads each step's selections back to
    the host, which a graph replay cannot do."""
    mode = vllm_config.compilation_config.cudagraph_mode
    if record_trace and mode is not None and mode.has_full_cudagraphs():
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: record_trace cannot record steps replayed in full CUDA graphs "
            f"(cudagraph_mode={mode.name}); accepted: cudagraph_mode PIECEWISE or NONE while "
            "recording a trace, or no record_trace."
        )


def check_engine_compatible(vllm_config: VllmConfig) -> None:
    """Reject engine options this connector cannot run under (names the option). The
    plugin runs these checks when the ``VllmConfig`` is built (``engine_checks.py``); the
    engine runs them again when it plans (the platform may have changed what it resolved)."""
    entry = find_connector_entry(vllm_config)
    if entry is not None:
        check_kv_role(vllm_config, entry)
    check_parallelism(vllm_config)
    check_runner_and_scheduling(vllm_config)
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise hybrid_manager_disabled(
            "remove --disable-hybrid-kv-cache-manager; on a GPU vLLM enables it by default")
    model_top_k(vllm_config)


def resolve_config(vllm_config: VllmConfig) -> HiSparseResidencyConfig:
    """Validate the engine and our extra config; the one entry point for callers."""
    extra = find_connector_extra_config(vllm_config)
    if extra is None:
        raise HiSparseConfigError(
            f"kv_transfer_config does not name {CONNECTOR_NAME}; accepted: "
            f'"kv_connector": "{CONNECTOR_NAME}" or a MultiConnector child with that name.'
        )
    check_engine_compatible(vllm_config)
    config = parse_extra_config(
        extra,
        top_k=model_top_k(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        max_decode_query_len=max_decode_query_len(vllm_config),
    )
    check_trace_recording(vllm_config, config.record_trace)
    return config


# --------------------------------------------------------------------------------------
# Before vLLM's __post_init__: the options as given
# --------------------------------------------------------------------------------------


def check_before_vllm(vllm_config: Any) -> None:
    """Refuse what the user's options already rule out; a no-op unless we are configured."""
    check_extra_config(vllm_config)  # our entry's shape and keys (raises on malformed entries)
    entry = find_connector_entry(vllm_config)
    if entry is None or compat.is_submodel_config(vllm_config):
        return
    check_kv_role(vllm_config, entry)
    check_parallelism(vllm_config)
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is True:
        raise hybrid_manager_disabled("remove --disable-hybrid-kv-cache-manager")
    if vllm_config.model_config is None:
        return  # the engine checks the model when it plans
    top_k = model_top_k(vllm_config)
    check_device_buffer_rows(entry.extra, top_k=top_k,
                             max_decode_query_len=max_decode_query_len(vllm_config),
                             block_size=(vllm_config.cache_config.block_size
                                         if compat.user_specified_block_size(vllm_config)
                                         else None))


def check_device_buffer_rows(extra: Mapping[str, Any], *, top_k: int, max_decode_query_len: int,
                             block_size: int | None) -> None:
    """``device_buffer_size`` (given or default) against one decode step's selections and
    the resolver's cap; its block multiple only when the block size is final
    (``block_size`` None: the engine checks it once the backends chose)."""
    min_rows = max_decode_query_len * top_k
    accepted = (f"accepted: a multiple of block_size between max_decode_query_len*top_k="
                f"{max_decode_query_len}*{top_k}={min_rows} and {MAX_DEVICE_BUFFER_ROWS}")
    if "device_buffer_size" not in extra:
        if min_rows > MAX_DEVICE_BUFFER_ROWS:
            raise HiSparseConfigError(
                f"{CONNECTOR_NAME}: the default device_buffer_size is out of range (one decode "
                f"step selects {min_rows} rows, more than the resolver's {MAX_DEVICE_BUFFER_ROWS}"
                f"); accepted: fewer speculative tokens.")
        return
    value = extra["device_buffer_size"]  # an int in 1..MAX (check_extra_config)
    if block_size is not None and value % block_size:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: device_buffer_size={value} is invalid (not a multiple of "
            f"block_size={block_size}); {accepted}.")
    if value < min_rows:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: device_buffer_size={value} is out of range (one decode step can "
            f"select more distinct rows than the hot region holds: the model's index_topk="
            f"{top_k}); {accepted}.")


# --------------------------------------------------------------------------------------
# After vLLM's __post_init__: what vLLM resolved
# --------------------------------------------------------------------------------------


def check_after_vllm(vllm_config: Any) -> None:
    """Refuse what vLLM's resolution of the options rules out; a no-op unless configured."""
    entry = find_connector_entry(vllm_config)
    if entry is None or compat.is_submodel_config(vllm_config):
        return
    check_runner_and_scheduling(vllm_config)
    if (vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
            and compat.platform_supports_hybrid_kv_cache()):
        # vLLM turned it off for another option (chunked local attention, a MultiConnector
        # child without HMA support); on a platform without it the engine cannot run anyway.
        raise hybrid_manager_disabled(
            "vLLM turned it off for another option; its log says which")
    check_trace_recording(vllm_config, entry.extra.get("record_trace"))
    if vllm_config.model_config is not None:
        check_host_pool_holds_one_request(vllm_config, entry.extra["host_pool_gib"])


def host_bytes_per_token_lower_bound(hf_config: Any, cache_dtype: str) -> int | None:
    """Host bytes one token needs at least: the sparse-MLA row of every decoder layer and
    the indexer row of every layer that keeps an indexer. None for a KV dtype whose row
    size is not known here (the planner checks it exactly)."""
    if cache_dtype in _FP8_ROW_DTYPES:
        latent = int(getattr(hf_config, "kv_lora_rank", 512))
        rope = int(getattr(hf_config, "qk_rope_head_dim", 64))
        mla_row = latent + 4 * (latent // 128) + 2 * rope  # fp8 latent, fp32 scales, bf16 rope
    elif cache_dtype in _BF16_ROW_DTYPES:
        mla_row = 2 * (int(getattr(hf_config, "kv_lora_rank", 512))
                       + int(getattr(hf_config, "qk_rope_head_dim", 64)))
    else:
        return None
    head = int(getattr(hf_config, "index_head_dim", 128))
    indexer_row = head + 4 * max(1, head // 128)  # fp8 keys + one fp32 scale per 128
    layers = int(getattr(hf_config, "num_hidden_layers", 0))
    return layers * mla_row + indexer_layer_count(hf_config) * indexer_row


def indexer_layer_count(hf_config: Any) -> int:
    """Decoder layers that keep indexer keys. Every layer, unless the HF config shares one
    indexer's top-k among several layers (GLM-5.x IndexShare): ``index_topk_pattern``
    marks each layer (``S``: reuses a previous top-k), else ``index_topk_freq`` keeps one
    indexer per that many layers after the first ``index_skip_topk_offset - 1``."""
    layers = int(getattr(hf_config, "num_hidden_layers", 0))
    pattern = getattr(hf_config, "index_topk_pattern", None)
    if pattern is not None:
        return sum(1 for i in range(layers) if i >= len(pattern) or pattern[i] != "S")
    freq = max(1, int(getattr(hf_config, "index_topk_freq", 1) or 1))
    first = int(getattr(hf_config, "index_skip_topk_offset", 2)) - 1
    return sum(1 for i in range(layers) if i < first or (i - first) % freq == 0)


def check_host_pool_holds_one_request(vllm_config: Any, host_pool_gib: float) -> None:
    """Refuse a pool that cannot hold one ``max_model_len`` request (lower bound: see the
    module docstring; with auto-fit ``max_model_len`` the engine checks it)."""
    model_config = vllm_config.model_config
    if getattr(model_config, "original_max_model_len", None) == -1:
        return
    per_token = host_bytes_per_token_lower_bound(model_config.hf_text_config,
                                                 str(vllm_config.cache_config.cache_dtype))
    if not per_token:
        return
    copies = host_copies_per_replica(vllm_config)
    max_model_len = int(model_config.max_model_len)
    needed = max_model_len * per_token * copies
    if host_pool_gib * GIB >= needed:
        return
    raise HiSparseConfigError(
        f"{CONNECTOR_NAME}: host_pool_gib={host_pool_gib:g} cannot hold one max_model_len="
        f"{max_model_len} request: it needs at least {max_model_len} tokens x {per_token} B "
        f"(every layer's sparse-MLA row and indexer row) x {copies} "
        f"cop{'y' if copies == 1 else 'ies'} = {needed / GIB:.3f} GiB; accepted: "
        f"host_pool_gib >= {cdiv(int(needed * 1000), GIB) / 1000:.3f} or a smaller "
        "--max-model-len.")
