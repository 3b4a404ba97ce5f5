"""The runtime patches of vLLM's engine: the KV-cache planner hook, the scheduler's lockstep
coordinator, the config check and the startup capacity line."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.patches.lockstep import LockstepCoordinator, lockstep_groups
from vllm_hisparse.vllm.patches.record import ORIGINAL, Patch, is_ours, marked


# ------------------------------------------------------------------------ planner hook

_PLANNER = "planner_hook"


def _builder_lookup() -> Any:
    # The class attribute is a classmethod object; look in __dict__ to see the descriptor.
    return compat.Platform.__dict__["get_kv_cache_config_builder_cls"]


def _planner_installed() -> bool:
    return is_ours(_builder_lookup().__func__, _PLANNER)


def _install_planner(select_builder: Callable[[Any], str | None]) -> bool:
    """``select_builder(vllm_config)`` returns our builder's qualified name, or None to keep
    the platform's answer (every config that does not name the connector)."""
    original = _builder_lookup().__func__
    if is_ours(original, _PLANNER):
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
        marked(get_kv_cache_config_builder_cls, _PLANNER, original))
    return True


def _remove_planner() -> bool:
    wrapper = _builder_lookup().__func__
    if not is_ours(wrapper, _PLANNER):
        return False
    compat.Platform.get_kv_cache_config_builder_cls = classmethod(  # type: ignore[assignment]
        getattr(wrapper, ORIGINAL))
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
    install=_install_planner, installed=_planner_installed, remove=_remove_planner,
    extension_point="a connector classmethod naming the KV cache config builder for its configs "
                    "(KVConnectorBase_V1.get_kv_cache_config_builder(vllm_config)), consulted "
                    "before the platform's")



# ------------------------------------------------------------------------ lockstep groups

_LOCKSTEP = "lockstep_coordinator"


def _lockstep_installed(coordinator: Any) -> bool:
    return type(coordinator) is LockstepCoordinator


def _install_lockstep(coordinator: Any) -> bool:
    """Give the scheduler's coordinator object the lockstep class (it adds no state).
    Raises ``ValueError`` unless ``lockstep.lockstep_groups(coordinator)``."""
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
        "any (lockstep.py). Without it vLLM's scheduler step nearly doubles (docs/benchmarks.md, "
        "\"Scheduler cost against stock vLLM\").",
    installed_by="the scheduler role, when it binds the KV cache manager, if every group "
                 "moves in lockstep (lockstep.lockstep_groups)",
    install_args="coordinator (KVCacheManager.coordinator)",
    install=_install_lockstep, installed=_lockstep_installed, remove=_remove_lockstep,
    extension_point="a coordinator that runs per-request manager calls once for a set of KV cache "
                    "groups allocated, cached and freed together, chosen from KVCacheConfig")



# ------------------------------------------------------------------------ config check

_CONFIG_CHECK = "config_check"


def _config_post_init() -> Any:
    return compat.VllmConfig.__dict__["__post_init__"]


def _config_check_installed() -> bool:
    return is_ours(_config_post_init(), _CONFIG_CHECK)


def _install_config_check(check: Callable[[Any], None],
                          check_after: Callable[[Any], None] | None = None) -> bool:
    """``check(vllm_config)`` runs before vLLM's body, on the options as given;
    ``check_after(vllm_config)`` after it, on what vLLM resolved (async scheduling, the
    model runner, the hybrid KV cache manager, CUDA graph mode)."""
    original = _config_post_init()
    if is_ours(original, _CONFIG_CHECK):
        return False

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        # Before vLLM's body: it inspects MultiConnector children itself and fails with an
        # AttributeError on the malformed shapes our check names.
        check(self)
        original(self)
        if check_after is not None:
            check_after(self)

    compat.VllmConfig.__post_init__ = marked(__post_init__, _CONFIG_CHECK, original)
    return True


def _remove_config_check() -> bool:
    wrapper = _config_post_init()
    if not is_ours(wrapper, _CONFIG_CHECK):
        return False
    compat.VllmConfig.__post_init__ = getattr(wrapper, ORIGINAL)
    return True


CONFIG_CHECK = Patch(
    name=_CONFIG_CHECK,
    target="vllm.config.VllmConfig.__post_init__",
    why="vLLM gives a general plugin no hook between parsing the CLI and starting the engine "
        "processes, and kv_connector_extra_config is an untyped dict only the connector reads "
        "(in the engine core): without it a bad key or an unsupported option (pipeline "
        "parallel, no index_topk, a host pool smaller than one request, ...) kills `vllm "
        "serve` only after the weights loaded, far from its cause.",
    installed_by="plugin.register(), in every process vLLM starts",
    install_args="check(vllm_config) before vLLM's body and check_after(vllm_config) after "
                 "it, no-ops for configs that do not name the connector "
                 "(engine_checks.check_before_vllm / check_after_vllm)",
    install=_install_config_check, installed=_config_check_installed,
    remove=_remove_config_check,
    extension_point="a connector classmethod validate_config(vllm_config) that "
                    "VllmConfig.__post_init__ calls before and after it resolves options")



# ------------------------------------------------------------------------ capacity line

_CAPACITY = "capacity_line"


def _capacity_module() -> Any:
    return compat.max_concurrency_module()


def _capacity_installed() -> bool:
    return is_ours(getattr(_capacity_module(), compat.MAX_CONCURRENCY_NAME), _CAPACITY)


def _install_capacity(concurrency: Callable[[Any, Any], float | None]) -> bool:
    """``concurrency(vllm_config, kv_cache_config)`` returns the figure to report, or None
    to keep vLLM's (every config that does not name the connector)."""
    module = _capacity_module()
    original = getattr(module, compat.MAX_CONCURRENCY_NAME)
    if is_ours(original, _CAPACITY):
        return False

    @functools.wraps(original)
    def get_max_concurrency_for_kv_cache_config(vllm_config: Any, kv_cache_config: Any) -> float:
        ours = concurrency(vllm_config, kv_cache_config)
        return original(vllm_config, kv_cache_config) if ours is None else ours

    setattr(module, compat.MAX_CONCURRENCY_NAME,
            marked(get_max_concurrency_for_kv_cache_config, _CAPACITY, original))
    return True


def _remove_capacity() -> bool:
    module = _capacity_module()
    wrapper = getattr(module, compat.MAX_CONCURRENCY_NAME)
    if not is_ours(wrapper, _CAPACITY):
        return False
    setattr(module, compat.MAX_CONCURRENCY_NAME, getattr(wrapper, ORIGINAL))
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
    install=_install_capacity, installed=_capacity_installed, remove=_remove_capacity,
    extension_point="a connector classmethod reporting the maximum concurrency of a KVCacheConfig "
                    "(or a KVCacheConfig field for host-backed capacity) that "
                    "get_kv_cache_capacity reads")


