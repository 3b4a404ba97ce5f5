"""``MultiConnector[HiSparseResidencyConnector, OffloadingConnector]``: what each tier holds.

vLLM's ``OffloadingConnector`` copies finished pages of every prefix-cacheable KV cache
group to its CPU store, unless ``KVCacheConfig.hisparse_host_num_blocks`` is set; then it
offloads only the groups whose role is ``HISPARSE_INDEXER`` (``offloading/config.py``).
Left alone it would keep a second host copy of every sparse-MLA page, which our host pool
already holds. So when the kv_transfer_config composes the two, the planner sets those
public fields (``compat.scope_offloading``) on every plan it makes, in the engine core,
before any connector is built; the workers and the scheduler get the same plan, and the
connector reads the scope from it (:func:`is_scoped`):

* **our host pool**: every sparse-MLA page plus its indexer page, one host block each,
  restored together by one RESTORE for our host-prefix hits (vLLM lets exactly one
  connector load a request, so a hit must not depend on another connector's load);
* **OffloadingConnector's CPU store**: the non-sparse groups only (the indexer groups and
  any draft/MTP group). It serves a prefix whose sparse-MLA pages are still cached on the
  device while those groups' pages were evicted: it restores only that suffix, up to the
  sparse groups' own device hit (vLLM bounds its loads by the groups it does not offload,
  and our managers keep those cached blocks for the request, ``managers.py``). When its
  store lacks the pages, vLLM falls back to the prefix every group holds.

``hisparse_host_num_blocks`` is our host pool's block count: the field's meaning in
vLLM ("capacity of the dedicated host-block pool"). It also turns on vLLM's
``defer_async_loads`` under async scheduling for a consumer connector, which our admission
handles (an offered host prefix stays leased until vLLM allocates for it).
"""

from __future__ import annotations

import logging

from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.setup.config import (
    CONNECTOR_NAME,
    HiSparseConfigError,
    HiSparseResidencyConfig,
)
from vllm_hisparse.vllm.setup.connector_entries import connector_entries
from vllm_hisparse.vllm.setup.kv_plan import planned_host_blocks, sparse_group_ids

logger = logging.getLogger(__name__)

#: The ``kv_connector`` name of vLLM's CPU offloading connector.
OFFLOADING_CONNECTOR = "OffloadingConnector"


def connector_names(vllm_config: compat.VllmConfig) -> list[str]:
    """Every ``kv_connector`` of the engine's kv_transfer_config, MultiConnector children
    included (any depth); the shape was checked by ``config`` already."""
    kv = vllm_config.kv_transfer_config
    if kv is None:
        return []
    return [entry.name for entry in connector_entries(kv.kv_connector, kv.kv_connector_extra_config)]


def offloading_composed(vllm_config: compat.VllmConfig) -> bool:
    """Whether OffloadingConnector runs next to our connector."""
    return OFFLOADING_CONNECTOR in connector_names(vllm_config)


def offloaded_group_ids(kv_cache_config: compat.KVCacheConfig) -> tuple[int, ...]:
    """The groups OffloadingConnector should offload: every group but the sparse-MLA ones
    (indexer groups, draft/MTP groups). A group it does not offload bounds its loads and
    must keep its cached blocks for them, which only the sparse groups' manager does."""
    sparse = set(sparse_group_ids(kv_cache_config))
    return tuple(g for g in range(len(kv_cache_config.kv_cache_groups)) if g not in sparse)


def scope_planned_config(vllm_config: compat.VllmConfig, kv_cache_config: compat.KVCacheConfig,
                         config: HiSparseResidencyConfig) -> None:
    """The planner's part: scope OffloadingConnector to :func:`offloaded_group_ids` and
    publish our host pool's size, when the two are composed (no-op otherwise)."""
    if not offloading_composed(vllm_config):
        return
    # No fit check: vLLM also places probes here before auto-fit shortens max_model_len;
    # both roles check the fit at construction.
    host_blocks = planned_host_blocks(vllm_config, kv_cache_config, config, check_one_request=False)
    compat.scope_offloading(kv_cache_config, offloaded_group_ids(kv_cache_config), host_blocks)


def is_scoped(kv_cache_config: compat.KVCacheConfig) -> bool:
    """Whether the plan scopes OffloadingConnector (our planner set it: composed).

    Read from the plan, not the kv_transfer_config: vLLM hands each MultiConnector child a
    copy of the config whose kv_transfer_config is that child's own entry."""
    return kv_cache_config.hisparse_host_num_blocks is not None


def check_offloading_scope(kv_cache_config: compat.KVCacheConfig) -> None:
    """At connector construction, in both roles: a scoped plan makes vLLM's
    OffloadingConnector offload exactly the non-sparse groups (vLLM reads the fields the way
    this package sets them; else a sparse-MLA page would be copied twice, or a load the
    sparse groups do not bound would leave sparse blocks unwritten)."""
    if not is_scoped(kv_cache_config):
        return
    want = offloaded_group_ids(kv_cache_config)
    got = compat.offloading_group_ids(kv_cache_config)
    if got != want:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: OffloadingConnector would offload KV cache groups {list(got)}, "
            f"not {list(want)} (every group but the sparse-MLA ones): vLLM no longer reads "
            "hisparse_host_num_blocks and the HISPARSE_INDEXER group role as this package sets "
            "them; accepted: vLLM 0.33.x")


def describe_scope(kv_cache_config: compat.KVCacheConfig) -> str:
    """One log line: which groups go where."""
    groups = compat.offloading_group_ids(kv_cache_config)
    return (f"{CONNECTOR_NAME}: composed with {OFFLOADING_CONNECTOR}: it offloads KV cache "
            f"groups {list(groups)} (indexer/draft) only; sparse-MLA pages live in our host pool "
            f"({kv_cache_config.hisparse_host_num_blocks:,} host blocks)")
