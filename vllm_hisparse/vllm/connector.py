"""``HiSparseResidencyConnector``: the vLLM KV connector of this package (a façade).

The class is what vLLM's factory resolves for ``"kv_connector":
"HiSparseResidencyConnector"`` and what ``VllmConfig`` inspects while it validates
(``SupportsHMA``, the required KV layout). Construction validates the configuration
in both roles, then builds the role's implementation:

* scheduler role → :class:`~vllm_hisparse.vllm.scheduler_side.role.SchedulerRole`;
* worker role → ``vllm_hisparse.vllm.worker_side.role.WorkerRole`` (imported lazily,
  so the scheduler process never imports the worker stack).

Every connector method is a two-line delegation to the role that owns it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_hisparse.vllm.compat import (
    KVCacheConfig,
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
    VllmConfig,
)
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.setup.kv_plan import sparse_group_ids
from vllm_hisparse.vllm.metrics import HiSparseConnectorStats, HiSparsePromMetrics
from vllm_hisparse.vllm.setup.offloading_scope import check_offloading_scope

if TYPE_CHECKING:
    from vllm_hisparse.vllm.scheduler_side.role import SchedulerRole

#: Physical KV layout the split needs: groups of different page sizes share one
#: pool only when the block is the outermost dimension.
REQUIRED_KV_CACHE_LAYOUT = "BLHNC"


class HiSparseResidencyConnector(KVConnectorBase_V1, SupportsHMA):
    """Hierarchical (GPU + pinned host) KV residency for DSA sparse-MLA layers."""

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return REQUIRED_KV_CACHE_LAYOUT

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HiSparseConnectorStats:
        return HiSparseConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HiSparsePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # Config errors first, in both roles: they are the user's to fix.
        self.hisparse_config = resolve_config(vllm_config)
        if kv_cache_config is None:
            raise ValueError(
                f"{CONNECTOR_NAME} needs the engine's KV cache config (vLLM passes it to "
                "connectors that accept kv_cache_config); got None"
            )
        sparse_group_ids(kv_cache_config)  # the planner split must have run
        check_offloading_scope(kv_cache_config)
        super().__init__(vllm_config, role, kv_cache_config)
        self._scheduler: SchedulerRole | None = None
        self._worker: Any = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm_hisparse.vllm.scheduler_side.role import SchedulerRole

            self._scheduler = SchedulerRole(vllm_config, self.hisparse_config, kv_cache_config)
        else:
            from vllm_hisparse.vllm.worker_side.role import WorkerRole

            self._worker = WorkerRole(vllm_config, self.hisparse_config, kv_cache_config)

    # ------------------------------------------------------------------ scheduler role
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.offer(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        self._scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self._scheduler.request_finished_all_groups(request, block_ids)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Only reached with the hybrid KV cache manager off, which config rejects.
        raise RuntimeError(f"{CONNECTOR_NAME} requires the hybrid KV cache manager (request_finished_all_groups)")

    def has_pending_block_frees(self) -> bool:
        return self._scheduler.has_pending_block_frees()

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    def get_kv_connector_stats(self) -> Any:
        if self._scheduler is not None:
            return self._scheduler.get_kv_connector_stats()
        return HiSparseConnectorStats.from_worker(self._worker.get_stats())

    @property
    def scheduler_role(self) -> SchedulerRole:
        """The scheduler-role implementation (tests and tools)."""
        return self._scheduler

    @property
    def worker_role(self) -> Any:
        """The worker-role implementation, ``WorkerRole`` (tests and tools)."""
        return self._worker

    # ------------------------------------------------------------------ worker role
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind_step_metadata()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.bind_step_metadata(False)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # vLLM MRV2 passes request_ids, scheduler_output, attn_metadata, ...: the worker
        # role needs them to map batch rows to state rows.
        self._worker.start_load_kv(self._get_connector_metadata(), **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # host rows are gathered inside the attention op, not per layer here

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # rows are mirrored per step (wait_for_save), not per layer

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def build_connector_worker_meta(self) -> Any:
        return self._worker.build_worker_meta()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # Host-prefix loads, per request: vLLM refuses block-level load errors
        # (get_block_ids_with_load_errors) with several KV cache groups.
        return self._worker.get_transfer_results()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
