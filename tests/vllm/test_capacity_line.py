"""vLLM's own startup line, "Maximum concurrency for N tokens per request", with the
connector: the figure comes from the startup capacity report (``patches.CAPACITY_LINE``).

DeepSeek-V3.2 geometry (61 DSA layers, block 64) at max_model_len 32K with 60 GiB of KV
and a 384 GiB host pool, planned by vLLM's real planner and logged by vLLM's own
``update_kv_cache_capacity`` on the scheduler's config, as the engine core does.
"""

from __future__ import annotations

import logging

import pytest
from vllm.v1.core.kv_cache_utils import update_kv_cache_capacity

from tests.vllm.scheduler_harness import planned_kv_cache_config
from vllm_hisparse.vllm.simulation.model import (
    deepseek_v32_specs,
    kv_transfer_config,
    make_vllm_config,
)
from vllm_hisparse.core.capacity import HostMemoryLimit
from vllm_hisparse.vllm.setup import config as config_module
from vllm_hisparse.vllm import patches
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.setup.capacity_report import engine_capacity_report

GIB = 1 << 30
BYTES_PER_BLOCK = 545_792  # the 5 + 1 split of DeepSeek-V3.2 (docs/vllm-integration.md)


@pytest.fixture(autouse=True)
def _large_host(monkeypatch):
    monkeypatch.setattr(config_module, "host_memory_limit", lambda: HostMemoryLimit(1 << 42, None, None))


def _planned(model_dir, kv_transfer):
    vllm_config = make_vllm_config(model_dir, kv_transfer=kv_transfer, max_model_len=32768)
    num_blocks = 60 * GIB // BYTES_PER_BLOCK
    return vllm_config, planned_kv_cache_config(vllm_config, deepseek_v32_specs(), num_blocks)


def test_vllms_line_reports_the_steady_state_figure(dsa_model_dir, caplog):
    assert patches.CAPACITY_LINE.installed()  # by the plugin (conftest calls register())
    vllm_config, kv_cache_config = _planned(dsa_model_dir, kv_transfer_config({"host_pool_gib": 384}))
    report = engine_capacity_report(vllm_config, kv_cache_config, resolve_config(vllm_config))
    with caplog.at_level(logging.INFO):
        update_kv_cache_capacity(vllm_config, kv_cache_config)
    assert vllm_config.cache_config.kv_cache_max_concurrency == report.max_concurrency_steady
    assert vllm_config.cache_config.kv_cache_size_tokens == report.max_concurrency_steady * 32768
    # What vLLM computes for the same plan without us: every page of 6 groups on the device.
    patches.CAPACITY_LINE.remove()
    try:
        update_kv_cache_capacity(vllm_config, kv_cache_config)
        full = vllm_config.cache_config.kv_cache_max_concurrency
    finally:
        from vllm_hisparse.vllm.plugin import _max_concurrency

        patches.CAPACITY_LINE.install(_max_concurrency)
    assert int(full) == report.max_concurrency_without_residency == 38
    assert report.max_concurrency_steady > 3 * full
    assert "hybrid residency in steady state" in caplog.text


def test_other_configs_keep_vllms_figure(dsa_model_dir):
    unconfigured = make_vllm_config(dsa_model_dir, max_model_len=32768)
    _, kv_cache_config = _planned(dsa_model_dir, kv_transfer_config({"host_pool_gib": 384}))
    update_kv_cache_capacity(unconfigured, kv_cache_config)
    assert int(unconfigured.cache_config.kv_cache_max_concurrency) == 38


def test_scheduler_and_workers_size_the_same_host_pool(dsa_model_dir):
    """The scheduler's plan keeps one layer's spec per group (``generate_scheduler_kv_cache_config``);
    the host page still counts every layer, so the scheduler's host pool is the workers'."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from vllm_hisparse.vllm.setup.kv_plan import host_page_bytes

    vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 384}),
                                   max_model_len=32768)
    specs = deepseek_v32_specs()
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    (worker,) = get_kv_cache_configs(vllm_config, [specs], [60 * GIB], groups)
    scheduler = generate_scheduler_kv_cache_config([worker])
    assert host_page_bytes(scheduler) == host_page_bytes(worker) == (61 * 41_984, 61 * 8_448)
