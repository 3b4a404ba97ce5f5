"""The sparse-MLA attention read path: the index group and its top-k conversion, the indexer's
decode top-k, the backends' direct conversion sites, a layer's index group, and the forward
context and its attention metadata. Used by the worker role (worker_side/role.py,
worker_side/read_path.py) and patches/; existence and signature checks in
tests/vllm/test_compat_worker.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.config import VllmConfig

__all__ = ["attention_block_table", "direct_conversion_at", "direct_conversion_function",
           "DIRECT_CONVERSION_MODULE", "direct_conversion_modules", "DIRECT_CONVERSION_NAME",
           "current_forward_context", "DIRECT_CONVERSION_SITES",
           "forward_context_attn_metadata",
           "in_tree_hisparse_index_group_class", "index_group_conversion_stream",
           "indexer_topk_class", "layer_index_group", "record_logical_topk_ready",
           "sparse_mla_index_group_class", "static_forward_context"]

#: Modules whose forward paths call ``sparse_utils.triton_convert_req_index_to_global_index``
#: through their own module-global name with vLLM's **batch** block table (bypassing the index
#: group), and the methods that do (vLLM 0.33.0 line numbers):
#:
#: * FlashMLA sparse: ``_forward_bf16_kv`` (mixed / prefill bf16 batches, ``:914``),
#:   ``_forward_fp8_kv_separate_prefill_decode`` (batches with prefill tokens, prefill tokens
#:   mapped to the upconvert workspace, ``:1047``), ``_forward_fp8_kv_mixed_batch`` (mixed
#:   fp8 batches, ``:1250``); ``_gather_prefill_chunk`` (``:955``) is PCP+DCP only;
#: * the generic ``SparseMLACommonImpl.forward_mqa`` (FlashInfer sparse, FlashAttention sparse)
#:   when ``group_conversion_decode_only`` and the batch is not a multi-layer decode batch
#:   (``sparse_mla_attention.py:773``);
#: * FlashInfer sparse SM120 ``forward_mqa`` (``flashinfer_mla_sparse_sm120.py:194``) and
#:   SM90 ``forward_mqa`` (``flashinfer_mla_sparse_sm90.py:618``), every batch.
#:
#: ``patches.DIRECT_CONVERSION_ROUTING`` replaces that module-global name in each of them
#: (``index_group.py``'s own name, used by the group method, is left alone: the group method
#: has its own patch). ROCm / XPU sparse backends are not covered.
DIRECT_CONVERSION_SITES: dict[str, tuple[str, ...]] = {
    "vllm.v1.attention.backends.mla.flashmla_sparse": (
        "FlashMLASparseImpl._forward_bf16_kv",
        "FlashMLASparseImpl._forward_fp8_kv_separate_prefill_decode",
        "FlashMLASparseImpl._forward_fp8_kv_mixed_batch",
    ),
    "vllm.model_executor.layers.attention.sparse_mla_attention": (
        "SparseMLACommonImpl.forward_mqa",
    ),
    "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm120": (
        "FlashInferMLASparseSM120Impl.forward_mqa",
    ),
    "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90": (
        "FlashInferMLASparseSM90Impl.forward_mqa",
    ),
}

#: The name the sites call (defined in ``vllm.v1.attention.backends.mla.sparse_utils``).
DIRECT_CONVERSION_NAME = "triton_convert_req_index_to_global_index"

#: The module that defines it (the CPU simulator's twin replaces it there too).
DIRECT_CONVERSION_MODULE = "vllm.v1.attention.backends.mla.sparse_utils"


def sparse_mla_index_group_class() -> type:
    """``vllm.v1.attention.backends.mla.index_group.SparseMLAIndexGroup``: the object every
    sparse-MLA layer of one indexer shares (``index_group.py:36``); its
    ``convert_logical_to_physical_topk`` (``:95``) is where decode batches turn logical
    top-k into physical KV rows (patched: ``patches.TOPK_CONVERSION_HOOK``).
    ``HiSparseMLAIndexGroup`` (vLLM's in-tree HiSparse) overrides the method, so the
    patch never runs for it."""
    from vllm.v1.attention.backends.mla.index_group import SparseMLAIndexGroup

    return SparseMLAIndexGroup


def indexer_topk_class() -> type:
    """``vllm.model_executor.layers.indexer_topk.SparseIndexerTopk``: the DSA indexer's decode
    top-k (``forward(logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)``,
    ``indexer_topk.py``), the last place the decode logits and their top-k meet (patched:
    ``patches.INDEXER_SCORES``). Its ``"torch"`` backend runs anywhere (the simulator's)."""
    from vllm.model_executor.layers.indexer_topk import SparseIndexerTopk

    return SparseIndexerTopk


def in_tree_hisparse_index_group_class() -> type:
    """vLLM's in-tree ``HiSparseMLAIndexGroup`` (we refuse to bind to one)."""
    from vllm.v1.attention.backends.mla.index_group import HiSparseMLAIndexGroup

    return HiSparseMLAIndexGroup


def index_group_conversion_stream(group: Any) -> tuple[Any, Callable[[], Any | None]] | None:
    """``(side stream, topk_ready)`` of an index group whose conversion vLLM runs on a CUDA
    side stream, else None (CPU, or a group without one).

    ``topk_ready()`` returns the event vLLM's own conversion starts from, or None where it
    starts after the compute stream instead. ``SparseMLAIndexGroup._convert_once``
    (``index_group.py:140-146``) waits on ``logical_topk_ready`` when the group
    ``has_indexer`` and the forward is not piecewise (``forward_context.in_piecewise_cudagraph``:
    the event is graph-local there and is not recorded, ``:59-69``), else on the compute
    stream. ``topk_ready`` answers the same way."""
    stream = getattr(group, "side_stream", None)
    device = getattr(stream, "device", None)
    if device is None or torch.device(device).type != "cuda":
        return None
    from vllm.forward_context import in_piecewise_cudagraph

    def topk_ready() -> Any | None:
        if group.has_indexer and not in_piecewise_cudagraph():
            return group.logical_topk_ready
        return None

    return stream, topk_ready


def record_logical_topk_ready(group: Any, layer_index: int) -> None:
    """``SparseMLAIndexGroup.set_logical_topk_ready`` (``index_group.py:59``): what vLLM's
    model calls right after a layer's indexer (``mla.py:235``); records the event the
    group's conversion starts from (leader of a group with an indexer, not piecewise)."""
    group.set_logical_topk_ready(layer_index)


def static_forward_context(vllm_config: VllmConfig) -> dict[str, Any]:
    """Layer name → attention module of the constructed model (``config/compilation.py:757``);
    empty before the model is built (CPU tests)."""
    return vllm_config.compilation_config.static_forward_context


def layer_index_group(layer: Any) -> tuple[Any, int] | None:
    """``(index_group, index_in_group)`` of a sparse-MLA attention module, or None.

    ``MLAAttention.impl`` (``mla_attention.py:598``) is a ``SparseMLACommonImpl`` whose
    ``index_group`` / ``index_group_index`` are set at construction
    (``sparse_mla_attention.py:682-694``)."""
    impl = getattr(layer, "impl", None)
    group = getattr(impl, "index_group", None)
    if group is None:
        return None
    return group, int(impl.index_group_index)


def direct_conversion_function() -> Callable[..., Any]:
    """vLLM's ``triton_convert_req_index_to_global_index`` (``sparse_utils.py:493``)."""
    from vllm.v1.attention.backends.mla import sparse_utils

    return getattr(sparse_utils, DIRECT_CONVERSION_NAME)


def forward_context_attn_metadata() -> Any:
    """``get_forward_context().attn_metadata`` (layer name -> metadata; a list of such
    dicts under micro-batching) when a forward context is set, else None. In eager and
    piecewise steps ``start_load_kv`` runs inside the step's forward context
    (``v1/worker/gpu/model_runner.py:2068``); FULL-graph steps pass ``attn_metadata`` to it."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    return getattr(get_forward_context(), "attn_metadata", None)


def current_forward_context() -> Any:
    """vLLM's ``ForwardContext`` of the forward running now (``set_forward_context`` makes a
    new one per forward: a step's, a draft model's, a capture's), or None outside one."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return get_forward_context() if is_forward_context_available() else None


def direct_conversion_modules(*, with_definition: bool = False) -> list[Any]:
    """The modules of :data:`DIRECT_CONVERSION_SITES` (imported), after
    :data:`DIRECT_CONVERSION_MODULE` with ``with_definition`` (the patches replace the
    module-global name in each)."""
    import importlib

    names = [*([DIRECT_CONVERSION_MODULE] if with_definition else []), *DIRECT_CONVERSION_SITES]
    return [importlib.import_module(name) for name in dict.fromkeys(names)]


def direct_conversion_at(module_name: str) -> Callable[..., Any]:
    """What the direct conversion site ``module_name`` (a key of
    :data:`DIRECT_CONVERSION_SITES`) calls now (the module global, patched or not)."""
    import importlib

    if module_name not in DIRECT_CONVERSION_SITES:
        raise KeyError(f"{module_name!r} is not a direct conversion site; known: "
                       f"{sorted(DIRECT_CONVERSION_SITES)}")
    return getattr(importlib.import_module(module_name), DIRECT_CONVERSION_NAME)


def attention_block_table(attn_metadata: Any) -> Any:
    """The batch block table of a layer's attention metadata (``SparseMLACommonMetadata
    .block_table``, ``[batch rows, pages]``, one row per request of the step), or None. The
    worker role rewrites rows of it in place (``worker_side/prefill_guard.py``)."""
    return getattr(attn_metadata, "block_table", None)
