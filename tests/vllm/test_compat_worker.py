"""Every vLLM 0.33 internal the worker role and the attention hook touch exists as used
(the patches themselves: ``test_patches.py``)."""

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


# ------------------------------------------------------------------ direct conversion sites


def test_direct_conversion_sites_call_the_module_global_name():
    """Every method listed in DIRECT_CONVERSION_SITES calls the name we replace, and the
    function still has every parameter the routed body reads."""
    import importlib

    for module_name, methods in compat.DIRECT_CONVERSION_SITES.items():
        module = importlib.import_module(module_name)
        assert getattr(module, compat.DIRECT_CONVERSION_NAME) is not None
        for qualname in methods:
            cls_name, meth = qualname.split(".")
            src = inspect.getsource(getattr(getattr(module, cls_name), meth))
            assert f"{compat.DIRECT_CONVERSION_NAME}(" in src, qualname
            assert "block_table" in src, qualname
    params = inspect.signature(compat.direct_conversion_function()).parameters
    for name in ("req_id", "block_table", "token_indices", "BLOCK_SIZE", "BLOCK_STRIDE_ROWS",
                 "HAS_PREFILL_WORKSPACE", "prefill_workspace_request_ids", "dcp_size",
                 "return_valid_counts", "out", "valid_counts_out", "idx_mapping"):
        assert name in params, name
    # The group's own conversion uses index_group.py's name, which we leave alone.
    from vllm.v1.attention.backends.mla import index_group

    assert compat.DIRECT_CONVERSION_NAME in inspect.getsource(index_group.SparseMLAIndexGroup._convert_once)
    assert index_group.__name__ not in compat.DIRECT_CONVERSION_SITES


def test_forward_context_attn_metadata_accessor():
    from vllm.forward_context import ForwardContext

    assert "attn_metadata" in ForwardContext.__dataclass_fields__
    assert compat.forward_context_attn_metadata() is None  # no forward running
    assert compat.current_forward_context() is None
    from vllm.forward_context import (create_forward_context, override_forward_context,
                                      set_forward_context)

    # One object per forward (the step view's token rows key on it): set_forward_context
    # makes a new one each time, and the accessor returns the one that is set.
    assert "create_forward_context(" in inspect.getsource(set_forward_context)
    assert "return ForwardContext(" in inspect.getsource(create_forward_context)
    marker = object()
    with override_forward_context(marker):
        assert compat.current_forward_context() is marker
    assert compat.current_forward_context() is None
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner)
    assert "self.kv_connector.pre_forward(scheduler_output, input_batch)" in src
    from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonMetadata

    assert "block_table" in SparseMLACommonMetadata.__dataclass_fields__
    assert compat.NULL_BLOCK_ID == 0


def test_index_group_conversion_stream_follows_vllms_conversion():
    """vLLM's group conversion starts on the group's side stream from ``logical_topk_ready``
    (recorded after the indexer) when the group has an indexer and the forward is not
    piecewise, else from the compute stream; ``index_group_conversion_stream`` answers the
    same, and nothing on CPU."""
    import dataclasses

    from vllm.v1.attention.backends.mla import index_group

    cls = compat.sparse_mla_index_group_class()
    src = inspect.getsource(cls._convert_once)
    assert "self.side_stream.wait_event(self.logical_topk_ready)" in src
    assert "if self.has_indexer and not in_piecewise_cudagraph():" in src
    assert "compute_stream.wait_event(self.physical_topk_ready)" in src
    record = inspect.getsource(cls.set_logical_topk_ready)
    assert "self.logical_topk_ready.record(current_stream())" in record
    fields = {f.name for f in dataclasses.fields(cls)}
    assert {"side_stream", "logical_topk_ready", "has_indexer"} <= fields
    assert index_group.in_piecewise_cudagraph() is False  # no forward context
    buf = torch.zeros((2, 4), dtype=torch.int32)
    cpu = cls(logical_topk_indices=buf, physical_topk_indices=buf.clone(),
              valid_topk_counts=torch.zeros(2, dtype=torch.int32),
              side_stream=torch.Stream(device="cpu"), logical_topk_ready=None,
              physical_topk_ready=None, has_indexer=False)
    assert compat.index_group_conversion_stream(cpu) is None
    compat.record_logical_topk_ready(cpu, 0)  # no indexer: records nothing (no event here)
    cuda_like = dataclasses.replace(cpu, has_indexer=True, logical_topk_ready=object())
    cuda_like.side_stream = type("S", (), {"device": torch.device("cuda", 0)})()
    stream, topk_ready = compat.index_group_conversion_stream(cuda_like)
    assert stream is cuda_like.side_stream and topk_ready() is cuda_like.logical_topk_ready
    cuda_like.has_indexer = False
    assert topk_ready() is None
