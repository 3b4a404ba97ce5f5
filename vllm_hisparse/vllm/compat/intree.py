"""vLLM's in-tree Hybrid HiSparse: only the scheduler benchmarks touch it, to compare against
it (cli/benchmarks/vllm_baselines.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["intree_hisparse"]


def intree_hisparse() -> tuple[str, type, type, Callable[..., Any], tuple[type, ...]]:
    """``(connector name, HiSparseConfig, HiSparseConnectorWorkerMetadata,
    get_hisparse_kv_cache_groups, (HiSparseResidentSpec, HiSparseHotSpec))`` of vLLM's
    in-tree HiSparse. The name is read from vLLM's connector class: configuring it switches
    the in-tree path on, so the package holds no literal of it (tests/vllm/test_plugin.py)."""
    from vllm.config.attention import HiSparseConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse import connector as intree
    from vllm.v1.hisparse.layout import get_hisparse_kv_cache_groups
    from vllm.v1.kv_cache_interface import HiSparseHotSpec, HiSparseResidentSpec

    return (intree.HiSparseConnector.__name__, HiSparseConfig, intree.HiSparseConnectorWorkerMetadata,
            get_hisparse_kv_cache_groups, (HiSparseResidentSpec, HiSparseHotSpec))
