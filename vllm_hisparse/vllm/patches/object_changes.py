"""Every change this package makes to vLLM's objects other than the function patches of
:data:`~vllm_hisparse.vllm.patches.PATCHES`, in one table (:data:`OBJECT_CHANGES`).

A function patch replaces a vLLM function with a wrapper, and can be removed. The changes
here are the rest: attribute writes on vLLM objects (a manager's watermark, a group's role,
a scheduler output's flag, rows of a block table), the overrides of our subclasses of vLLM
internals (the residency-aware manager, the planner's builder, the lockstep coordinator),
an instance attribute that shadows a vLLM method, and the reads of vLLM state that is
private or internal (the factory registry, the manager registry, a manager's per-request
tables, a MultiConnector's constructor frame). Each is an :class:`ObjectChange` record:
what it touches and how, why, where in the package (``sites``), through which compat name,
and the public vLLM extension point that would make it unnecessary (the basis of the
"Upstream proposal" in docs/vllm-integration.md).

``check()`` verifies each record against the installed vLLM (each attribute still exists
in the form relied on); ``tests/vllm/test_object_changes.py`` runs it, and scans the
package source: every touch of a private vLLM name and every attribute write on a vLLM
object it finds is in this table (or in ``PATCHES``), and every record's sites really make
the change.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hisparse.vllm import compat

#: What a record does to its vLLM object.
ACTIONS = ("read", "write", "override", "replace")

_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory"
_REGISTRY = "vllm.v1.kv_cache_spec_registry"
_IFACE = "vllm.v1.kv_cache_interface"
_STM = "vllm.v1.core.single_type_kv_cache_manager"
_FULL = f"{_STM}.FullAttentionManager"
_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
_COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
_SCHED = "vllm.v1.core.sched"
_BASE = "vllm.distributed.kv_transfer.kv_connector.v1"
_PKG = "vllm_hisparse.vllm"


@dataclass(frozen=True)
class ObjectChange:
    """One change this package makes to a vLLM object (module docstring).

    Attributes:
        name: the table key.
        target: the vLLM object and attribute(s), in words.
        action: one of :data:`ACTIONS`: ``read`` (private or internal state read),
            ``write`` (an attribute of a vLLM object set), ``override`` (a subclass of a
            vLLM internal class redefines its methods or state), ``replace`` (an instance
            attribute shadows a vLLM method).
        why: what would not work without it.
        sites: the package modules (dotted) that make the change, directly or by calling
            ``compat``.
        names: the vLLM attribute names touched: what the source scan finds, and what a
            site that does not go through ``compat`` contains.
        compat: the ``compat`` names that make the change for the sites (empty: the sites
            touch the object themselves, e.g. a subclass's own methods).
        extension_point: the public vLLM extension point that would make it unnecessary.
        shapes: ``(owner, attribute, kind)`` checked against the installed vLLM
            (``compat.shape_problems``).
    """

    name: str
    target: str
    action: str
    why: str
    sites: tuple[str, ...]
    names: tuple[str, ...]
    compat: tuple[str, ...]
    extension_point: str
    shapes: tuple[tuple[str, str, str], ...]

    def check(self) -> list[str]:
        """What no longer holds in the installed vLLM (empty: the record still applies)."""
        problems = [] if self.action in ACTIONS else [f"{self.name}: unknown action {self.action!r}"]
        problems += [f"{self.name}: compat has no {c!r}" for c in self.compat if not hasattr(compat, c)]
        for owner, attribute, kind in self.shapes:
            problems += [f"{self.name}: {p}" for p in compat.shape_problems(owner, attribute, kind)]
        return problems


def _m(*modules: str) -> tuple[str, ...]:
    return tuple(f"{_PKG}.{m}" if not m.startswith("vllm_hisparse.") else m for m in modules)


# ------------------------------------------------------------------ engine start

CONNECTOR_REGISTRY = ObjectChange(
    name="connector_registry",
    target="KVConnectorFactory._registry (connector name -> lazy loader), read",
    action="read",
    why="register_connector raises on a name already registered and the factory has no "
        "public query; the plugin registers in every process vLLM starts (and the baseline "
        "benchmarks register theirs), so registration must be idempotent.",
    sites=_m("plugin", "vllm_hisparse.cli.benchmarks.vllm_baselines"),
    names=("_registry",),
    compat=("connector_is_registered", "register_connector"),
    extension_point="KVConnectorFactory.is_registered(name), or register_connector accepting "
                    "a second registration of the identical entry",
    shapes=((_FACTORY, "_registry", "class"), (_FACTORY, "register_connector", "callable")))

PLANNER_BUILDER = ObjectChange(
    name="planner_builder",
    target="DefaultKVCacheConfigBuilder.get_kv_cache_groups / get_kv_cache_config_from_groups, "
           "overridden by HiSparseKVCacheConfigBuilder",
    action="override",
    why="the split (sparse-MLA apart from indexer layers, equal bytes per block) is a "
        "different grouping of the same specs; vLLM's builder classes are the only planner "
        "interface, and internal.",
    sites=_m("setup.kv_planner"),
    names=("get_kv_cache_groups", "get_kv_cache_config_from_groups"),
    compat=("DefaultKVCacheConfigBuilder",),
    extension_point="a KV cache config builder a connector names (the planner_hook's "
                    "classmethod), with a documented, stable builder base class",
    shapes=(("vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder", "get_kv_cache_groups",
             "callable"),
            ("vllm.v1.core.kv_cache_planning.DefaultKVCacheConfigBuilder",
             "get_kv_cache_config_from_groups", "callable")))

V2_RUNNER_REASONS = ObjectChange(
    name="v2_runner_reasons",
    target="VllmConfig._get_v2_model_runner_unsupported_features(), called",
    action="read",
    why="the config check names why vLLM fell back to the V1 model runner (which the "
        "worker role cannot bind); vLLM keeps the reasons in a private method.",
    sites=_m("setup.engine_checks"),
    names=("_get_v2_model_runner_unsupported_features",),
    compat=("v2_model_runner_unsupported_features",),
    extension_point="a public VllmConfig query (or logged field) giving the model runner "
                    "chosen and why",
    shapes=(("vllm.config.VllmConfig", "_get_v2_model_runner_unsupported_features", "callable"),))

MULTI_CONNECTOR_FRAME = ObjectChange(
    name="multi_connector_frame",
    target="MultiConnector.__init__'s frame (its vllm_config argument), read from the stack "
           "of a child connector's constructor",
    action="read",
    why="MultiConnector builds each child with a copy of the config holding only that child's "
        "entry; the top-level kv_load_failure_policy (the one vLLM's scheduler applies) and "
        "the siblings (a NixlConnector for P/D) are visible only in the parent's frame.",
    sites=_m("pd.landings", "pd.reads", "scheduler_side.geometry"),
    names=("f_locals",),
    compat=("composing_kv_transfer_config", "kv_load_failure_policy"),
    extension_point="MultiConnector hands each child the composing kv_transfer_config "
                    "(siblings, order, top-level settings), e.g. a parent_kv_transfer_config "
                    "argument or attribute",
    shapes=((f"{_BASE}.multi_connector.MultiConnector", "__init__",
             "source:self._get_connector_classes_and_configs("),
            ("vllm.config.KVTransferConfig", "kv_load_failure_policy", "field")))

# ------------------------------------------------------------------ scheduler side

RESIDENCY_MANAGER_REGISTRY = ObjectChange(
    name="residency_manager_registry",
    target="KVCacheSpecRegistry: _ensure_registered() called and the role -> manager map "
           "(_REGISTRY_ROLE_MANAGERS) written through register_role_manager and read",
    action="write",
    why="the sparse-MLA groups get ResidencyAwareManager through a group role; vLLM's "
        "built-in registrations run lazily on first lookup, so they are triggered first (ours "
        "must not count as 'already populated').",
    sites=_m("scheduler_side.role"),
    names=("_ensure_registered", "_REGISTRY_ROLE_MANAGERS"),
    compat=("register_residency_manager", "residency_manager_registered"),
    extension_point="a connector names the manager class of the group roles its plan uses "
                    "(KVConnectorBase_V1.get_kv_cache_manager_cls(group)), registered by vLLM",
    shapes=((f"{_REGISTRY}.KVCacheSpecRegistry", "_ensure_registered", "callable"),
            (f"{_REGISTRY}.KVCacheSpecRegistry", "register_role_manager", "callable"),
            (_REGISTRY, "_REGISTRY_ROLE_MANAGERS", "module")))

RESIDENCY_GROUP_ROLE = ObjectChange(
    name="residency_group_role",
    target="KVCacheGroupSpec.role of the scheduler's kv_cache_config groups, written",
    action="write",
    why="selects ResidencyAwareManager for the sparse-MLA groups (and, unbound, for every "
        "other plain full-attention group); must happen in the connector's constructor, "
        "before Scheduler.__init__ builds the KVCacheManager from the same config object.",
    sites=_m("scheduler_side.role"),
    names=("role",),
    compat=("assign_group_role",),
    extension_point="the KV cache config builder sets the roles of the groups it plans "
                    "(with the builder extension point, ours would), and vLLM builds the "
                    "manager the connector names for the role",
    shapes=((f"{_IFACE}.KVCacheGroupSpec", "role", "field"),
            (_COORDINATOR, "role", "source:role=kv_cache_group.role")))

OFFLOADING_SCOPE = ObjectChange(
    name="offloading_scope",
    target="KVCacheConfig.hisparse_host_num_blocks and KVCacheGroupSpec.role = "
           "HISPARSE_INDEXER of the indexer groups, written",
    action="write",
    why="vLLM's OffloadingConnector (a MultiConnector sibling) offloads every prefix-cacheable "
        "group unless these fields scope it; with them it offloads only the indexer groups "
        "and the scheduler defers async loads into reused blocks.",
    sites=_m("setup.offloading_scope"),
    names=("hisparse_host_num_blocks", "role"),
    compat=("scope_offloading",),
    extension_point="a per-connector group scope in KVCacheConfig: which groups each "
                    "MultiConnector child handles",
    shapes=((f"{_IFACE}.KVCacheConfig", "hisparse_host_num_blocks", "field"),
            (f"{_IFACE}.KVCacheGroupRole", "HISPARSE_INDEXER", "class"),
            (f"{_BASE}.offloading.config.get_offloading_group_ids", "hisparse_host_num_blocks",
             "source:hisparse_host_num_blocks")))

ADMISSION_WATERMARK = ObjectChange(
    name="admission_watermark",
    target="KVCacheManager.watermark_blocks, read at bind and written before each waiting "
           "request's allocation",
    action="write",
    why="admission headroom: a waiting request is admitted only if the device pool keeps "
        "room for the hot regions and restores the running requests need; vLLM reads the "
        "watermark at every allocate_slots call for WAITING / PREEMPTED requests.",
    sites=_m("scheduler_side.admission"),
    names=("watermark_blocks",),
    compat=("admission_watermark_blocks", "set_admission_watermark_blocks"),
    extension_point="a connector query for the free blocks an admission must leave over "
                    "(KVConnectorBase_V1.get_admission_reserve_blocks(request)), added to "
                    "vLLM's watermark in allocate_slots",
    shapes=((_MANAGER, "watermark_blocks", "instance"),
            (f"{_MANAGER}.allocate_slots", "watermark_blocks", "source:self.watermark_blocks")))

MANAGER_TABLES = ObjectChange(
    name="manager_tables",
    target="FullAttentionManager.pop_blocks_for_free / allocate_external_computed_blocks "
           "overridden by ResidencyAwareManager, which edits the per-request state "
           "req_to_blocks, num_cached_block, _partial_hit_reqs and uses _null_block",
    action="override",
    why="the residency policy owns the leases of adopted pages: vLLM must free only the "
        "blocks it still owns, a page whose block was reused becomes the null block, a "
        "restored page gets its new block, and a P/D host landing leaves its pages null.",
    sites=_m("scheduler_side.managers"),
    names=("pop_blocks_for_free", "allocate_external_computed_blocks", "req_to_blocks",
           "num_cached_block", "_partial_hit_reqs", "_null_block"),
    compat=("FullAttentionManager",),
    extension_point="SingleTypeKVCacheManager hooks: on_free(request_id, blocks) with the "
                    "table as it is (nulls included), replace_block(request_id, page, block), "
                    "skip_blocks(request_id, num_pages), and a public blocks_of(request_id)",
    shapes=((_FULL, "pop_blocks_for_free", "callable"),
            (_FULL, "allocate_external_computed_blocks", "callable"),
            (_FULL, "req_to_blocks", "instance"), (_FULL, "num_cached_block", "instance"),
            (_FULL, "_partial_hit_reqs", "instance"), (_FULL, "_null_block", "instance")))

MANAGER_LONGER_HIT = ObjectChange(
    name="manager_longer_hit",
    target="SingleTypeKVCacheManager.retains_longer_hit, set per ResidencyAwareManager "
           "instance",
    action="write",
    why="the sparse-MLA groups keep their own (longer) device prefix hit, so a connector "
        "loading past the shared hit gets their cached blocks back (OffloadingConnector next "
        "to us, host-prefix loads).",
    sites=_m("scheduler_side.managers"),
    names=("retains_longer_hit",),
    compat=(),
    extension_point="already a vLLM hook (a class attribute read when the KVCacheManager is "
                    "built); public would be a per-group flag in KVCacheGroupSpec",
    shapes=((f"{_STM}.SingleTypeKVCacheManager", "retains_longer_hit", "class"),
            (_MANAGER, "retains_longer_hit", "source:retains_longer_hit")))

MANAGER_ALLOCATION_COUNT = ObjectChange(
    name="manager_allocation_count",
    target="get_num_blocks_to_allocate of a ResidencyAwareManager instance, shadowed by an "
           "instance attribute while a P/D host landing is offered",
    action="replace",
    why="a P/D request landing in the host tier needs device blocks for its tail only; vLLM "
        "must count that in its allocation check. Shadowing only while an offer is pending "
        "keeps the method call of every other step vLLM's.",
    sites=_m("scheduler_side.managers"),
    names=("get_num_blocks_to_allocate",),
    compat=(),
    extension_point="the skip_blocks(request_id, num_pages) hook of manager_tables, counted "
                    "by get_num_blocks_to_allocate",
    shapes=((_FULL, "get_num_blocks_to_allocate", "callable"),))

BLOCK_TABLE_READS = ObjectChange(
    name="block_table_reads",
    target="KVCacheManager.coordinator.single_type_managers and each manager's req_to_blocks "
           "(the per-request block tables), read",
    action="read",
    why="the scheduler role and the host-prefix cache read the blocks vLLM allocated to a "
        "request in each sparse and indexer group (adoption, host-prefix loads), which "
        "KVCacheManager does not expose per group.",
    sites=_m("scheduler_side.role", "scheduler_side.host_prefix"),
    names=("req_to_blocks", "single_type_managers", "coordinator"),
    compat=("group_managers", "kv_cache_coordinator"),
    extension_point="a public per-group block query on the manager "
                    "(KVCacheManager.get_block_ids(request_id) per group, or blocks_of)",
    shapes=((_MANAGER, "coordinator", "instance"),
            (f"{_COORDINATOR}.KVCacheCoordinator", "single_type_managers", "instance"),
            (_FULL, "req_to_blocks", "instance")))

PREFIX_CACHE_READS = ObjectChange(
    name="prefix_cache_reads",
    target="KVCacheManager.enable_caching, BlockPool.hash_block_size and "
           "HybridKVCacheCoordinator.find_longest_cache_hit_per_group, read / called",
    action="read",
    why="host-prefix hits start where each group's own device hit ends, in units of vLLM's "
        "hash blocks.",
    sites=_m("scheduler_side.host_prefix"),
    names=("enable_caching", "hash_block_size", "find_longest_cache_hit_per_group"),
    compat=("prefix_cache_geometry", "per_group_prefix_hits"),
    extension_point="a KVCacheManager query for each group's own prefix hit, and the hash "
                    "geometry in KVCacheConfig",
    shapes=((_MANAGER, "enable_caching", "instance"),
            ("vllm.v1.core.block_pool.BlockPool", "hash_block_size", "instance"),
            (f"{_COORDINATOR}.HybridKVCacheCoordinator", "find_longest_cache_hit_per_group",
             "callable")))

LOCKSTEP_INTERNALS = ObjectChange(
    name="lockstep_internals",
    target="HybridKVCacheCoordinator's get_num_blocks_to_allocate / allocate_new_blocks / "
           "cache_blocks / remove_skipped_blocks overridden by LockstepCoordinator, which reads "
           "the coordinator's and managers' state",
    action="override",
    why="the lockstep_coordinator patch puts this class on the scheduler's coordinator; it "
        "answers lockstep decode steps from the first group alone, from vLLM's own state.",
    sites=_m("patches.lockstep"),
    names=("get_num_blocks_to_allocate", "allocate_new_blocks", "cache_blocks",
           "remove_skipped_blocks", "single_type_managers", "req_to_blocks", "num_cached_block",
           "hash_block_size", "drop_eagle_group_ids", "enable_partial_hash_hits", "use_eagle"),
    compat=("hybrid_coordinator_class", "FullAttentionManager"),
    extension_point="the lockstep_coordinator patch's: a coordinator for KV cache groups "
                    "allocated, cached and freed together, chosen from KVCacheConfig",
    shapes=((f"{_COORDINATOR}.HybridKVCacheCoordinator", "hash_block_size", "instance"),
            (f"{_COORDINATOR}.HybridKVCacheCoordinator", "enable_partial_hash_hits", "instance"),
            (f"{_COORDINATOR}.KVCacheCoordinator", "drop_eagle_group_ids", "instance"),
            (_FULL, "use_eagle", "instance"), (_FULL, "num_cached_block", "instance")))

LOAD_BEFORE_FORWARD = ObjectChange(
    name="load_before_forward",
    target="SchedulerOutput.has_sync_kv_loads, set on every step that runs a forward",
    action="write",
    why="the worker must apply the step's residency command (restores, hot-region copies) "
        "before the forward reads KV; vLLM's V2 model runner calls start_load_kv before the "
        "forward only for steps with synchronous loads.",
    sites=_m("scheduler_side.role"),
    names=("has_sync_kv_loads",),
    compat=("request_load_before_forward",),
    extension_point="a connector query the model runner asks each step: whether "
                    "start_load_kv must run before the forward "
                    "(KVConnectorBase_V1.loads_before_forward(scheduler_output))",
    shapes=((f"{_SCHED}.output.SchedulerOutput", "has_sync_kv_loads", "field"),))

CONNECTOR_METADATA = ObjectChange(
    name="connector_metadata",
    target="KVConnectorBase_V1._get_connector_metadata(), called by our connector",
    action="read",
    why="the worker role needs the step's bound metadata; the base class keeps the accessor "
        "private.",
    sites=_m("connector"),
    names=("_get_connector_metadata",),
    compat=("KVConnectorBase_V1",),
    extension_point="a public get_connector_metadata() on KVConnectorBase_V1",
    shapes=((f"{_BASE}.base.KVConnectorBase_V1", "_get_connector_metadata", "callable"),))

PROM_METRIC_CLASSES = ObjectChange(
    name="prom_metric_classes",
    target="KVConnectorPromMetrics._counter_cls / _gauge_cls, read by our Prometheus metrics",
    action="read",
    why="vLLM picks the metric classes per engine (multiprocess or not); our connector's "
        "metrics must be made with the same ones.",
    sites=_m("metrics"),
    names=("_counter_cls", "_gauge_cls"),
    compat=("KVConnectorPromMetrics",),
    extension_point="public metric factories on KVConnectorPromMetrics (make_counter, "
                    "make_gauge)",
    shapes=((f"{_BASE}.metrics.KVConnectorPromMetrics", "_counter_cls", "instance"),
            (f"{_BASE}.metrics.KVConnectorPromMetrics", "_gauge_cls", "instance")))

# ------------------------------------------------------------------ worker side

PREFILL_BLOCK_TABLE_ROWS = ObjectChange(
    name="prefill_block_table_rows",
    target="rows of the sparse groups' batch block table (SparseMLACommonMetadata.block_table) "
           "of host-backed prefilling requests, rewritten in place",
    action="write",
    why="vLLM's worker block table is append-only and misses restores into new blocks; a "
        "prefill reads the whole context through it, so its rows must name the blocks the "
        "residency tables name (requirement R1, docs/worker.md).",
    sites=_m("worker_side.prefill_guard"),
    names=("block_table",),
    compat=("attention_block_table",),
    extension_point="a connector hook that edits a request's block-table row before the "
                    "forward (KVConnectorBase_V1.adjust_block_table(...)), or a "
                    "device-resident block-table field per KV group that the connector owns",
    shapes=(("vllm.model_executor.layers.attention.sparse_mla_attention.SparseMLACommonMetadata",
             "block_table", "field"),))

LAYER_INDEX_GROUP = ObjectChange(
    name="layer_index_group",
    target="MLAAttention.impl.index_group / index_group_index of each sparse-MLA layer, read",
    action="read",
    why="the worker role binds each index group (one hot-slot state) and its layers; vLLM "
        "sets the group on the layer's impl at construction and exposes it nowhere else.",
    sites=_m("worker_side.lanes"),
    names=("index_group", "index_group_index"),
    compat=("layer_index_group",),
    extension_point="the pluggable top-k translator per index group (topk_conversion_hook's "
                    "extension point), given the group's layers",
    shapes=(("vllm.model_executor.layers.attention.sparse_mla_attention.SparseMLACommonImpl",
             "index_group", "instance"),
            ("vllm.model_executor.layers.attention.sparse_mla_attention.SparseMLACommonImpl",
             "index_group_index", "instance")))

INDEX_GROUP_SIDE_STREAM = ObjectChange(
    name="index_group_side_stream",
    target="SparseMLAIndexGroup.side_stream / logical_topk_ready / has_indexer, read",
    action="read",
    why="a leader's residency conversion replaces vLLM's group conversion, which vLLM runs on "
        "the group's side stream from the indexer's ready event so that it overlaps the "
        "layer's KV write and query projection; ours runs there too, or it would add its "
        "whole time to every layer (worker_side/conversion_stream.py).",
    sites=_m("worker_side.lanes"),
    names=("side_stream", "logical_topk_ready", "has_indexer"),
    compat=("index_group_conversion_stream",),
    extension_point="the pluggable top-k translator per index group (topk_conversion_hook's "
                    "extension point), called on the stream and after the event vLLM's own "
                    "conversion uses",
    shapes=(("vllm.v1.attention.backends.mla.index_group.SparseMLAIndexGroup", "side_stream",
             "field"),
            ("vllm.v1.attention.backends.mla.index_group.SparseMLAIndexGroup",
             "logical_topk_ready", "field"),
            ("vllm.v1.attention.backends.mla.index_group.SparseMLAIndexGroup", "has_indexer",
             "field"),
            ("vllm.forward_context", "in_piecewise_cudagraph", "callable")))

# ------------------------------------------------------------------ simulator and benchmarks

OFFLINE_ENGINE_CONFIG = ObjectChange(
    name="offline_engine_config",
    target="fields of a VllmConfig the simulator or a benchmark built itself: "
           "cache_config.num_gpu_blocks(_override) / kv_cache_layout, "
           "scheduler_config.disable_hybrid_kv_cache_manager, kv_transfer_config, "
           "attention_config.hisparse_config, parallel_config.rank",
    action="write",
    why="the CPU simulator and the scheduler benchmarks stand in for vLLM's engine core, "
        "which sets these on its own config (block count after profiling, the platform's "
        "choices, one config per rank).",
    sites=_m("simulation.engine", "simulation.model", "simulation.ranks",
             "simulation.scheduler_driver", "vllm_hisparse.cli.benchmarks.vllm_baselines"),
    names=("num_gpu_blocks", "num_gpu_blocks_override", "kv_cache_layout",
           "disable_hybrid_kv_cache_manager", "kv_transfer_config", "hisparse_config", "rank"),
    compat=(),
    extension_point="none for serving (the engine core does this itself)",
    shapes=(("vllm.config.CacheConfig", "num_gpu_blocks", "field"),
            ("vllm.config.CacheConfig", "num_gpu_blocks_override", "field"),
            ("vllm.config.CacheConfig", "kv_cache_layout", "field"),
            ("vllm.config.SchedulerConfig", "disable_hybrid_kv_cache_manager", "field"),
            ("vllm.config.VllmConfig", "kv_transfer_config", "field"),
            ("vllm.config.attention.AttentionConfig", "hisparse_config", "field"),
            ("vllm.config.ParallelConfig", "rank", "field")))

REQUEST_MAX_TOKENS = ObjectChange(
    name="request_max_tokens",
    target="Request.max_tokens of a running request, written (bench throughput)",
    action="write",
    why="the throughput benchmark decides when each cohort of its batch leaves.",
    sites=_m("vllm_hisparse.cli.benchmarks.throughput_probe"),
    names=("max_tokens",),
    compat=("set_request_max_tokens",),
    extension_point="none for serving (benchmarks only)",
    shapes=(("vllm.v1.request.Request", "max_tokens", "instance"),))

PREFIX_LOOKUP_COUNTER = ObjectChange(
    name="prefix_lookup_counter",
    target="Scheduler._get_local_prefix_cache_hit of a benchmark's scheduler instance, "
           "shadowed by a counting wrapper",
    action="replace",
    why="the shared-prefix benchmark counts vLLM's device prefix lookups.",
    sites=_m("vllm_hisparse.cli.benchmarks.shared_prefix"),
    names=("_get_local_prefix_cache_hit",),
    compat=(),
    extension_point="none for serving (a benchmark); upstream, a prefix-cache lookup counter "
                    "in the scheduler's stats",
    shapes=((f"{_SCHED}.scheduler.Scheduler", "_get_local_prefix_cache_hit", "callable"),))

#: Every change this package makes to vLLM's objects besides the function patches.
OBJECT_CHANGES: tuple[ObjectChange, ...] = (
    CONNECTOR_REGISTRY, PLANNER_BUILDER, V2_RUNNER_REASONS, MULTI_CONNECTOR_FRAME,
    RESIDENCY_MANAGER_REGISTRY, RESIDENCY_GROUP_ROLE, OFFLOADING_SCOPE, ADMISSION_WATERMARK,
    MANAGER_TABLES, MANAGER_LONGER_HIT, MANAGER_ALLOCATION_COUNT, BLOCK_TABLE_READS,
    PREFIX_CACHE_READS, LOCKSTEP_INTERNALS, LOAD_BEFORE_FORWARD, CONNECTOR_METADATA,
    PROM_METRIC_CLASSES, PREFILL_BLOCK_TABLE_ROWS, LAYER_INDEX_GROUP, INDEX_GROUP_SIDE_STREAM,
    OFFLINE_ENGINE_CONFIG,
    REQUEST_MAX_TOKENS, PREFIX_LOOKUP_COUNTER)


def check() -> list[str]:
    """Every problem of every record against the installed vLLM (empty: all still apply)."""
    return [problem for change in OBJECT_CHANGES for problem in change.check()]


def object_change(name: str) -> ObjectChange:
    """The record called ``name``; ``KeyError`` naming the known ones otherwise."""
    for change in OBJECT_CHANGES:
        if change.name == name:
            return change
    raise KeyError(f"no object change named {name!r}; known: {[c.name for c in OBJECT_CHANGES]}")
