"""The ``vllm.general_plugins`` entry point: ``hisparse_residency``.

vLLM calls ``register()`` in every process it starts (API server, engine core,
workers) before any ``VllmConfig`` exists, so this function cannot know whether the
connector will be used. It therefore only does things that are inert unless a
config names ``HiSparseResidencyConnector``:

1. registers the connector class with vLLM's ``KVConnectorFactory`` under that name
   (lazy: the module is imported only when a config asks for it);
2. installs the planner hook (``patches.PLANNER_HOOK``), whose callback returns
   our KV-cache config builder only for configs that name the connector.

Calling ``register()`` again is a no-op.
"""

from __future__ import annotations

import logging

from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.config import CONNECTOR_MODULE, CONNECTOR_NAME
from vllm_hisparse.vllm.kv_planning import select_builder

logger = logging.getLogger(__name__)


def register() -> None:
    """Register the connector by name and hook KV planning; idempotent."""
    if compat.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME):
        logger.debug("registered %s from %s", CONNECTOR_NAME, CONNECTOR_MODULE)
    if patches.PLANNER_HOOK.install(select_builder):
        logger.debug("installed the vllm_hisparse KV planner hook")
