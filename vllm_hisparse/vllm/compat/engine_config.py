"""The engine's configuration: ``VllmConfig`` and what the package reads of it at config time
(vllm_hisparse/vllm/setup/engine_checks.py; checked by
tests/vllm/test_compat.py::test_config_time_accessors) and for the parallel layout
(vllm_hisparse/vllm/setup/host_sharing.py; tests/vllm/test_compat.py::test_parallel_layout_accessors)."""

from __future__ import annotations

from vllm.config import KVTransferConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode

__all__ = ["CUDAGraphMode", "KVTransferConfig", "VllmConfig", "data_parallel_rank",
           "executor_backend_name", "instance_id", "is_submodel_config", "nodes_per_replica",
           "platform_supports_hybrid_kv_cache", "tensor_parallel_rank", "user_specified_block_size",
           "v2_model_runner_env_off", "v2_model_runner_unsupported_features"]


def instance_id(vllm_config: VllmConfig) -> str:
    """``VllmConfig.instance_id``: set when the config is built (``config/vllm.py``
    ``__post_init__``) and shipped, pickled, to the engine core and every worker of it."""
    return str(vllm_config.instance_id or "")


def data_parallel_rank(vllm_config: VllmConfig) -> int:
    """``ParallelConfig.data_parallel_rank``: this engine's data-parallel replica."""
    return int(vllm_config.parallel_config.data_parallel_rank)


def executor_backend_name(vllm_config: VllmConfig) -> str | None:
    """``ParallelConfig.distributed_executor_backend`` as a name (``"mp"``, ``"ray"``,
    ``"uni"``, ``"external_launcher"``; an executor class gives its class name)."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend is None or isinstance(backend, str):
        return backend
    return getattr(backend, "__name__", str(backend))


def nodes_per_replica(vllm_config: VllmConfig) -> int:
    """``ParallelConfig.nnodes_within_dp``: nodes one data-parallel replica spans."""
    return int(vllm_config.parallel_config.nnodes_within_dp)


def tensor_parallel_rank(vllm_config: VllmConfig) -> int:
    """This worker's rank in its tensor-parallel group: vLLM's TP group once it exists (the
    worker initialises it before the connector binds the KV caches), else
    ``ParallelConfig.rank`` (set per worker by ``WorkerBase``) modulo the TP size."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    pc = vllm_config.parallel_config
    return int(pc.rank) % max(1, int(pc.tensor_parallel_size))


def is_submodel_config(vllm_config: VllmConfig) -> bool:
    """``ModelConfig.is_submodel_config``: a view of a validated config that
    ``VllmConfig.__post_init__`` skips."""
    return bool(getattr(vllm_config.model_config, "is_submodel_config", False))


def user_specified_block_size(vllm_config: VllmConfig) -> bool:
    """``CacheConfig.user_specified_block_size``; otherwise the engine process picks the block
    size with the attention backends (``Platform.update_block_size_for_backend``)."""
    return bool(getattr(vllm_config.cache_config, "user_specified_block_size", False))


def platform_supports_hybrid_kv_cache() -> bool:
    """``current_platform.support_hybrid_kv_cache()`` (False: vLLM always turns it off)."""
    from vllm.platforms import current_platform

    return bool(current_platform.support_hybrid_kv_cache())


def v2_model_runner_unsupported_features(vllm_config: VllmConfig) -> list[str]:
    """Why vLLM falls back to the V1 model runner
    (``VllmConfig._get_v2_model_runner_unsupported_features``); [] when it does not say."""
    method = getattr(vllm_config, "_get_v2_model_runner_unsupported_features", None)
    try:
        return [str(feature) for feature in method()] if callable(method) else []
    except Exception:  # a diagnostic only: never hide the real error behind this one
        return []


def v2_model_runner_env_off() -> bool:
    """Whether ``VLLM_USE_V2_MODEL_RUNNER`` was set to a false value (``vllm.envs``)."""
    import vllm.envs as envs

    return envs.VLLM_USE_V2_MODEL_RUNNER is False
