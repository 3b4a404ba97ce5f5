"""The planning split, run through vLLM 0.33's real planner entry points.

``get_global_kv_cache_groups`` and ``get_kv_cache_configs`` are what the engine core
calls; they resolve the builder through the platform, i.e. through our hook.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from vllm.v1.core.kv_cache_planning import (
    DefaultKVCacheConfigBuilder,
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import SparseCacheRole, UniformTypeKVCacheSpecs

from vllm_hisparse.vllm.simulation.model import (
    deepseek_v32_specs,
    dsa_layer_specs,
    glm_index_share_specs,
    indexer_name,
    indexer_spec,
    kv_transfer_config,
    make_vllm_config,
    mla_name,
    sparse_mla_spec,
)
from vllm_hisparse.core.capacity import (
    DEEPSEEK_V32_FP8,
    EngineLayout,
    HostMemoryLimit,
    concurrency_report,
    layout_for_geometry,
)
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.setup import config as config_module
from vllm_hisparse.vllm.setup.config import HiSparseConfigError
from vllm_hisparse.vllm.setup.engine_checks import resolve_config
from vllm_hisparse.vllm.setup.capacity_report import engine_capacity_report, format_capacity_table
from vllm_hisparse.vllm.setup.kv_plan import host_page_bytes, planned_host_blocks, sparse_group_ids
from vllm_hisparse.vllm.setup.kv_planner import (
    HiSparseKVCacheConfigBuilder,
    classify_layers,
    index_units,
    split_kv_cache_groups,
)

MLA_PAGE = 64 * 656  # 41,984 B
INDEXER_PAGE = 64 * 132  # 8,448 B


@pytest.fixture(scope="module", autouse=True)
def _large_host():
    """The 64 GiB host pools below must pass the RAM check on any test machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config_module, "host_memory_limit",
                      lambda: HostMemoryLimit(1 << 42, None, None))
        yield


@pytest.fixture(scope="module")
def configured(dsa_model_dir):
    return make_vllm_config(
        dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 64}), max_model_len=8192
    )


@pytest.fixture(scope="module")
def unconfigured(dsa_model_dir):
    return make_vllm_config(dsa_model_dir, max_model_len=8192)


def plan(vllm_config, specs, num_blocks=4000):
    """Group and place exactly as the engine core does."""
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    bytes_per_block = max(
        sum(s.page_size_bytes for s in g.kv_cache_spec.kv_cache_specs.values()) for g in groups
    )
    (config,) = get_kv_cache_configs(
        vllm_config, [specs], [num_blocks * bytes_per_block], groups
    )
    return config


def group_layers(config):
    return [g.layer_names for g in config.kv_cache_groups]


def assert_equal_bytes_per_block(config, bytes_per_block):
    tensors = config.kv_cache_tensors
    assert {t.size for t in tensors} == {bytes_per_block * config.num_blocks}
    assert {t.block_stride for t in tensors} == {bytes_per_block}
    for group in config.kv_cache_groups:
        assert group.kv_cache_spec.page_size_bytes <= bytes_per_block


def test_default_planner_merges_mla_and_indexer(unconfigured):
    """The measured fact behind the split: one group, one block id for both."""
    assert isinstance(compat.resolve_kv_cache_config_builder(unconfigured), DefaultKVCacheConfigBuilder)
    assert type(compat.resolve_kv_cache_config_builder(unconfigured)) is DefaultKVCacheConfigBuilder
    config = plan(unconfigured, deepseek_v32_specs())
    assert len(config.kv_cache_groups) == 1
    roles = {s.cache_role for s in config.kv_cache_groups[0].kv_cache_spec.kv_cache_specs.values()}
    assert roles == {SparseCacheRole.SPARSE, SparseCacheRole.INDEXER}


def test_deepseek_v32_split(configured):
    assert isinstance(compat.resolve_kv_cache_config_builder(configured), HiSparseKVCacheConfigBuilder)
    specs = deepseek_v32_specs()
    config = plan(configured, specs)
    layers = group_layers(config)
    # 5 sparse-MLA groups (13/13/13/13/9 layers) + 1 indexer group of all 61.
    assert [len(names) for names in layers] == [13, 13, 13, 13, 9, 61]
    assert layers[0][:2] == [mla_name(0), mla_name(1)] and layers[4][-1] == mla_name(60)
    assert layers[5] == [indexer_name(i) for i in range(61)]
    assert sorted(n for names in layers for n in names) == sorted(specs)
    assert sparse_group_ids(config) == (0, 1, 2, 3, 4)
    # Equal bytes per block: the widest group (13 x 41,984 B) sets it.
    assert_equal_bytes_per_block(config, 13 * MLA_PAGE)
    assert 13 * MLA_PAGE == 545_792
    assert config.kv_cache_groups[5].kv_cache_spec.page_size_bytes == 61 * INDEXER_PAGE == 515_328


def test_glm_index_share_split(configured):
    specs = glm_index_share_specs()
    classes = classify_layers(specs)
    units = index_units(classes.sparse)
    assert len(units) == 26 and all(len(unit) == 3 for unit in units)
    config = plan(configured, specs)
    layers = group_layers(config)
    # 7 sparse groups of 4,4,4,4,4,4,2 units (12 or 6 layers) + 1 indexer group.
    assert [len(names) for names in layers] == [12] * 6 + [6, 26]
    group_of = {name: i for i, names in enumerate(layers) for name in names}
    for leader in range(0, 78, 3):  # followers live in their leader's group
        assert group_of[mla_name(leader)] == group_of[mla_name(leader + 1)] == group_of[mla_name(leader + 2)]
    first = config.kv_cache_groups[0].kv_cache_spec
    assert isinstance(first, UniformTypeKVCacheSpecs)
    leader_flags = [s.is_index_group_leader for s in first.kv_cache_specs.values()]
    assert leader_flags == [True, False, False] * 4
    assert_equal_bytes_per_block(config, 12 * MLA_PAGE)


def test_other_layers_keep_vllm_grouping(configured):
    specs = dsa_layer_specs(4)
    # An MTP layer reports its spec with is_draft=True.
    specs["model.layers.4.self_attn.attn"] = replace(sparse_mla_spec(), is_draft=True)
    split = split_kv_cache_groups(configured, specs)
    # Four 41,984 B sparse pages + 33,792 B of indexer: 4 + 1 groups at 41,984 B.
    assert split.sparse_group_ids == (0, 1, 2, 3) and split.indexer_group_ids == (4,)
    assert split.choice.bytes_per_block == MLA_PAGE
    assert split.groups[5].layer_names == ["model.layers.4.self_attn.attn"]


def test_follower_without_leader_is_an_error():
    specs = dsa_layer_specs(3, leaders={1})
    with pytest.raises(HiSparseConfigError, match="no index leader precedes it"):
        index_units(classify_layers(specs).sparse)


def test_model_without_indexer_is_an_error():
    with pytest.raises(HiSparseConfigError, match="found 2 sparse-MLA and 0 indexer"):
        classify_layers({mla_name(0): sparse_mla_spec(), mla_name(1): sparse_mla_spec()})


def test_mixed_block_sizes_are_an_error(configured):
    specs = {mla_name(0): sparse_mla_spec(64), indexer_name(0): indexer_spec(128)}
    with pytest.raises(HiSparseConfigError, match=r"block sizes \[64, 128\]"):
        split_kv_cache_groups(configured, specs)


def test_layer_outermost_layout_is_an_error(dsa_model_dir):
    vllm_config = make_vllm_config(
        dsa_model_dir, kv_transfer=kv_transfer_config(), kv_cache_layout="LBHNC"
    )
    with pytest.raises(HiSparseConfigError, match="LBHNC.*accepted: BLHNC"):
        HiSparseKVCacheConfigBuilder().get_kv_cache_groups(vllm_config, dsa_layer_specs(2))


def test_host_pool_checked_at_planning(dsa_model_dir):
    vllm_config = make_vllm_config(
        dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}), max_model_len=32768
    )
    with pytest.raises(HiSparseConfigError, match="fewer than one max_model_len=32768 request"):
        get_global_kv_cache_groups(vllm_config, [deepseek_v32_specs()])


def test_unsplit_config_is_detected(unconfigured):
    with pytest.raises(HiSparseConfigError, match="planner hook did not run"):
        sparse_group_ids(plan(unconfigured, deepseek_v32_specs()))


# ---------------------------------------------------------------- startup table


def test_capacity_arithmetic():
    report = concurrency_report(EngineLayout(
        device_blocks=10_001, bytes_per_block=545_792, num_sparse_groups=5,
        num_indexer_groups=1, num_other_groups=0, host_blocks=2_000, host_block_bytes=2_561_024,
        host_copies=2, block_size=64, hot_blocks_per_request=64,
        admission_window_tokens=64 * 8), context_tokens=64 * 100)
    # 100 pages per request. No residency: 6 groups x 100 = 600 blocks per request.
    assert report.max_concurrency_without_residency == 10_000 // 600 == 16
    # Admission: indexer 100 + 5 x min(8 + 64, 100) = 460 blocks; host 2000 // 100 = 20.
    assert report.max_concurrency_at_admission == min(10_000 // 460, 20) == 20
    # Steady: 100 + 5 x (64 + 2) = 430 blocks -> 23, capped by the host pool at 20.
    assert report.max_concurrency_steady_device == 10_000 // 430 == 23
    assert report.max_concurrency_host == 20 == report.max_concurrency_steady
    assert report.logical_host_gib == pytest.approx(2_000 * 2_561_024 / 2**30)
    assert report.physical_host_gib == pytest.approx(2 * report.logical_host_gib)
    table = format_capacity_table(report)
    for fragment in ("device blocks", "10,001", "545,792 B", "5 sparse-MLA + 1 indexer",
                     "2,000 x 2,561,024 B", "4.77 GiB", "9.54 GiB (2 pinned copies)",
                     "no residency", "admission", "steady state",
                     "hot rows per request", "4,096 per sparse-MLA layer"):
        assert fragment in table
    assert report.hot_rows_per_request == 64 * 64


def test_plan_and_the_startup_table_agree_to_the_request(dsa_model_dir, monkeypatch):
    """DeepSeek-V3.2, 60 GiB of KV, 384 GiB of host, vllm serve's 8192-token window: the
    engine vLLM plans (our builder, 60 GiB of available memory) and ``vllm-hisparse plan``'s
    layout give the same report, at 32K and 128K. Before: plan 148 / 146 (steady /
    admission) against the startup table's 140 / 80 at 32K (no group padding, no window,
    no indexer pages in the host block)."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # the tiny config says 64K
    for context, expected in ((32768, (38, 140, 80)), (131072, (9, 49, 39))):
        vllm_config = make_vllm_config(
            dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 384}),
            max_model_len=context, max_num_batched_tokens=8192, max_num_seqs=256)
        specs = deepseek_v32_specs()
        groups = get_global_kv_cache_groups(vllm_config, [specs])
        (full,) = get_kv_cache_configs(vllm_config, [specs], [60 << 30], groups)
        engine = engine_capacity_report(vllm_config, full, resolve_config(vllm_config))
        planned = concurrency_report(layout_for_geometry(
            DEEPSEEK_V32_FP8, device_kv_bytes=60 << 30, host_pool_bytes=384 << 30,
            device_buffer_size_rows=4096, admission_window_tokens=8192), context)
        assert engine == planned
        assert (engine.max_concurrency_without_residency, engine.max_concurrency_steady,
                engine.max_concurrency_at_admission) == expected


def test_engine_capacity_report(configured):
    config = plan(configured, deepseek_v32_specs(), num_blocks=20_000)
    report = engine_capacity_report(configured, config, resolve_config(configured))
    assert (report.device_blocks, report.bytes_per_block) == (20_000, 545_792)
    assert (report.num_sparse_groups, report.num_indexer_groups) == (5, 1)
    # A host block holds a page of every sparse-MLA layer and of every indexer layer.
    assert report.host_block_bytes == 61 * (MLA_PAGE + INDEXER_PAGE) == 3_076_352
    assert host_page_bytes(config) == (61 * MLA_PAGE, 61 * INDEXER_PAGE)
    assert report.host_blocks == (64 << 30) // 3_076_352
    # 128 pages per 8192-token request; 6 groups -> 768 blocks without residency.
    assert report.max_concurrency_without_residency == 19_999 // 768
    assert report.max_concurrency_steady > report.max_concurrency_without_residency


def test_planned_host_blocks_is_the_reports_count_and_checks_the_fit(configured):
    """The one count the capacity report, the worker role and the OffloadingConnector scope
    use; without ``check_one_request`` (vLLM's probe placements) a pool too small for one
    ``max_model_len`` request is counted, not refused."""
    config = plan(configured, deepseek_v32_specs(), num_blocks=20_000)
    resolved = resolve_config(configured)
    assert planned_host_blocks(configured, config, resolved) == (64 << 30) // 3_076_352 \
        == engine_capacity_report(configured, config, resolved).host_blocks
    small = replace(resolved, host_pool_gib=3_076_352 * 100 / (1 << 30))  # 100 blocks < 128 pages
    assert planned_host_blocks(configured, config, small, check_one_request=False) == 100
    with pytest.raises(HiSparseConfigError, match="buys 100 host blocks, fewer than one"):
        planned_host_blocks(configured, config, small)


def test_the_scheduler_sees_the_host_block_the_workers_allocate(configured):
    """The engine hands the scheduler each group collapsed to its first layer's spec
    (``generate_scheduler_kv_cache_config``). Reading a page per group from that sized
    the scheduler's host pool 14x too large for DeepSeek-V3.2 (5 groups of 13 layers read
    as 13 times fewer bytes per block): the workers then failed every transfer into a host
    block past their pool. Both forms give the same host block and the same report."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    for specs in (deepseek_v32_specs(), glm_index_share_specs()):
        full = plan(configured, specs, num_blocks=20_000)
        scheduler = generate_scheduler_kv_cache_config([full])
        assert host_page_bytes(scheduler) == host_page_bytes(full)
        config = resolve_config(configured)
        assert engine_capacity_report(configured, scheduler, config) == \
            engine_capacity_report(configured, full, config)
    assert sum(host_page_bytes(scheduler)) == 78 * MLA_PAGE + 26 * INDEXER_PAGE
