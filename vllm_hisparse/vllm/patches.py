"""Every runtime patch this package applies to vLLM 0.33, in one table (:data:`PATCHES`).

A patch replaces one vLLM attribute with a wrapper (or, in the CPU simulator, a pure-torch
twin). Each is a :class:`Patch` record with the same three verbs:

* ``install(...)`` puts the replacement in place and returns True; False when it is
  already there (idempotent: a marker attribute on the replacement says so);
* ``installed(...)`` says whether it is in place;
* ``remove(...)`` puts vLLM's original back and returns True; False when nothing was
  installed.

Class- and module-level patches take no object argument; per-object patches
(``layer_forward_context``, ``cpu_group_conversion``, ``lockstep_coordinator``) take the
object first. Nothing is
installed at import. ``tests/vllm/test_patches.py`` checks each patch against the installed
vLLM: it installs, is seen installed, is reached through vLLM's own entry point, and its
removal restores vLLM's original object.

Who installs what: the plugin's ``register()`` the planner hook, the config check and the
capacity line; the scheduler role, when it binds the KV cache manager, the lockstep
coordinator; the worker role, when it
binds the KV caches, the top-k conversion hook, the direct conversion routing and (per bound
layer) the layer forward context; the CPU simulator, for one run, the two CPU twins.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_hisparse.vllm import compat

#: Attribute every replacement carries (value: the patch name), so a second install is a no-op.
_MARKER = "__vllm_hisparse_patch__"
#: Attribute holding what the replacement replaced.
_ORIGINAL = "__vllm_hisparse_original__"
#: Stands for "the object had no instance attribute" in a per-object patch's saved original.
_ABSENT = object()


@dataclass(frozen=True)
class Patch:
    """One runtime patch of vLLM.

    Attributes:
        name: the table key.
        target: what is replaced (a dotted path; ``<...>`` names a per-object attribute).
        why: what would not work without it.
        installed_by: who installs it, and when.
        install_args: what ``install`` takes (the object first for a per-object patch).
        install: ``install(*args) -> bool``.
        installed: ``installed(*objects) -> bool``.
        remove: ``remove(*objects) -> bool``; restores vLLM's original.
    """

    name: str
    target: str
    why: str
    installed_by: str
    install_args: str
    install: Callable[..., bool]
    installed: Callable[..., bool]
    remove: Callable[..., bool]


def _marked(fn: Callable[..., Any], name: str, original: Any) -> Callable[..., Any]:
    setattr(fn, _MARKER, name)
    setattr(fn, _ORIGINAL, original)
    return fn


def _is_ours(obj: Any, name: str) -> bool:
    return getattr(obj, _MARKER, None) == name


# ------------------------------------------------------------------------ planner hook

_PLANNER = "planner_hook"


def _builder_lookup() -> Any:
    # The class attribute is a classmethod object; look in __dict__ to see the descriptor.
    return compat.Platform.__dict__["get_kv_cache_config_builder_cls"]


def _planner_installed() -> bool:
    return _is_ours(_builder_lookup().__func__, _PLANNER)


def _install_planner(select_builder: Callable[[Any], str | None]) -> bool:
    """``select_builder(vllm_config)`` returns our builder's qualified name, or None to keep
    the platform's answer (every config that does not name the connector)."""
    original = _builder_lookup().__func__
    if _is_ours(original, _PLANNER):
        return False

    @functools.wraps(original)
    def get_kv_cache_config_builder_cls(cls: type, vllm_config: Any) -> str:
        platform_choice = original(cls, vllm_config)
        ours = select_builder(vllm_config)
        if ours is None:
            return platform_choice
        if platform_choice != compat.DEFAULT_BUILDER_QUALNAME:
            # A vendor platform plans its own KV cache; refuse rather than silently drop
            # its placement rules.
            raise ValueError(
                "HiSparseResidencyConnector needs to plan the KV cache itself, but "
                f"platform {cls.__name__} selects the KV cache config builder "
                f"{platform_choice!r}; only {compat.DEFAULT_BUILDER_QUALNAME!r} is supported.")
        return ours

    compat.Platform.get_kv_cache_config_builder_cls = classmethod(  # type: ignore[assignment]
        _marked(get_kv_cache_config_builder_cls, _PLANNER, original))
    return True


def _remove_planner() -> bool:
    wrapper = _builder_lookup().__func__
    if not _is_ours(wrapper, _PLANNER):
        return False
    compat.Platform.get_kv_cache_config_builder_cls = classmethod(  # type: ignore[assignment]
        getattr(wrapper, _ORIGINAL))
    return True


PLANNER_HOOK = Patch(
    name=_PLANNER,
    target="vllm.platforms.interface.Platform.get_kv_cache_config_builder_cls",
    why="vLLM resolves its KV-cache planner through this classmethod (engine core and, for "
        "the profiling cache, the workers) and has no registry for planners; without it a "
        "DSA model's sparse-MLA and indexer layers share one group and cannot be split.",
    installed_by="plugin.register(), in every process vLLM starts",
    install_args="select_builder(vllm_config) -> our builder's qualified name, or None to "
                 "keep vLLM's answer (a vendor builder is refused by name)",
    install=_install_planner, installed=_planner_installed, remove=_remove_planner)


# ------------------------------------------------------------------------ top-k conversion

_TOPK = "topk_conversion_hook"
_TOPK_METHOD = "convert_logical_to_physical_topk"


def _topk_installed() -> bool:
    return _is_ours(compat.sparse_mla_index_group_class().__dict__[_TOPK_METHOD], _TOPK)


def _install_topk(body: Callable[..., Any]) -> bool:
    """``body(group, original, layer_index, logical_topk, attn_metadata, *,
    block_stride_rows, return_valid_counts)``: ``original`` is vLLM's method bound to
    ``group``; ``body`` must call it for groups it does not own (the wrapper is on the class,
    so it sees every sparse-MLA model in the process)."""
    cls = compat.sparse_mla_index_group_class()
    original = cls.__dict__[_TOPK_METHOD]
    if _is_ours(original, _TOPK):
        return False

    @functools.wraps(original)
    def convert_logical_to_physical_topk(self, layer_index, logical_topk_indices, attn_metadata,
                                         *, block_stride_rows, return_valid_counts):
        return body(self, original.__get__(self), layer_index, logical_topk_indices,
                    attn_metadata, block_stride_rows=block_stride_rows,
                    return_valid_counts=return_valid_counts)

    setattr(cls, _TOPK_METHOD, _marked(convert_logical_to_physical_topk, _TOPK, original))
    return True


def _remove_topk() -> bool:
    cls = compat.sparse_mla_index_group_class()
    wrapper = cls.__dict__[_TOPK_METHOD]
    if not _is_ours(wrapper, _TOPK):
        return False
    setattr(cls, _TOPK_METHOD, getattr(wrapper, _ORIGINAL))
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
    install_args="body (attention_hook.hooked_conversion)",
    install=_install_topk, installed=_topk_installed, remove=_remove_topk)


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
    return [importlib.import_module(m) for m in compat.DIRECT_CONVERSION_SITES]


def _routing_installed() -> bool:
    return all(_is_ours(getattr(m, compat.DIRECT_CONVERSION_NAME), _ROUTING)
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

    _marked(routed, _ROUTING, original)
    for module in _site_modules():
        setattr(module, compat.DIRECT_CONVERSION_NAME, routed)
    return True


def _remove_routing() -> bool:
    removed = False
    for module in _site_modules():
        current = getattr(module, compat.DIRECT_CONVERSION_NAME)
        if _is_ours(current, _ROUTING):
            setattr(module, compat.DIRECT_CONVERSION_NAME, getattr(current, _ORIGINAL))
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
    install_args="body (attention_hook.routed_direct_conversion)",
    install=_install_routing, installed=_routing_installed, remove=_remove_routing)


# ------------------------------------------------------------------------ layer context

_LAYER = "layer_forward_context"


def _layer_routed(impl: Any) -> bool:
    return _is_ours(impl.__dict__.get("forward_mqa"), _LAYER)


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

    impl.forward_mqa = _marked(forward_mqa, _LAYER, impl.__dict__.get("forward_mqa", _ABSENT))
    return True


def _unroute_layer(impl: Any) -> bool:
    wrapper = impl.__dict__.get("forward_mqa")
    if not _is_ours(wrapper, _LAYER):
        return False
    original = getattr(wrapper, _ORIGINAL)
    if original is _ABSENT:
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
    install=_route_layer, installed=_layer_routed, remove=_unroute_layer)


# ------------------------------------------------------------------------ CPU simulator

_CPU_DIRECT = "cpu_direct_conversion"
_SPARSE_UTILS = "vllm.v1.attention.backends.mla.sparse_utils"


def _twin_modules() -> list[Any]:
    names = dict.fromkeys([_SPARSE_UTILS, *compat.DIRECT_CONVERSION_SITES])
    return [importlib.import_module(m) for m in names]


def _cpu_direct_installed() -> bool:
    return _is_ours(compat.direct_conversion_function(), _CPU_DIRECT)


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

    _marked(cpu_twin, _CPU_DIRECT, originals)
    for module in originals:
        setattr(module, compat.DIRECT_CONVERSION_NAME, cpu_twin)
    return True


def _remove_cpu_direct() -> bool:
    twin = compat.direct_conversion_function()
    if not _is_ours(twin, _CPU_DIRECT):
        return False
    if _routing_installed():
        raise RuntimeError(f"patch {_ROUTING!r} wraps {_CPU_DIRECT!r}: remove it first")
    for module, original in getattr(twin, _ORIGINAL).items():
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
    install=_install_cpu_direct, installed=_cpu_direct_installed, remove=_remove_cpu_direct)


_CPU_GROUP = "cpu_group_conversion"


def _cpu_group_installed(group: Any) -> bool:
    return _is_ours(group.__dict__.get("_convert_once"), _CPU_GROUP)


def _install_cpu_group(group: Any, twin: Callable[..., Any]) -> bool:
    """``twin(layer_index, logical_topk, req_id_per_token, block_table, block_size, *,
    block_stride_rows, return_valid_counts, idx_mapping=None)``, like vLLM's method."""
    if _cpu_group_installed(group):
        return False

    @functools.wraps(twin)
    def convert_once(*args: Any, **kwargs: Any) -> Any:
        return twin(*args, **kwargs)

    group._convert_once = _marked(convert_once, _CPU_GROUP, None)
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
    install=_install_cpu_group, installed=_cpu_group_installed, remove=_remove_cpu_group)


# ------------------------------------------------------------------------ lockstep groups

_LOCKSTEP = "lockstep_coordinator"


def _lockstep_installed(coordinator: Any) -> bool:
    from vllm_hisparse.vllm.lockstep import LockstepCoordinator

    return type(coordinator) is LockstepCoordinator


def _install_lockstep(coordinator: Any) -> bool:
    """Give the scheduler's coordinator object the lockstep class (it adds no state).
    Raises ``ValueError`` unless ``lockstep.lockstep_groups(coordinator)``."""
    from vllm_hisparse.vllm.lockstep import LockstepCoordinator, lockstep_groups

    if _lockstep_installed(coordinator):
        return False
    if not lockstep_groups(coordinator):
        raise ValueError(f"patch {_LOCKSTEP!r}: the KV cache groups of this "
                         f"{type(coordinator).__name__} do not move in lockstep")
    coordinator.__class__ = LockstepCoordinator
    return True


def _remove_lockstep(coordinator: Any) -> bool:
    if not _lockstep_installed(coordinator):
        return False
    coordinator.__class__ = compat.hybrid_coordinator_class()
    return True


LOCKSTEP_COORDINATOR = Patch(
    name=_LOCKSTEP,
    target="<HybridKVCacheCoordinator>.__class__ (the scheduler's coordinator object)",
    why="vLLM runs every per-request manager call once per KV cache group; our plan has six "
        "groups where plain vLLM has one, all full attention with one block size, so a "
        "decode step with nothing to allocate or cache in the first group has nothing in "
        "any (lockstep.py). Without it vLLM's scheduler step costs 1.8x stock vLLM's.",
    installed_by="the scheduler role, when it binds the KV cache manager, if every group "
                 "moves in lockstep (lockstep.lockstep_groups)",
    install_args="coordinator (KVCacheManager.coordinator)",
    install=_install_lockstep, installed=_lockstep_installed, remove=_remove_lockstep)


# ------------------------------------------------------------------------ config check

_CONFIG_CHECK = "config_check"


def _config_post_init() -> Any:
    return compat.VllmConfig.__dict__["__post_init__"]


def _config_check_installed() -> bool:
    return _is_ours(_config_post_init(), _CONFIG_CHECK)


def _install_config_check(check: Callable[[Any], None]) -> bool:
    original = _config_post_init()
    if _is_ours(original, _CONFIG_CHECK):
        return False

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        # Before vLLM's body: it inspects MultiConnector children itself and fails with an
        # AttributeError on the malformed shapes our check names.
        check(self)
        original(self)

    compat.VllmConfig.__post_init__ = _marked(__post_init__, _CONFIG_CHECK, original)
    return True


def _remove_config_check() -> bool:
    wrapper = _config_post_init()
    if not _is_ours(wrapper, _CONFIG_CHECK):
        return False
    compat.VllmConfig.__post_init__ = getattr(wrapper, _ORIGINAL)
    return True


CONFIG_CHECK = Patch(
    name=_CONFIG_CHECK,
    target="vllm.config.VllmConfig.__post_init__",
    why="vLLM gives a general plugin no hook between parsing the CLI and starting the engine "
        "processes, and kv_connector_extra_config is an untyped dict only the connector reads "
        "(in the engine core): without it a bad key kills `vllm serve` far from its cause.",
    installed_by="plugin.register(), in every process vLLM starts",
    install_args="check(vllm_config), a no-op for configs that do not name the connector "
                 "(config.check_extra_config)",
    install=_install_config_check, installed=_config_check_installed,
    remove=_remove_config_check)


# ------------------------------------------------------------------------ capacity line

_CAPACITY = "capacity_line"


def _capacity_module() -> Any:
    return importlib.import_module(compat.MAX_CONCURRENCY_MODULE)


def _capacity_installed() -> bool:
    return _is_ours(getattr(_capacity_module(), compat.MAX_CONCURRENCY_NAME), _CAPACITY)


def _install_capacity(concurrency: Callable[[Any, Any], float | None]) -> bool:
    """``concurrency(vllm_config, kv_cache_config)`` returns the figure to report, or None
    to keep vLLM's (every config that does not name the connector)."""
    module = _capacity_module()
    original = getattr(module, compat.MAX_CONCURRENCY_NAME)
    if _is_ours(original, _CAPACITY):
        return False

    @functools.wraps(original)
    def get_max_concurrency_for_kv_cache_config(vllm_config: Any, kv_cache_config: Any) -> float:
        ours = concurrency(vllm_config, kv_cache_config)
        return original(vllm_config, kv_cache_config) if ours is None else ours

    setattr(module, compat.MAX_CONCURRENCY_NAME,
            _marked(get_max_concurrency_for_kv_cache_config, _CAPACITY, original))
    return True


def _remove_capacity() -> bool:
    module = _capacity_module()
    wrapper = getattr(module, compat.MAX_CONCURRENCY_NAME)
    if not _is_ours(wrapper, _CAPACITY):
        return False
    setattr(module, compat.MAX_CONCURRENCY_NAME, getattr(wrapper, _ORIGINAL))
    return True


CAPACITY_LINE = Patch(
    name=_CAPACITY,
    target=f"{compat.MAX_CONCURRENCY_MODULE}.{compat.MAX_CONCURRENCY_NAME}",
    why="vLLM's startup line 'Maximum concurrency for N tokens per request' (and "
        "cache_config.kv_cache_max_concurrency) counts every page of every group on the "
        "device; it reads no field a plan without host-resident groups could set, so with "
        "hybrid residency it would report the full-residency figure (DeepSeek-V3.2, 60 GiB "
        "of KV, 32K: 38 instead of 140).",
    installed_by="plugin.register(), in every process vLLM starts",
    install_args="concurrency(vllm_config, kv_cache_config) -> the startup capacity report's "
                 "steady-state figure, or None for configs that do not name the connector",
    install=_install_capacity, installed=_capacity_installed, remove=_remove_capacity)


#: Every runtime patch of vLLM this package applies.
PATCHES: tuple[Patch, ...] = (PLANNER_HOOK, TOPK_CONVERSION_HOOK, DIRECT_CONVERSION_ROUTING,
                              LAYER_FORWARD_CONTEXT, CPU_DIRECT_CONVERSION, CPU_GROUP_CONVERSION,
                              CONFIG_CHECK, CAPACITY_LINE, LOCKSTEP_COORDINATOR)


def by_name(name: str) -> Patch:
    """The patch called ``name``; ``KeyError`` naming the known ones otherwise."""
    for patch in PATCHES:
        if patch.name == name:
            return patch
    raise KeyError(f"no vLLM patch named {name!r}; known: {[p.name for p in PATCHES]}")
