"""KV cache group roles: the role that selects our residency-aware manager for a group (vLLM's
manager registry by role), and the role plus ``KVCacheConfig`` field that scope vLLM's
``OffloadingConnector`` to the groups it should offload."""

from __future__ import annotations

from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupRole
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

__all__ = ["KVCacheGroupRole", "KVCacheSpecRegistry", "OFFLOADED_GROUP_ROLE", "RESIDENCY_GROUP_ROLE",
           "assign_group_role", "offloading_group_ids", "register_residency_manager",
           "residency_manager_registered", "scope_offloading"]

#: Group role that selects our manager for a sparse-MLA group. vLLM resolves a group's
#: manager as ``KVCacheSpecRegistry.get_manager_class(spec, group.role)`` and a
#: role-registered manager wins (``kv_cache_spec_registry.py``); the role is looked up
#: as a plain ``dict`` key, so a string outside vLLM's ``KVCacheGroupRole`` enum works
#: and cannot collide with an in-tree role.
RESIDENCY_GROUP_ROLE = "vllm_hisparse_residency"


def residency_manager_registered() -> bool:
    """Whether ``RESIDENCY_GROUP_ROLE`` is mapped to a manager class."""
    from vllm.v1.kv_cache_spec_registry import _REGISTRY_ROLE_MANAGERS

    return RESIDENCY_GROUP_ROLE in _REGISTRY_ROLE_MANAGERS


#: ``KVCacheGroupSpec.role`` of the groups vLLM's ``OffloadingConnector`` offloads once
#: ``KVCacheConfig.hisparse_host_num_blocks`` is set (``offloading/config.py:39``,
#: ``get_offloading_group_ids``); no manager is registered for it in vLLM 0.33.
OFFLOADED_GROUP_ROLE = KVCacheGroupRole.HISPARSE_INDEXER


def register_residency_manager(manager_cls: type) -> None:
    """Map ``RESIDENCY_GROUP_ROLE`` and ``OFFLOADED_GROUP_ROLE`` to ``manager_cls``
    (idempotent; one manager class on every full-attention group, see ``managers.py``).

    Inert on its own: only a group whose ``role`` is one of those uses it, and only this
    package sets them (:func:`assign_group_role`, :func:`scope_offloading`).
    vLLM's built-in registrations run lazily on first lookup; we trigger them first so
    that ours never counts as "the registry is already populated".
    """
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register_role_manager(RESIDENCY_GROUP_ROLE, manager_cls)
    KVCacheSpecRegistry.register_role_manager(OFFLOADED_GROUP_ROLE, manager_cls)


def scope_offloading(kv_cache_config: KVCacheConfig, group_ids: tuple[int, ...],
                     host_num_blocks: int) -> None:
    """Make vLLM's ``OffloadingConnector`` offload exactly ``group_ids``.

    Public ``KVCacheConfig`` / ``KVCacheGroupSpec`` fields that vLLM 0.33's other
    connectors key on (reference map §3.5): with ``hisparse_host_num_blocks`` set,
    ``get_offloading_group_ids`` returns the groups whose role is
    ``HISPARSE_INDEXER`` (instead of every prefix-cacheable group), and the offloading
    worker registers those groups layer by layer. The same field makes vLLM's scheduler
    defer a consumer connector's async load into a reused block until in-flight steps
    are processed (``Scheduler.defer_async_loads``). Nothing else in vLLM reads them for
    a config without ``host_resident`` groups.
    """
    for group_id in group_ids:
        kv_cache_config.kv_cache_groups[group_id].role = OFFLOADED_GROUP_ROLE
    kv_cache_config.hisparse_host_num_blocks = int(host_num_blocks)


def offloading_group_ids(kv_cache_config: KVCacheConfig) -> tuple[int, ...]:
    """The groups vLLM's ``OffloadingConnector`` offloads for this config."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        get_offloading_group_ids,
    )

    return tuple(get_offloading_group_ids(kv_cache_config))


def assign_group_role(kv_cache_config: KVCacheConfig, group_ids: tuple[int, ...]) -> None:
    """Mark the sparse-MLA groups of the scheduler's KV cache config for our manager.

    Must run before ``KVCacheManager`` is built. The scheduler-role connector is
    constructed inside ``Scheduler.__init__`` with the very ``kv_cache_config`` object
    that the scheduler passes to ``KVCacheManager`` right after (``scheduler.py``), so
    the connector's constructor is the place. The role field is a public dataclass field
    (``KVCacheGroupSpec.role``); nothing else in the scheduler reads it.
    """
    for group_id in group_ids:
        kv_cache_config.kv_cache_groups[group_id].role = RESIDENCY_GROUP_ROLE  # type: ignore[assignment]
