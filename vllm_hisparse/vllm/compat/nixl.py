"""The P/D decode consumer's side of vLLM's NixlConnector protocol (used by pd/landings.py and
pd/nixl_transport.py; checked in tests/vllm/test_compat.py)."""

from __future__ import annotations

from collections.abc import Callable

from vllm.config import VllmConfig

__all__ = ["NIXL_PULL_CONNECTORS", "nixl_handshake_types", "prefill_backoff_tokens"]

#: ``kv_connector`` names of vLLM's pull-mode NIXL connector (a decode instance READs the
#: prefill's blocks), the only NIXL mode a host landing speaks.
NIXL_PULL_CONNECTORS = ("NixlConnector", "NixlPullConnector")


def nixl_handshake_types() -> tuple[bytes, type, type, Callable[..., str]]:
    """``(GET_META_MSG, NixlHandshakePayload, NixlAgentMetadata,
    compute_nixl_compatibility_hash)`` of vLLM's NixlConnector (``nixl/metadata.py``): the
    side-channel query, its answer, the registration inside it, and the hash both sides
    compare."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        GET_META_MSG,
        NixlAgentMetadata,
        NixlHandshakePayload,
        compute_nixl_compatibility_hash,
    )

    return GET_META_MSG, NixlHandshakePayload, NixlAgentMetadata, compute_nixl_compatibility_hash


def prefill_backoff_tokens(vllm_config: VllmConfig) -> int:
    """Trailing prompt tokens a NIXL decode instance recomputes instead of loading (vLLM's
    ``_prefill_backoff`` for models without Mamba or bounded replay, i.e. DSA models):
    ``num_prefill_lookahead_tokens - 1``, at least 0."""
    return max(0, int(vllm_config.num_prefill_lookahead_tokens) - 1)
