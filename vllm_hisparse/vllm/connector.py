"""``HiSparseResidencyConnector``: the vLLM KV connector of this package.

The class is what vLLM's factory resolves for ``"kv_connector":
"HiSparseResidencyConnector"`` and what ``VllmConfig`` inspects while it validates
(``SupportsHMA``, the required KV layout). Those class-level answers are final.

The scheduler and worker roles (binding the core residency policy to vLLM's
``KVCacheManager``/``BlockPool``, the per-step command, worker acks, host mirroring)
are not implemented yet. Rather than run as a connector that silently keeps every
page resident, construction validates the configuration (so config errors surface
first) and then raises ``NotImplementedError`` naming what is missing.
"""

from __future__ import annotations

from typing import Any

from vllm_hisparse.vllm.compat import (
    KVCacheConfig,
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    VllmConfig,
)
from vllm_hisparse.vllm.config import CONNECTOR_NAME, resolve_config
from vllm_hisparse.vllm.kv_planning import sparse_group_ids

#: Physical KV layout the split needs: groups of different page sizes share one
#: pool only when the block is the outermost dimension.
REQUIRED_KV_CACHE_LAYOUT = "BLHNC"


class HiSparseResidencyConnector(KVConnectorBase_V1, SupportsHMA):
    """Hierarchical (GPU + pinned host) KV residency for DSA sparse-MLA layers."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return REQUIRED_KV_CACHE_LAYOUT

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # Config errors first, in both roles: they are the user's to fix.
        self.hisparse_config = resolve_config(vllm_config)
        if kv_cache_config is not None:
            sparse_group_ids(kv_cache_config)  # the planner split must have run
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        raise NotImplementedError(
            f"{CONNECTOR_NAME}: the {side} role is not implemented yet (residency-aware "
            "managers, the per-step command and the worker data plane are pending); "
            "configuration and KV planning are validated, nothing else runs."
        )

    # The abstract methods of KVConnectorBase_V1 and SupportsHMA. They must exist so
    # that construction reaches __init__ (and its clear error) instead of failing in
    # ABC with "Can't instantiate abstract class"; they are unreachable until then.
    def _not_implemented(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{CONNECTOR_NAME}: connector roles not implemented")

    start_load_kv = _not_implemented
    wait_for_layer_load = _not_implemented
    save_kv_layer = _not_implemented
    wait_for_save = _not_implemented
    get_num_new_matched_tokens = _not_implemented
    update_state_after_alloc = _not_implemented
    build_connector_meta = _not_implemented
    request_finished_all_groups = _not_implemented
