"""Every vLLM 0.33 internal the worker role and the attention hook touch exists as used."""

from __future__ import annotations

import inspect

import torch

from vllm_hisparse.vllm import compat


def test_sparse_mla_index_group_conversion_signature():
    cls = compat.sparse_mla_index_group_class()
    sig = inspect.signature(cls.__dict__["convert_logical_to_physical_topk"])
    assert list(sig.parameters)[:4] == ["self", "layer_index", "logical_topk_indices", "attn_metadata"]
    assert sig.parameters["block_stride_rows"].kind is inspect.Parameter.KEYWORD_ONLY
    assert sig.parameters["return_valid_counts"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "_convert_once" in cls.__dict__
    assert issubclass(compat.in_tree_hisparse_index_group_class(), cls)
    # The in-tree HiSparse group overrides the method: our class-level wrapper never runs for it.
    assert "convert_logical_to_physical_topk" in compat.in_tree_hisparse_index_group_class().__dict__


def test_topk_hook_install_is_idempotent_and_removable():
    body = lambda group, original, *a, **k: original(*a, **k)  # noqa: E731
    try:
        assert compat.install_topk_conversion_hook(body)
        assert not compat.install_topk_conversion_hook(body)
        assert compat.topk_conversion_hook_installed()
    finally:
        assert compat.remove_topk_conversion_hook()
    assert not compat.topk_conversion_hook_installed()
    assert not compat.remove_topk_conversion_hook()


def test_sparse_impl_carries_its_index_group():
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonImpl

    src = inspect.getsource(SparseMLACommonImpl.__init__)
    assert "self.index_group" in src and "self.index_group_index" in src
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    assert "self.impl = impl" in inspect.getsource(MLAAttention.__init__)


def test_vllm_conversion_contract():
    from vllm.v1.attention.backends.mla import sparse_utils

    sig = inspect.signature(sparse_utils.triton_convert_req_index_to_global_index)
    for name in ("req_id", "block_table", "token_indices", "BLOCK_SIZE", "BLOCK_STRIDE_ROWS",
                 "return_valid_counts", "idx_mapping"):
        assert name in sig.parameters
    # Same row addressing as worker.device_rows.flat_row_view: b * block_stride_rows + o.
    cache = torch.zeros(3 * 96).as_strided((3, 4, 8), (96, 8, 1))
    rows, stride = sparse_utils.flat_kv_row_view(cache, 4)
    from vllm_hisparse.worker.device_rows import flat_row_view

    assert stride == 12 and flat_row_view(cache, 4)[1] == 12
    assert rows.shape[0] == flat_row_view(cache, 4)[0].shape[0]


def test_allocation_and_forward_context_accessors():
    sig = inspect.signature(compat.allocate_kv_cache)
    assert list(sig.parameters)[:3] == ["kv_cache_config", "device", "layout"]
    from vllm.v1.worker.utils import allocate_kv_cache

    assert list(inspect.signature(allocate_kv_cache).parameters)[:4] == [
        "kv_cache_config", "device", "layout", "kernel_block_sizes"]
    from vllm.config.compilation import CompilationConfig

    assert "static_forward_context" in CompilationConfig.__dataclass_fields__
    from vllm.v1.core.sched.output import SchedulerOutput

    assert "num_scheduled_tokens" in SchedulerOutput.__dataclass_fields__
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    src = inspect.getsource(ActiveKVConnector._build_load_kwargs)
    assert "request_ids=input_batch.req_ids" in src and "scheduler_output=scheduler_output" in src
