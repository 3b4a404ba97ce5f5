"""The runtime patches of vLLM's attention read path: where the sparse-MLA backends turn the
indexer's logical top-k into physical KV rows (the index group's method, the direct conversion
sites and the layer context that routes them), where the decode top-k meets its logits (the
indexer scores), and the CPU simulator's pure-torch twins of vLLM's Triton conversions."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any

from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.patches.record import ABSENT, ORIGINAL, Patch, is_ours, marked


# ------------------------------------------------------------------------ top-k conversion

_TOPK = "topk_conversion_hook"
_TOPK_METHOD = "convert_logical_to_physical_topk"


def _topk_installed() -> bool:
    return is_ours(compat.sparse_mla_index_group_class().__dict__[_TOPK_METHOD], _TOPK)


def _install_topk(body: Callable[..., Any]) -> bool:
    """``body(group, original, layer_index, logical_topk, attn_metadata, *,
    block_stride_rows, return_valid_counts)``: ``original`` is vLLM's method bound to
    ``group``; ``body`` must call it for groups it does not own (the wrapper is on the class,
    so it sees every sparse-MLA model in the process)."""
    cls = compat.sparse_mla_index_group_class()
    original = cls.__dict__[_TOPK_METHOD]
    if is_ours(original, _TOPK):
        return False

    @functools.wraps(original)
    def convert_logical_to_physical_topk(self, layer_index, logical_topk_indices, attn_metadata,
                                         *, block_stride_rows, return_valid_counts):
        return body(self, original.__get__(self), layer_index, logical_topk_indices,
                    attn_metadata, block_stride_rows=block_stride_rows,
                    return_valid_counts=return_valid_counts)

    setattr(cls, _TOPK_METHOD, marked(convert_logical_to_physical_topk, _TOPK, original))
    return True


def _remove_topk() -> bool:
    cls = compat.sparse_mla_index_group_class()
    wrapper = cls.__dict__[_TOPK_METHOD]
    if not is_ours(wrapper, _TOPK):
        return False
    setattr(cls, _TOPK_METHOD, getattr(wrapper, ORIGINAL))
    return True


TOPK_CONVERSION_HOOK = Patch(
    name=_TOPK,
    target="vllm.v1.attention.backends.mla.index_group.SparseMLAIndexGroup."
           "convert_logical_to_physical_topk",
    why="the one place where sparse-MLA backends turn the indexer's logical top-k into "
        "physical KV rows for the batches they convert through the index group; rows of "
        "tracked (MIXED / NONE) requests must come from the resolver, not from vLLM's block "
        "table. vLLM's in-tree HiSparseMLAIndexGroup overrides the method, so the wrapper "
        "never runs for it.",
    installed_by="the worker role, when it binds the KV caches",
    install_args="body (read_path.hooked_conversion)",
    install=_install_topk, installed=_topk_installed, remove=_remove_topk,
    extension_point="a pluggable logical-to-physical top-k translator per sparse index group (a "
                    "registry of translators, or a connector hook the index group calls)")



# ------------------------------------------------------------------------ direct conversions

_ROUTING = "direct_conversion_routing"

#: ``(index_group, index_in_group, attn_metadata)`` of the sparse-MLA layer whose
#: ``forward_mqa`` is running, or None outside one.
_CURRENT_SPARSE_LAYER: contextvars.ContextVar[tuple[Any, int, Any] | None] = \
    contextvars.ContextVar("vllm_hisparse_sparse_layer", default=None)


@contextlib.contextmanager
def sparse_layer_context(group: Any, layer_index: int, attn_metadata: Any):
    """Mark the code inside as the attention of member ``layer_index`` of ``group``."""
    token = _CURRENT_SPARSE_LAYER.set((group, int(layer_index), attn_metadata))
    try:
        yield
    finally:
        _CURRENT_SPARSE_LAYER.reset(token)


def current_sparse_layer() -> tuple[Any, int, Any] | None:
    """The layer context set by :func:`sparse_layer_context`, or None."""
    return _CURRENT_SPARSE_LAYER.get()


def _site_modules() -> list[Any]:
    return compat.direct_conversion_modules()


def _routing_installed() -> bool:
    return all(is_ours(getattr(m, compat.DIRECT_CONVERSION_NAME), _ROUTING)
               for m in _site_modules())


def _install_routing(body: Callable[..., Any]) -> bool:
    """Outside a :func:`sparse_layer_context` the wrapper calls vLLM's function unchanged;
    inside one it calls ``body(context, original, *args, **kwargs)``. ``original`` is what
    ``sparse_utils`` holds at install time (the CPU twin, when that is installed)."""
    if _routing_installed():
        return False
    original = compat.direct_conversion_function()

    @functools.wraps(original)
    def routed(*args: Any, **kwargs: Any) -> Any:
        context = _CURRENT_SPARSE_LAYER.get()
        if context is None:
            return original(*args, **kwargs)
        return body(context, original, *args, **kwargs)

    marked(routed, _ROUTING, original)
    for module in _site_modules():
        setattr(module, compat.DIRECT_CONVERSION_NAME, routed)
    return True


def _remove_routing() -> bool:
    removed = False
    for module in _site_modules():
        current = getattr(module, compat.DIRECT_CONVERSION_NAME)
        if is_ours(current, _ROUTING):
            setattr(module, compat.DIRECT_CONVERSION_NAME, getattr(current, ORIGINAL))
            removed = True
    return removed


DIRECT_CONVERSION_ROUTING = Patch(
    name=_ROUTING,
    target="triton_convert_req_index_to_global_index, the module global of each module of "
           "compat.DIRECT_CONVERSION_SITES",
    why="FlashMLA sparse (mixed / prefill batches), FlashInfer sparse SM90 / SM120 and "
        "FlashAttention sparse convert top-k straight from vLLM's batch block table, "
        "bypassing the index group; inside a bound layer's forward those calls must end in "
        "the resolver too. index_group.py's own import of the name is left alone (the group "
        "method has its own patch).",
    installed_by="the worker role, when it binds the KV caches",
    install_args="body (read_path.routed_direct_conversion)",
    install=_install_routing, installed=_routing_installed, remove=_remove_routing,
    extension_point="the same per-group top-k translator, called by every backend that converts "
                    "from the batch block table instead of a module-global function each backend "
                    "imports")



# ------------------------------------------------------------------------ layer context

_LAYER = "layer_forward_context"


def _layer_routed(impl: Any) -> bool:
    return is_ours(impl.__dict__.get("forward_mqa"), _LAYER)


def _route_layer(impl: Any) -> bool:
    """Wrap ``impl.forward_mqa`` (an instance attribute; the class is untouched) so that it
    runs inside :func:`sparse_layer_context` of ``impl.index_group``."""
    if _layer_routed(impl):
        return False
    bound = impl.forward_mqa

    @functools.wraps(bound)
    def forward_mqa(q: Any, kv_c_and_k_pe_cache: Any, attn_metadata: Any, layer: Any) -> Any:
        with sparse_layer_context(impl.index_group, impl.index_group_index, attn_metadata):
            return bound(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    impl.forward_mqa = marked(forward_mqa, _LAYER, impl.__dict__.get("forward_mqa", ABSENT))
    return True


def _unroute_layer(impl: Any) -> bool:
    wrapper = impl.__dict__.get("forward_mqa")
    if not is_ours(wrapper, _LAYER):
        return False
    original = getattr(wrapper, ORIGINAL)
    if original is ABSENT:
        del impl.forward_mqa
    else:
        impl.forward_mqa = original
    return True


LAYER_FORWARD_CONTEXT = Patch(
    name=_LAYER,
    target="<sparse-MLA attention impl>.forward_mqa (instance attribute of each bound layer)",
    why="the direct conversion sites get only the batch block table, not the layer; running "
        "each bound layer's forward_mqa inside sparse_layer_context tells "
        "direct_conversion_routing whose binding to use (MLAAttention.forward_impl calls "
        "self.impl.forward_mqa).",
    installed_by="the worker role, for every layer of an index group it binds",
    install_args="impl (the layer's MLAAttention.impl)",
    install=_route_layer, installed=_layer_routed, remove=_unroute_layer,
    extension_point="the layer (or its index group) named in vLLM's forward context while "
                    "forward_mqa runs")



# ------------------------------------------------------------------------ indexer scores

_SCORES = "indexer_scores"


def _scores_installed() -> bool:
    return is_ours(compat.indexer_topk_class().__dict__["forward"], _SCORES)


def _install_scores(body: Callable[..., Any]) -> bool:
    """``body(original, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)``:
    ``original`` is vLLM's method bound to the top-k module; ``body`` must call it (the
    wrapper is on the class, so it sees every DSA model in the process)."""
    cls = compat.indexer_topk_class()
    original = cls.__dict__["forward"]
    if is_ours(original, _SCORES):
        return False

    @functools.wraps(original)
    def forward(self, logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len):
        return body(original.__get__(self), logits, seq_lens, next_n, topk_indices,
                    topk_tokens, max_seq_len)

    cls.forward = marked(forward, _SCORES, original)
    return True


def _remove_scores() -> bool:
    cls = compat.indexer_topk_class()
    wrapper = cls.__dict__["forward"]
    if not is_ours(wrapper, _SCORES):
        return False
    cls.forward = getattr(wrapper, ORIGINAL)
    return True


INDEXER_SCORES = Patch(
    name=_SCORES,
    target="vllm.model_executor.layers.indexer_topk.SparseIndexerTopk.forward",
    why="score-aware eviction (hot_region_eviction: score) needs the indexer's decode logits "
        "at the hot slots' positions; vLLM keeps the logits inside sparse_attn_indexer and "
        "only the (unsorted) top-k indices leave it. This is the one call that sees both.",
    installed_by="the worker role, when it binds the KV caches with hot_region_eviction "
                 "score",
    install_args="body (score_tap.record_decode_topk)",
    install=_install_scores, installed=_scores_installed, remove=_remove_scores,
    extension_point="an observer hook after SparseIndexerTopk.forward that receives the decode "
                    "logits and the selected top-k")


# ------------------------------------------------------------------------ CPU simulator

_CPU_DIRECT = "cpu_direct_conversion"


def _twin_modules() -> list[Any]:
    return compat.direct_conversion_modules(with_definition=True)


def _cpu_direct_installed() -> bool:
    return is_ours(compat.direct_conversion_function(), _CPU_DIRECT)


def _install_cpu_direct(twin: Callable[..., Any]) -> bool:
    """``twin`` has the signature of vLLM's function. Install before
    ``direct_conversion_routing`` (which then wraps the twin), remove after it."""
    if _cpu_direct_installed():
        return False
    if _routing_installed():
        raise RuntimeError(f"patch {_CPU_DIRECT!r} must be installed before "
                           f"{_ROUTING!r} (remove that first)")
    originals = {m: getattr(m, compat.DIRECT_CONVERSION_NAME) for m in _twin_modules()}

    @functools.wraps(twin)
    def cpu_twin(*args: Any, **kwargs: Any) -> Any:
        return twin(*args, **kwargs)

    marked(cpu_twin, _CPU_DIRECT, originals)
    for module in originals:
        setattr(module, compat.DIRECT_CONVERSION_NAME, cpu_twin)
    return True


def _remove_cpu_direct() -> bool:
    twin = compat.direct_conversion_function()
    if not is_ours(twin, _CPU_DIRECT):
        return False
    if _routing_installed():
        raise RuntimeError(f"patch {_ROUTING!r} wraps {_CPU_DIRECT!r}: remove it first")
    for module, original in getattr(twin, ORIGINAL).items():
        setattr(module, compat.DIRECT_CONVERSION_NAME, original)
    return True


CPU_DIRECT_CONVERSION = Patch(
    name=_CPU_DIRECT,
    target="triton_convert_req_index_to_global_index in sparse_utils and every module of "
           "compat.DIRECT_CONVERSION_SITES",
    why="Triton cannot run on CPU; the CPU simulator puts a pure-torch twin with vLLM's "
        "signature in its place for one run.",
    installed_by="the simulator, for one CPU run",
    install_args="twin (simulation.synthetic_attention.cpu_direct_conversion)",
    install=_install_cpu_direct, installed=_cpu_direct_installed, remove=_remove_cpu_direct,
    extension_point="none for serving (a CPU simulator twin); upstream, a torch fallback of the "
                    "Triton conversion")


_CPU_GROUP = "cpu_group_conversion"


def _cpu_group_installed(group: Any) -> bool:
    return is_ours(group.__dict__.get("_convert_once"), _CPU_GROUP)


def _install_cpu_group(group: Any, twin: Callable[..., Any]) -> bool:
    """``twin(layer_index, logical_topk, req_id_per_token, block_table, block_size, *,
    block_stride_rows, return_valid_counts, idx_mapping=None)``, like vLLM's method."""
    if _cpu_group_installed(group):
        return False

    @functools.wraps(twin)
    def convert_once(*args: Any, **kwargs: Any) -> Any:
        return twin(*args, **kwargs)

    group._convert_once = marked(convert_once, _CPU_GROUP, None)
    return True


def _remove_cpu_group(group: Any) -> bool:
    if not _cpu_group_installed(group):
        return False
    del group._convert_once
    return True


CPU_GROUP_CONVERSION = Patch(
    name=_CPU_GROUP,
    target="<SparseMLAIndexGroup>._convert_once (instance attribute of a simulator group)",
    why="vLLM's group conversion runs Triton on a side stream, neither of which exists on "
        "CPU; the CPU simulator gives each index group it builds a pure-torch twin.",
    installed_by="the simulator, for each index group it builds on CPU",
    install_args="group, twin (simulation.synthetic_attention.cpu_convert_once)",
    install=_install_cpu_group, installed=_cpu_group_installed, remove=_remove_cpu_group,
    extension_point="none for serving (a CPU simulator twin); upstream, a torch fallback of the "
                    "index group's _convert_once")


