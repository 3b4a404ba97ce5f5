"""vLLM's connector API and factory: the public base classes the connector derives from, the
factory's registry (idempotent registration), and what a MultiConnector child can learn of
its parent (the composing config, the load-failure policy)."""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, KVConnectorTransferResults,
                                                              KVConnectorWorkerMetadata, SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.outputs import KVConnectorOutput

__all__ = ["KVConnectorBase_V1", "KVConnectorFactory", "KVConnectorMetadata", "KVConnectorOutput",
           "KVConnectorPromMetrics", "KVConnectorRole", "KVConnectorStats",
           "KVConnectorTransferResults", "KVConnectorWorkerMetadata", "SupportsHMA",
           "composing_kv_transfer_config", "connector_is_registered", "kv_load_failure_policy",
           "multi_connector_types", "register_connector", "resolve_connector_class"]


def connector_is_registered(name: str) -> bool:
    """Whether ``KVConnectorFactory`` already maps ``name`` to a loader.

    ``register_connector`` raises on a duplicate name, and the registry has no public
    query, so idempotent registration has to look at the private dict.
    """
    return name in KVConnectorFactory._registry


def register_connector(name: str, module_path: str, class_name: str) -> bool:
    """Register a lazily imported connector class; return False if already there."""
    if connector_is_registered(name):
        return False
    KVConnectorFactory.register_connector(name, module_path, class_name)
    return True


def resolve_connector_class(name: str) -> type:
    """The class the factory builds for ``kv_connector: name`` (imports it)."""
    return KVConnectorFactory.get_connector_class_by_name(name)


def kv_load_failure_policy(vllm_config: VllmConfig) -> str:
    """``kv_load_failure_policy`` the engine applies: ``"fail"`` (vLLM fails a request
    whose connector load failed) or ``"recompute"`` (vLLM rewinds its computed tokens).
    Under MultiConnector it is the top-level setting (the scheduler reads that one), not
    the child's copy (:func:`composing_kv_transfer_config`)."""
    kv = composing_kv_transfer_config(vllm_config)
    return str(getattr(kv, "kv_load_failure_policy", "fail")) if kv is not None else "fail"


def composing_kv_transfer_config(vllm_config: VllmConfig) -> Any:
    """The ``kv_transfer_config`` of the MultiConnector that is constructing this
    connector, else ``vllm_config``'s own.

    vLLM's ``MultiConnector.__init__`` builds each child with a copy of the config whose
    ``kv_transfer_config`` is the child's entry only (``multi_connector.py:184,245``), so
    a child cannot see its siblings, their order or the top-level settings. A child
    constructed by a MultiConnector has that ``__init__`` frame on the stack, with the
    whole config as its ``vllm_config`` argument; called from a connector's constructor,
    this finds it (the innermost one, for nested MultiConnectors)."""
    import inspect

    multi_connector = multi_connector_types()[0]
    frame = inspect.currentframe()
    try:
        caller = frame.f_back if frame is not None else None
        while caller is not None:
            if caller.f_code.co_name == "__init__" and isinstance(caller.f_locals.get("self"), multi_connector):
                parent = caller.f_locals.get("vllm_config")
                if parent is not None and parent.kv_transfer_config is not None:
                    return parent.kv_transfer_config
            caller = caller.f_back
    finally:
        del frame
    return vllm_config.kv_transfer_config


def multi_connector_types() -> tuple[type, type, type]:
    """``(MultiConnector, MultiKVConnectorMetadata, MultiKVConnectorWorkerMetadata)``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorMetadata,
        MultiKVConnectorWorkerMetadata,
    )

    return MultiConnector, MultiKVConnectorMetadata, MultiKVConnectorWorkerMetadata
