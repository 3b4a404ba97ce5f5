"""The engine pieces the CPU simulator (vllm_hisparse/vllm/simulation) drives for real. Checked
by tests/vllm/test_compat.py::test_simulator_internals_exist."""

from __future__ import annotations

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import get_kv_quant_mode
from vllm.v1.metrics.utils import create_metric_per_engine  # (and metrics.py)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

SIMULATOR_INTERNALS = (
    CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, ParallelConfig, SchedulerConfig,
    SamplingParams, sha256, get_global_kv_cache_groups, get_kv_cache_configs,
    generate_scheduler_kv_cache_config, get_request_block_hasher, init_none_hash,
    get_kv_quant_mode, ModelRunnerOutput, Request, StructuredOutputManager,
    create_metric_per_engine, KVOutputAggregator, SpeculativeConfig, DraftTokenIds,
)


__all__ = ["CacheConfig", "DeviceConfig", "DraftTokenIds", "KVOutputAggregator", "KVTransferConfig",
           "ModelConfig", "ModelRunnerOutput", "ParallelConfig", "Request", "SIMULATOR_INTERNALS",
           "SamplingParams", "SchedulerConfig", "SpeculativeConfig", "StructuredOutputManager",
           "create_metric_per_engine", "generate_scheduler_kv_cache_config", "get_global_kv_cache_groups",
           "get_kv_cache_configs", "get_kv_quant_mode", "get_request_block_hasher", "init_none_hash",
           "sha256"]
