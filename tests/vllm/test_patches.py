"""Every runtime patch of ``vllm_hisparse.vllm.patches`` still applies to the installed vLLM:
it installs (once), is seen installed, is reached through vLLM's own entry point, and its
removal puts vLLM's original object back."""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import pytest
import torch

from vllm_hisparse.vllm import compat, patches

SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"


@pytest.fixture(autouse=True)
def _no_global_patch_left_installed():
    """Other tests' worker roles install the global conversion patches and, as in
    production, never remove them: each test here starts from vLLM's own objects."""
    for patch in (patches.DIRECT_CONVERSION_ROUTING, patches.CPU_DIRECT_CONVERSION,
                  patches.TOPK_CONVERSION_HOOK):
        patch.remove()
    yield


def _sites() -> list:
    return [importlib.import_module(m) for m in compat.DIRECT_CONVERSION_SITES]


def _cpu_group(num_tokens: int = 8, k: int = 4):
    """A real ``SparseMLAIndexGroup`` on CPU (no streams: its conversion cannot run as is)."""
    buf = torch.zeros((num_tokens, k), dtype=torch.int32)
    return compat.sparse_mla_index_group_class()(
        logical_topk_indices=buf, physical_topk_indices=torch.zeros_like(buf),
        valid_topk_counts=torch.zeros(num_tokens, dtype=torch.int32), side_stream=None,
        logical_topk_ready=None, physical_topk_ready=None, has_indexer=False)


def _metadata(block_table, block_size=4):
    return SimpleNamespace(req_id_per_token=torch.zeros(8, dtype=torch.int32),
                           block_table=torch.as_tensor(block_table, dtype=torch.int32),
                           block_size=block_size, num_actual_tokens=1)


def test_the_table_names_every_patch_once():
    names = [p.name for p in patches.PATCHES]
    assert names == ["planner_hook", "topk_conversion_hook", "direct_conversion_routing",
                     "layer_forward_context", "indexer_scores", "cpu_direct_conversion", "cpu_group_conversion",
                     "config_check", "capacity_line", "lockstep_coordinator"]
    for patch in patches.PATCHES:
        assert patch.target and patch.why and patch.installed_by and patch.install_args
        assert patches.by_name(patch.name) is patch
    with pytest.raises(KeyError, match="no vLLM patch named 'nope'; known: "):
        patches.by_name("nope")


def test_nothing_else_patches_vllm():
    """No module of the package outside the ``patches`` package assigns one of the
    attributes the table patches (a static check)."""
    from pathlib import Path

    package = Path(patches.__file__).parents[2]
    for path in package.rglob("*.py"):
        if path.parent.name == "patches":
            continue
        text = path.read_text()
        for needle in ("Platform.get_kv_cache_config_builder_cls =",
                       ".convert_logical_to_physical_topk =", "._convert_once =",
                       ".forward_mqa =", "triton_convert_req_index_to_global_index =",
                       "coordinator.__class__ =", "SparseIndexerTopk.forward =",
                       "cls.forward ="):
            assert needle not in text, (path, needle)


def test_planner_hook():
    from vllm.platforms import current_platform

    from vllm_hisparse.vllm.setup.kv_planner import select_builder

    was_installed = patches.PLANNER_HOOK.installed()
    patches.PLANNER_HOOK.remove()
    original = compat.Platform.__dict__["get_kv_cache_config_builder_cls"].__func__
    ours = object()
    try:
        assert patches.PLANNER_HOOK.install(lambda cfg: "ours.Builder" if cfg is ours else None)
        assert not patches.PLANNER_HOOK.install(select_builder)
        assert patches.PLANNER_HOOK.installed()
        # Reached through the platform object vLLM resolves the builder with.
        assert current_platform.get_kv_cache_config_builder_cls(ours) == "ours.Builder"
        assert current_platform.get_kv_cache_config_builder_cls(None) == \
            compat.DEFAULT_BUILDER_QUALNAME
        assert patches.PLANNER_HOOK.remove()
        assert not patches.PLANNER_HOOK.installed() and not patches.PLANNER_HOOK.remove()
        assert compat.Platform.__dict__["get_kv_cache_config_builder_cls"].__func__ is original
    finally:
        patches.PLANNER_HOOK.remove()
        if was_installed:
            assert patches.PLANNER_HOOK.install(select_builder)


def test_topk_conversion_hook():
    cls = compat.sparse_mla_index_group_class()
    original = cls.__dict__["convert_logical_to_physical_topk"]
    seen = []

    def body(group, vllm_method, layer_index, topk, md, *, block_stride_rows,
             return_valid_counts):
        seen.append((group, layer_index))
        return vllm_method(layer_index, topk, md, block_stride_rows=block_stride_rows,
                           return_valid_counts=return_valid_counts)

    group = _cpu_group()
    patches.CPU_GROUP_CONVERSION.install(group, lambda *a, **k: "vLLM's method ran")
    assert not patches.TOPK_CONVERSION_HOOK.installed()
    try:
        assert patches.TOPK_CONVERSION_HOOK.install(body)
        assert not patches.TOPK_CONVERSION_HOOK.install(body)
        assert patches.TOPK_CONVERSION_HOOK.installed()
        got = group.convert_logical_to_physical_topk(
            0, torch.zeros((1, 4), dtype=torch.int32), _metadata([[1]]), block_stride_rows=None,
            return_valid_counts=False)
        assert got == "vLLM's method ran" and seen == [(group, 0)]
        # vLLM's in-tree HiSparse group overrides the method: the wrapper never sees it.
        assert "convert_logical_to_physical_topk" in \
            compat.in_tree_hisparse_index_group_class().__dict__
    finally:
        assert patches.TOPK_CONVERSION_HOOK.remove()
    assert not patches.TOPK_CONVERSION_HOOK.installed()
    assert not patches.TOPK_CONVERSION_HOOK.remove()
    assert cls.__dict__["convert_logical_to_physical_topk"] is original


def test_indexer_scores():
    from vllm.model_executor.layers.indexer_topk import get_indexer_topk

    cls = compat.indexer_topk_class()
    original = cls.__dict__["forward"]
    seen = []

    def body(vllm_method, logits, seq_lens, next_n, topk, topk_tokens, max_seq_len):
        seen.append(logits.shape)
        return vllm_method(logits, seq_lens, next_n, topk, topk_tokens, max_seq_len)

    patches.INDEXER_SCORES.remove()
    assert not patches.INDEXER_SCORES.installed()
    try:
        assert patches.INDEXER_SCORES.install(body)
        assert not patches.INDEXER_SCORES.install(body)
        assert patches.INDEXER_SCORES.installed()
        logits = torch.arange(12, dtype=torch.float32).view(2, 6)
        topk = torch.full((2, 2), -1, dtype=torch.int32)
        # through vLLM's own dispatcher, as sparse_attn_indexer calls it
        get_indexer_topk("torch")(logits, torch.tensor([[6], [3]], dtype=torch.int32), 1, topk,
                                  2, 6)
        assert seen == [(2, 6)]
        assert sorted(topk[0].tolist()) == [4, 5] and sorted(topk[1].tolist()) == [1, 2]
    finally:
        assert patches.INDEXER_SCORES.remove()
    assert not patches.INDEXER_SCORES.installed()
    assert cls.__dict__["forward"] is original


def test_direct_conversion_routing():
    seen = []

    def body(context, vllm_function, *args, **kwargs):
        seen.append(context)
        return "routed"

    real = compat.direct_conversion_function()
    assert not patches.DIRECT_CONVERSION_ROUTING.installed()
    try:
        assert patches.DIRECT_CONVERSION_ROUTING.install(body)
        assert not patches.DIRECT_CONVERSION_ROUTING.install(body)
        assert patches.DIRECT_CONVERSION_ROUTING.installed()
        for module in _sites():  # the name every listed backend method calls
            site = getattr(module, compat.DIRECT_CONVERSION_NAME)
            assert inspect.signature(site) == inspect.signature(real)
            assert patches.current_sparse_layer() is None
            with patches.sparse_layer_context("group", 2, "md"):
                assert patches.current_sparse_layer() == ("group", 2, "md")
                assert site() == "routed"
        assert seen == [("group", 2, "md")] * len(_sites())
        assert patches.current_sparse_layer() is None
        # index_group.py's own import (the group method's) is not ours.
        from vllm.v1.attention.backends.mla import index_group

        assert getattr(index_group, compat.DIRECT_CONVERSION_NAME) is real
    finally:
        assert patches.DIRECT_CONVERSION_ROUTING.remove()
    assert not patches.DIRECT_CONVERSION_ROUTING.installed()
    assert not patches.DIRECT_CONVERSION_ROUTING.remove()
    for module in _sites():
        assert getattr(module, compat.DIRECT_CONVERSION_NAME) is real


def test_direct_conversion_routing_outside_a_layer_calls_vllm():
    calls = []
    patches.CPU_DIRECT_CONVERSION.install(lambda *a, **k: calls.append("vLLM") or "vLLM")
    try:
        assert patches.DIRECT_CONVERSION_ROUTING.install(lambda *a, **k: "routed")
        site = getattr(_sites()[0], compat.DIRECT_CONVERSION_NAME)
        assert site() == "vLLM" and calls == ["vLLM"]
    finally:
        patches.DIRECT_CONVERSION_ROUTING.remove()
        patches.CPU_DIRECT_CONVERSION.remove()


def test_layer_forward_context():
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl

    # MLAAttention reaches the backend through the instance attribute we wrap, with the
    # four arguments the wrapper passes on.
    assert "self.impl.forward_mqa(" in inspect.getsource(MLAAttention.forward_impl)
    assert list(inspect.signature(SparseMLACommonImpl.forward_mqa).parameters) == [
        "self", "q", "kv_c_and_k_pe_cache", "attn_metadata", "layer"]

    class Impl:
        index_group, index_group_index = "g", 1

        def forward_mqa(self, q, kv, md, layer):
            return patches.current_sparse_layer()

    impl = Impl()
    assert not patches.LAYER_FORWARD_CONTEXT.installed(impl)
    assert patches.LAYER_FORWARD_CONTEXT.install(impl)
    assert not patches.LAYER_FORWARD_CONTEXT.install(impl)
    assert patches.LAYER_FORWARD_CONTEXT.installed(impl)
    assert impl.forward_mqa(None, None, "md", None) == ("g", 1, "md")
    assert patches.current_sparse_layer() is None
    assert patches.LAYER_FORWARD_CONTEXT.remove(impl)
    assert not patches.LAYER_FORWARD_CONTEXT.remove(impl)
    assert "forward_mqa" not in impl.__dict__ and impl.forward_mqa.__func__ is Impl.forward_mqa
    # An instance attribute that was there before comes back.
    own = SimpleNamespace(index_group="g", index_group_index=0)
    own.forward_mqa = first = lambda q, kv, md, layer: patches.current_sparse_layer()
    assert patches.LAYER_FORWARD_CONTEXT.install(own)
    assert own.forward_mqa(None, None, "md", None) == ("g", 0, "md")
    assert patches.LAYER_FORWARD_CONTEXT.remove(own) and own.forward_mqa is first


def test_cpu_direct_conversion():
    from vllm_hisparse.vllm.simulation.synthetic_attention import cpu_direct_conversion

    modules = [importlib.import_module(SPARSE_UTILS), *_sites()]
    originals = [getattr(m, compat.DIRECT_CONVERSION_NAME) for m in modules]
    assert not patches.CPU_DIRECT_CONVERSION.installed()
    try:
        assert patches.CPU_DIRECT_CONVERSION.install(cpu_direct_conversion)
        assert not patches.CPU_DIRECT_CONVERSION.install(cpu_direct_conversion)
        assert patches.CPU_DIRECT_CONVERSION.installed()
        # vLLM's signature, and the twin answers at every site: page 1 of row 0 -> block 5.
        for module in modules:
            site = getattr(module, compat.DIRECT_CONVERSION_NAME)
            assert list(inspect.signature(site).parameters) == \
                list(inspect.signature(originals[0]).parameters)
            rows = site(torch.zeros(1, dtype=torch.int32),
                        torch.tensor([[3, 5]], dtype=torch.int32),
                        torch.tensor([[5, -1]], dtype=torch.int32), BLOCK_SIZE=4)
            assert rows.tolist() == [[21, -1]]
        # The routing wraps the twin, so it must come off first.
        assert patches.DIRECT_CONVERSION_ROUTING.install(lambda *a, **k: None)
        with pytest.raises(RuntimeError, match="'direct_conversion_routing' wraps"):
            patches.CPU_DIRECT_CONVERSION.remove()
        assert patches.DIRECT_CONVERSION_ROUTING.remove()
    finally:
        assert patches.CPU_DIRECT_CONVERSION.remove()
    assert not patches.CPU_DIRECT_CONVERSION.installed()
    assert not patches.CPU_DIRECT_CONVERSION.remove()
    for module, original in zip(modules, originals):
        assert getattr(module, compat.DIRECT_CONVERSION_NAME) is original


def test_cpu_direct_conversion_refuses_to_go_under_the_routing():
    assert patches.DIRECT_CONVERSION_ROUTING.install(lambda *a, **k: None)
    try:
        with pytest.raises(RuntimeError, match="must be installed before"):
            patches.CPU_DIRECT_CONVERSION.install(lambda *a, **k: None)
    finally:
        patches.DIRECT_CONVERSION_ROUTING.remove()
    assert not patches.CPU_DIRECT_CONVERSION.installed()


def test_cpu_group_conversion():
    from vllm_hisparse.vllm.simulation.synthetic_attention import cpu_convert_once

    cls = compat.sparse_mla_index_group_class()
    # The twin takes vLLM's arguments.
    assert list(inspect.signature(cpu_convert_once).parameters) == \
        list(inspect.signature(cls._convert_once).parameters)[1:]
    group = _cpu_group()
    assert not patches.CPU_GROUP_CONVERSION.installed(group)
    assert patches.CPU_GROUP_CONVERSION.install(group, cpu_convert_once)
    assert not patches.CPU_GROUP_CONVERSION.install(group, cpu_convert_once)
    assert patches.CPU_GROUP_CONVERSION.installed(group)
    # Reached through vLLM's own group method: position 5 -> block 5's row 1 = 21.
    rows, counts = group.convert_logical_to_physical_topk(
        0, torch.tensor([[-1, 5, 0, -1]], dtype=torch.int32), _metadata([[3, 5]]),
        block_stride_rows=None, return_valid_counts=True)
    assert rows.tolist() == [[21, 12, -1, -1]] and counts.tolist() == [2]
    assert patches.CPU_GROUP_CONVERSION.remove(group)
    assert not patches.CPU_GROUP_CONVERSION.remove(group)
    assert "_convert_once" not in group.__dict__
    assert group._convert_once.__func__ is cls.__dict__["_convert_once"]


def test_capacity_line():
    """Reached through vLLM's ``get_kv_cache_capacity`` (what ``update_kv_cache_capacity``
    logs): our figure for our configs, vLLM's for the others; removal restores vLLM's."""
    from vllm_hisparse.vllm.plugin import _max_concurrency

    module = importlib.import_module(compat.MAX_CONCURRENCY_MODULE)
    was_installed = patches.CAPACITY_LINE.installed()
    patches.CAPACITY_LINE.remove()
    original = getattr(module, compat.MAX_CONCURRENCY_NAME)
    assert list(inspect.signature(original).parameters) == ["vllm_config", "kv_cache_config"]
    ours = SimpleNamespace(model_config=SimpleNamespace(max_model_len=1000))
    try:
        assert patches.CAPACITY_LINE.install(lambda cfg, kv: 7.0 if cfg is ours else None)
        assert not patches.CAPACITY_LINE.install(_max_concurrency)
        assert patches.CAPACITY_LINE.installed()
        assert module.get_kv_cache_capacity(ours, None) == (7000, 7.0)
        assert patches.CAPACITY_LINE.remove()
        assert not patches.CAPACITY_LINE.installed() and not patches.CAPACITY_LINE.remove()
        assert getattr(module, compat.MAX_CONCURRENCY_NAME) is original
    finally:
        patches.CAPACITY_LINE.remove()
        if was_installed:
            assert patches.CAPACITY_LINE.install(_max_concurrency)


def test_lockstep_coordinator(dsa_model_dir):
    """Put on the scheduler's coordinator object, seen through vLLM's KVCacheManager (its
    per-step calls reach the override), and taken off again (vLLM's class is back)."""
    from tests.vllm.scheduler_harness import SchedulerHarness
    from vllm_hisparse.vllm.simulation.model import kv_transfer_config
    from vllm_hisparse.vllm.patches.lockstep import LockstepCoordinator

    harness = SchedulerHarness.build(dsa_model_dir, kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
                                     num_blocks=200, max_model_len=2048, construct_connector=False)
    manager = harness.scheduler.kv_cache_manager
    coordinator = compat.kv_cache_coordinator(manager)
    hybrid = compat.hybrid_coordinator_class()
    assert type(coordinator) is hybrid and not patches.LOCKSTEP_COORDINATOR.installed(coordinator)
    calls = []
    real = LockstepCoordinator.remove_skipped_blocks
    try:
        LockstepCoordinator.remove_skipped_blocks = lambda self, *a, **k: calls.append(a)
        assert patches.LOCKSTEP_COORDINATOR.install(coordinator)
        assert not patches.LOCKSTEP_COORDINATOR.install(coordinator)
        assert patches.LOCKSTEP_COORDINATOR.installed(coordinator)
        assert compat.kv_cache_coordinator(manager) is coordinator  # the same object
        harness.add_requests(1, prompt_len=100, max_tokens=2)
        harness.step()
        assert calls  # vLLM's allocate_slots reached the override
    finally:
        LockstepCoordinator.remove_skipped_blocks = real
    assert patches.LOCKSTEP_COORDINATOR.remove(coordinator)
    assert type(coordinator) is hybrid and not patches.LOCKSTEP_COORDINATOR.remove(coordinator)
    harness.run_to_completion()
    harness.assert_no_leaks()


def test_vllms_group_conversion_is_what_merge_table_rows_computes(monkeypatch):
    """In a step with tracked requests the hook does not call vLLM's group method: the merge
    computes its rows from the same metadata (``read_path.hooked_conversion``). vLLM's own
    method (its oversized-batch branch: the call its side-stream branch makes too), with the
    CPU twin of its Triton function, gives ``reference.table_rows`` of the metadata's
    ``req_id_per_token``, ``block_table`` and ``block_size`` exactly, without a prefill
    workspace or ``idx_mapping``."""
    from vllm.v1.attention.backends.mla import index_group

    from vllm_hisparse.ops import reference
    from vllm_hisparse.vllm.simulation.synthetic_attention import cpu_direct_conversion

    calls = []

    def twin(*args, **kwargs):
        calls.append(kwargs)
        return cpu_direct_conversion(*args, **kwargs)

    monkeypatch.setattr(index_group, compat.DIRECT_CONVERSION_NAME, twin)
    group = _cpu_group(num_tokens=0)  # every batch is oversized: no side stream
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 500, (5, 6), generator=g, dtype=torch.int32)
    topk = torch.randint(-1, 6 * 16 + 20, (7, 4), generator=g, dtype=torch.int32)
    req = torch.randint(0, 5, (9,), generator=g, dtype=torch.int32)  # vLLM's padded buffer
    md = SimpleNamespace(req_id_per_token=req, block_table=table, block_size=16)
    for stride in (None, 48):
        rows = group.convert_logical_to_physical_topk(0, topk, md, block_stride_rows=stride,
                                                      return_valid_counts=False)
        want = reference.table_rows(topk, req[:7], table, 16, 16 if stride is None else stride)
        assert torch.equal(rows, want)
    assert len(calls) == 2
    assert all(k.get("idx_mapping") is None and not k.get("HAS_PREFILL_WORKSPACE")
               for k in calls)
