"""Which KV cache groups get ``ResidencyAwareManager`` (one manager class for every
full-attention group keeps vLLM's per-group call sites monomorphic; see managers.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.scheduler_side.managers import ResidencyAwareManager, residency_manager_group_ids
from vllm_hisparse.vllm.simulation.model import indexer_spec, kv_transfer_config, sparse_mla_spec


def _config(*groups):
    """A stand-in KVCacheConfig: ``groups`` are ``(spec, role)`` pairs."""
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, role=r) for s, r in groups])


def _sliding_window_spec():
    return compat.SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                                       sliding_window=128)


def test_full_attention_groups_join_the_sparse_groups():
    config = _config((sparse_mla_spec(), "default"), (sparse_mla_spec(leader=False), "default"),
                     (indexer_spec(), "default"))
    assert residency_manager_group_ids(config, (0, 1)) == (0, 1, 2)


def test_groups_with_another_manager_are_left_alone():
    config = _config((_sliding_window_spec(), "default"), (sparse_mla_spec(), "default"),
                     (indexer_spec(), "hisparse_indexer"), (indexer_spec(), "default"))
    # Group 0: vLLM picks another manager; group 2: a role of its own (vLLM's in-tree
    # HiSparse), whatever its manager.
    registry = compat.KVCacheSpecRegistry
    assert registry.get_manager_class(_sliding_window_spec(), "default") is not compat.FullAttentionManager
    assert residency_manager_group_ids(config, (1,)) == (1, 3)


def test_default_role_is_vllms():
    from vllm.v1.kv_cache_interface import KVCacheGroupRole

    config = _config((indexer_spec(), KVCacheGroupRole.DEFAULT), (indexer_spec(), KVCacheGroupRole.HISPARSE_INDEXER))
    assert residency_manager_group_ids(config, ()) == (0,)


def test_sparse_group_ids_out_of_range():
    config = _config((sparse_mla_spec(), "default"))
    with pytest.raises(ValueError, match=r"sparse group ids \[3\] out of range for 1 KV cache groups"):
        residency_manager_group_ids(config, (0, 3))


def test_real_scheduler_builds_one_manager_class(dsa_model_dir):
    """With our connector every group of the DSA plan (4 sparse + 1 indexer) is a
    ResidencyAwareManager; only the sparse ones are bound, and the indexer group frees
    its blocks exactly as FullAttentionManager does."""
    harness = SchedulerHarness.build(
        dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
        num_blocks=400, max_model_len=2048,
    )
    managers = harness.scheduler.kv_cache_manager.coordinator.single_type_managers
    assert [type(m) for m in managers] == [ResidencyAwareManager] * 5
    assert [m.residency_bound for m in managers] == [True, True, True, True, False]
    harness.add_requests(3, prompt_len=300, max_tokens=20)
    harness.run_to_completion()
    harness.assert_no_leaks()
