"""Parse and validate the connector's ``kv_connector_extra_config`` against the engine.

Every problem is reported at startup as a ``HiSparseConfigError`` (a ``ValueError``)
whose message names the offending key or option and what is accepted. Nothing here
changes vLLM state. Two entry points:

* ``check_extra_config(vllm_config)`` validates what needs no engine facts (keys, types,
  ranges, the host budget against this machine's memory, the shape of a MultiConnector
  entry). The plugin runs it when vLLM builds a ``VllmConfig`` (``patches.CONFIG_CHECK``), so
  ``vllm serve`` fails in the API-server process, before any engine process starts.
* ``engine_checks.resolve_config(vllm_config)`` is the one parse: the above plus the engine
  facts (``top_k``, ``block_size``, speculative tokens) and engine compatibility (the checks
  ``engine_checks.py`` also runs while the ``VllmConfig`` is built).
  The planner calls it once per planning and the connector once per role; the roles get
  the result.

The keys (all per data-parallel replica), their meaning and defaults: README.md, "Use", and
docs/vllm-integration.md, "Configuration keys"; ``ACCEPTED_KEYS`` below is the list the
parser accepts.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hisparse.core.capacity import host_memory_limit
from vllm_hisparse.core.host_layout import HOST_LAYOUT_CHOICES
from vllm_hisparse.core.hot_sizing import HotSizingConfig
from vllm_hisparse.core.units import GIB, cdiv
from vllm_hisparse.vllm.compat import VllmConfig
from vllm_hisparse.vllm.setup.connector_entries import ConnectorEntry, connector_entries
# The default grid cap of the followers' copies (its docstring says why 16).
from vllm_hisparse.worker.hot_state import DEFAULT_LEADER_CTAS_PER_SM, DEFAULT_SIDE_MAX_CTAS

#: The ``kv_connector`` name of this package's connector. Deliberately NOT
#: ``HiSparseConnector``: that literal name switches on vLLM's in-tree HiSparse.
CONNECTOR_NAME = "HiSparseResidencyConnector"

#: Module the factory imports the connector class from.
CONNECTOR_MODULE = "vllm_hisparse.connector"

#: Qualified name of our KV cache config builder, which the planner hook hands to vLLM.
BUILDER_QUALNAME = "vllm_hisparse.vllm.setup.kv_planner.HiSparseKVCacheConfigBuilder"

#: Upper bound on hot rows per request: the resolver keeps a request's slot state
#: (int32 position + int16 LRU rank per slot) in on-chip shared memory.
MAX_DEVICE_BUFFER_ROWS = 32768

OPS_BACKENDS = ("auto", "cuda", "reference")
#: ``hot_region_eviction``: which hot slot a miss takes. ``lru``: the least recently used;
#: ``score``: the slot whose position the indexer scored lowest this step, least recent
#: among equals (docs/core.md, "Beyond LRU: score-aware eviction").
HOT_REGION_EVICTIONS = ("lru", "score")

ACCEPTED_KEYS = ("host_pool_gib", "device_buffer_size", "eager_host_mirror", "ops_backend", "record_trace",
                 "index_share_prefetch", "prefetch_max_ctas", "ack_deadline_s", "adaptive_hot_region",
                 "hot_region_target_miss_rate", "hot_region_eviction", "host_layout",
                 "gather_ctas_per_sm", "overlap_conversion")

#: Default ``hot_region_target_miss_rate``: about the miss rate of a fixed region of
#: ``2 * top_k`` rows on the synthetic replay trace (docs/core.md, "Per-request hot size").
DEFAULT_HOT_REGION_TARGET_MISS_RATE = 0.1

#: Upper bound of ``prefetch_max_ctas``: larger grids than this are never useful.
MAX_PREFETCH_CTAS = 4096
#: Upper bound of ``gather_ctas_per_sm`` (the kernel's default grid is 4 per SM).
MAX_GATHER_CTAS_PER_SM = 32

#: How deep MultiConnector entries may nest (vLLM builds each level's children itself;
#: deeper is a generated or looping config, not a deployment).
MAX_MULTI_CONNECTOR_DEPTH = 4

#: Default ``ack_deadline_s``: far above any copy's time (a full host pool over PCIe
#: takes seconds), short enough that a silent worker is named within a minute.
DEFAULT_ACK_DEADLINE_S = 60.0
#: Upper bound of ``ack_deadline_s`` (one day).
MAX_ACK_DEADLINE_S = 86400.0


class HiSparseConfigError(ValueError):
    """The engine or connector configuration cannot run HiSparseResidencyConnector."""


@dataclass(frozen=True)
class HiSparseResidencyConfig:
    """The validated connector configuration, with the engine facts it depends on."""

    host_pool_gib: float
    """Pinned host budget per data-parallel replica, GiB."""
    device_buffer_size: int
    """Hot rows per request (``D`` in docs/design.md, "Layouts"), a multiple of ``block_size``."""
    eager_host_mirror: bool
    ops_backend: str
    record_trace: str | None
    index_share_prefetch: bool
    """Followers' copies on a side stream (``GroupGather`` mode ``side``), else ``single``."""
    prefetch_max_ctas: int
    """Grid cap of the followers' copies, in CTAs (0 = none)."""
    gather_ctas_per_sm: int
    """Grid of the leader's gather (the critical path), CTAs per SM (0 = the kernel's)."""
    top_k: int
    """Positions the model's indexer selects per query token (``index_topk``)."""
    block_size: int
    """Tokens per KV page (vLLM block)."""
    max_decode_query_len: int
    """Query tokens of one request in a decode step: 1 + speculative tokens."""
    ack_deadline_s: float = DEFAULT_ACK_DEADLINE_S
    """Seconds a transfer may stay without every worker's final ack."""
    adaptive_hot_region: bool = False
    """Per-request hot sizes from the miss rate (``core/hot_regions.py``)."""
    hot_region_target_miss_rate: float = DEFAULT_HOT_REGION_TARGET_MISS_RATE
    hot_region_eviction: str = "lru"
    """Victim order of the hot slots (:data:`HOT_REGION_EVICTIONS`)."""
    overlap_conversion: bool = True
    """Each leader's conversion on its index group's side stream, from the indexer's ready
    event, where vLLM runs its own (``worker_side/conversion_stream.py``); else on the
    compute stream."""
    host_layout: str = "auto"
    """Host pool layout (:data:`~vllm_hisparse.core.host_layout.HOST_LAYOUT_CHOICES`);
    ``auto`` decides per geometry (:func:`~vllm_hisparse.core.host_layout.choose_host_layout`)."""

    @property
    def host_pool_bytes(self) -> int:
        return int(self.host_pool_gib * GIB)

    @property
    def hot_blocks_per_request(self) -> int:
        """Device blocks one request's hot region leases in each sparse-MLA group."""
        return self.device_buffer_size // self.block_size

    @property
    def hot_table_rows(self) -> int:
        """Width D of the worker's hot tables: the largest region a request may hold
        (``device_buffer_size``; twice that, capped, with ``adaptive_hot_region``)."""
        if not self.adaptive_hot_region:
            return self.device_buffer_size
        cap = MAX_DEVICE_BUFFER_ROWS // self.block_size * self.block_size
        return max(self.device_buffer_size, min(2 * self.device_buffer_size, cap))

    def hot_sizing(self) -> HotSizingConfig | None:
        """The adaptive sizing rule, or None without ``adaptive_hot_region``: regions of
        ``ceil(q * top_k / block_size)`` blocks (one step's selections must fit) to
        ``hot_table_rows`` rows."""
        if not self.adaptive_hot_region:
            return None
        return HotSizingConfig(
            block_size=self.block_size,
            min_blocks=max(1, cdiv(self.max_decode_query_len * self.top_k, self.block_size)),
            max_blocks=self.hot_table_rows // self.block_size,
            target_miss_rate=self.hot_region_target_miss_rate)


# --------------------------------------------------------------------------------------
# Finding our entry in kv_transfer_config
# --------------------------------------------------------------------------------------


def _raise_malformed(where: str, problem: str, accepted: str) -> None:
    raise HiSparseConfigError(
        f"kv_transfer_config: {where} {problem}; accepted: {accepted} (checked by "
        f"vllm_hisparse while looking for {CONNECTOR_NAME})."
    )


def find_connector_entry(vllm_config: VllmConfig) -> ConnectorEntry | None:
    """Our entry of ``kv_transfer_config`` (top level or a MultiConnector child), or None.

    Raises if the connector is configured more than once (one engine has one KV residency
    policy), if a MultiConnector entry on the way is malformed, or if our extra config is
    not an object."""
    kv_transfer_config = vllm_config.kv_transfer_config
    if kv_transfer_config is None:
        return None
    # A malformed MultiConnector entry would otherwise surface as an AttributeError deep
    # in vLLM: each gets a named error here, with its path.
    entries = [entry for entry in connector_entries(
        kv_transfer_config.kv_connector, kv_transfer_config.kv_connector_extra_config,
        on_malformed=_raise_malformed, max_depth=MAX_MULTI_CONNECTOR_DEPTH,
    ) if entry.name == CONNECTOR_NAME]
    if len(entries) > 1:
        raise HiSparseConfigError(
            f"kv_transfer_config lists {CONNECTOR_NAME} {len(entries)} times; "
            "accepted: exactly one entry (top level or one MultiConnector child)."
        )
    if not entries:
        return None
    if not isinstance(entries[0].extra, Mapping):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: kv_connector_extra_config must be a JSON object; "
            f"got {type(entries[0].extra).__name__}."
        )
    return entries[0]


def find_connector_extra_config(vllm_config: VllmConfig) -> dict | None:
    """Our ``kv_connector_extra_config`` (a copy), or None (:func:`find_connector_entry`)."""
    entry = find_connector_entry(vllm_config)
    return None if entry is None else dict(entry.extra)


def is_connector_configured(vllm_config: VllmConfig) -> bool:
    """Whether this engine's kv_transfer_config names ``HiSparseResidencyConnector``."""
    return find_connector_extra_config(vllm_config) is not None


# --------------------------------------------------------------------------------------
# Extra-config parsing (pure)
# --------------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    # bool is an int subclass; `"host_pool_gib": true` is a typo, not 1 GiB.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_unknown_keys(extra: Mapping[str, Any]) -> None:
    for key in extra:
        if key in ACCEPTED_KEYS:
            continue
        hint = difflib.get_close_matches(str(key), ACCEPTED_KEYS, n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: unknown kv_connector_extra_config key {key!r}"
            f"{did_you_mean}; accepted keys: {', '.join(ACCEPTED_KEYS)}."
        )


def _parse_host_pool_gib(extra: Mapping[str, Any]) -> float:
    if "host_pool_gib" not in extra:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: kv_connector_extra_config key 'host_pool_gib' is "
            "required; accepted: a number > 0 (GiB of pinned host memory per "
            "data-parallel replica)."
        )
    value = extra["host_pool_gib"]
    # Ints first: math.isfinite(10**400) itself raises OverflowError.
    if not _is_number(value) or value <= 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: host_pool_gib={value!r} is invalid; accepted: a "
            "finite number > 0 (GiB of pinned host memory per data-parallel replica)."
        )
    _check_host_pool_fits_memory(value)
    return float(value)


#: Environment variable that states the deployment node's memory (GiB) for the check below,
#: so a config can be validated on a smaller machine (a laptop, CI). The workers still pin
#: the pool for real: a pool larger than the node fails there.
ENV_HOST_MEMORY_GIB = "VLLM_HISPARSE_HOST_MEMORY_GIB"


def _check_host_pool_fits_memory(host_pool_gib: float | int) -> None:
    """Refuse a budget larger than this machine's RAM or memory cgroup can ever pin.

    Checked against the smaller of the two, or against ``VLLM_HISPARSE_HOST_MEMORY_GIB``
    when set; a budget that passes may still be too large with several replicas or private
    per-rank pools on one node (the worker's pinning then fails with its own message)."""
    stated = os.environ.get(ENV_HOST_MEMORY_GIB, "").strip()
    if stated:
        try:
            limit_gib = float(stated)
        except ValueError:
            limit_gib = math.nan
        if not math.isfinite(limit_gib) or limit_gib <= 0:
            raise HiSparseConfigError(
                f"{ENV_HOST_MEMORY_GIB}={stated!r} is invalid; accepted: a finite number > 0 "
                "(GiB of memory of the node that will serve this config), or unset.")
        limit_bytes, described = int(limit_gib * GIB), f"{ENV_HOST_MEMORY_GIB}={stated}"
    else:
        limit = host_memory_limit()
        if limit.limit_bytes is None:
            return
        limit_bytes, described = limit.limit_bytes, limit.describe()
    # int/float comparison is exact in Python (no overflow for 10**400).
    if host_pool_gib > limit_bytes / GIB:
        try:
            shown = f"{host_pool_gib:g}"
        except OverflowError:  # an int beyond float range
            shown = f"<an integer of {len(str(host_pool_gib))} digits>"
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: host_pool_gib={shown} is more than this machine can pin "
            f"({described}); accepted: host_pool_gib <= {limit_bytes / GIB:.2f} (GiB of pinned "
            "host memory per data-parallel replica, on every node that runs one). To validate "
            f"a config for a larger node here, set {ENV_HOST_MEMORY_GIB} to that node's memory "
            "in GiB."
        )


def default_device_buffer_size(top_k: int, block_size: int, max_decode_query_len: int) -> int:
    """``(max_decode_query_len + 1) * top_k`` rounded up to whole blocks.

    One step's selections need at most ``max_decode_query_len * top_k`` distinct rows;
    one extra ``top_k`` leaves room for rows reused from the previous step, which is
    what makes the LRU pay off. If that exceeds ``MAX_DEVICE_BUFFER_ROWS``, the largest
    block multiple under the cap is used, as long as one step still fits.
    """
    rows = _round_up((max_decode_query_len + 1) * top_k, block_size)
    if rows <= MAX_DEVICE_BUFFER_ROWS:
        return rows
    return MAX_DEVICE_BUFFER_ROWS // block_size * block_size


def _parse_device_buffer_size(
    extra: Mapping[str, Any], top_k: int, block_size: int, max_decode_query_len: int
) -> int:
    min_rows = max_decode_query_len * top_k
    explicit = "device_buffer_size" in extra
    value = (
        extra["device_buffer_size"]
        if explicit
        else default_device_buffer_size(top_k, block_size, max_decode_query_len)
    )
    source = "device_buffer_size" if explicit else "the default device_buffer_size"
    accepted = (
        f"accepted: a multiple of block_size={block_size} between "
        f"max_decode_query_len*top_k={max_decode_query_len}*{top_k}={min_rows} "
        f"and {MAX_DEVICE_BUFFER_ROWS}"
    )
    if not _is_int(value) or value <= 0 or value % block_size:
        raise HiSparseConfigError(f"{CONNECTOR_NAME}: {source}={value!r} is invalid; {accepted}.")
    if value > MAX_DEVICE_BUFFER_ROWS or value < min_rows:
        why = (
            "one decode step can select more distinct rows than the hot region holds"
            if value < min_rows
            else "the resolver keeps a request's hot-slot state in shared memory"
        )
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: {source}={value} is out of range ({why}); {accepted}."
        )
    return value


def _parse_bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: {key}={value!r} is invalid; accepted: true or false."
        )
    return value


def _parse_choice(extra: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    """``extra[key]`` (default: the first choice), one of ``choices``."""
    value = extra.get(key, choices[0])
    if value not in choices:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: {key}={value!r} is invalid; accepted: {' | '.join(choices)}.")
    return value


def _parse_record_trace(extra: Mapping[str, Any]) -> str | None:
    value = extra.get("record_trace")
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: record_trace={value!r} is invalid; accepted: a file "
            "path (string) or null."
        )
    accepted = "accepted: a writable file path in an existing, writable directory"
    if os.path.isdir(value):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: record_trace={value!r} is a directory; {accepted}."
        )
    if os.path.exists(value) and not os.access(value, os.W_OK):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: record_trace={value!r} exists and is not writable; {accepted}."
        )
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: record_trace={value!r}: directory {parent!r} does not "
            f"exist; {accepted}."
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: record_trace={value!r}: directory {parent!r} is not "
            f"writable; {accepted}."
        )
    return value


def _parse_prefetch_max_ctas(extra: Mapping[str, Any]) -> int:
    value = extra.get("prefetch_max_ctas", DEFAULT_SIDE_MAX_CTAS)
    if not _is_int(value) or not 0 <= value <= MAX_PREFETCH_CTAS:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: prefetch_max_ctas={value!r} is invalid; accepted: an integer "
            f"between 0 (no cap: every SM) and {MAX_PREFETCH_CTAS}."
        )
    return value


def _parse_gather_ctas_per_sm(extra: Mapping[str, Any]) -> int:
    value = extra.get("gather_ctas_per_sm", DEFAULT_LEADER_CTAS_PER_SM)
    if not _is_int(value) or not 0 <= value <= MAX_GATHER_CTAS_PER_SM:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: gather_ctas_per_sm={value!r} is invalid; accepted: an integer "
            f"between 0 (the kernel's default grid) and {MAX_GATHER_CTAS_PER_SM}."
        )
    return value


def _check_standalone(extra: Any) -> None:
    """The checks that need no engine facts (keys, types, ranges, machine memory)."""
    if not isinstance(extra, Mapping):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: kv_connector_extra_config must be a JSON object; "
            f"got {type(extra).__name__}."
        )
    _reject_unknown_keys(extra)
    _parse_host_pool_gib(extra)
    if "device_buffer_size" in extra:
        value = extra["device_buffer_size"]
        if not _is_int(value) or not 0 < value <= MAX_DEVICE_BUFFER_ROWS:
            raise HiSparseConfigError(
                f"{CONNECTOR_NAME}: device_buffer_size={value!r} is invalid; accepted: a "
                f"multiple of block_size between max_decode_query_len*top_k and "
                f"{MAX_DEVICE_BUFFER_ROWS}."
            )
    _parse_bool(extra, "eager_host_mirror", True)
    _parse_choice(extra, "ops_backend", OPS_BACKENDS)
    _parse_choice(extra, "hot_region_eviction", HOT_REGION_EVICTIONS)
    _parse_record_trace(extra)
    _parse_bool(extra, "index_share_prefetch", True)
    _parse_prefetch_max_ctas(extra)
    _parse_gather_ctas_per_sm(extra)
    _parse_bool(extra, "overlap_conversion", True)
    _parse_ack_deadline_s(extra)
    _parse_hot_region(extra)


def check_extra_config(vllm_config: VllmConfig) -> None:
    """Validate our extra config without engine facts; a no-op unless it names us.

    What the plugin runs while vLLM builds a ``VllmConfig`` (the model's ``index_topk``
    and the final ``block_size`` may not be known yet; ``engine_checks.resolve_config`` checks the
    rest when the engine plans its KV cache)."""
    extra = find_connector_extra_config(vllm_config)
    if extra is not None:
        _check_standalone(extra)


def _parse_ack_deadline_s(extra: Mapping[str, Any]) -> float:
    value = extra.get("ack_deadline_s", DEFAULT_ACK_DEADLINE_S)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 < value <= MAX_ACK_DEADLINE_S):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: ack_deadline_s={value!r} is invalid; accepted: a number of "
            f"seconds, greater than 0 and at most {MAX_ACK_DEADLINE_S:g}."
        )
    return float(value)


def _parse_hot_region(extra: Mapping[str, Any]) -> tuple[bool, float]:
    adaptive = _parse_bool(extra, "adaptive_hot_region", False)
    value = extra.get("hot_region_target_miss_rate", DEFAULT_HOT_REGION_TARGET_MISS_RATE)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 < value < 1):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: hot_region_target_miss_rate={value!r} is invalid; accepted: "
            "a number greater than 0 and less than 1 (misses per host-backed selection).")
    if "hot_region_target_miss_rate" in extra and not adaptive:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: hot_region_target_miss_rate is set but adaptive_hot_region "
            "is false; accepted: set adaptive_hot_region to true, or leave the target out.")
    return adaptive, float(value)


def parse_extra_config(
    extra: Mapping[str, Any], *, top_k: int, block_size: int, max_decode_query_len: int
) -> HiSparseResidencyConfig:
    """Validate ``kv_connector_extra_config`` given the engine facts it depends on."""
    if not isinstance(extra, Mapping):
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME}: kv_connector_extra_config must be a JSON object; "
            f"got {type(extra).__name__}."
        )
    _reject_unknown_keys(extra)
    adaptive, target = _parse_hot_region(extra)
    return HiSparseResidencyConfig(
        host_pool_gib=_parse_host_pool_gib(extra),
        device_buffer_size=_parse_device_buffer_size(
            extra, top_k, block_size, max_decode_query_len
        ),
        eager_host_mirror=_parse_bool(extra, "eager_host_mirror", True),
        ops_backend=_parse_choice(extra, "ops_backend", OPS_BACKENDS),
        record_trace=_parse_record_trace(extra),
        index_share_prefetch=_parse_bool(extra, "index_share_prefetch", True),
        prefetch_max_ctas=_parse_prefetch_max_ctas(extra),
        gather_ctas_per_sm=_parse_gather_ctas_per_sm(extra),
        overlap_conversion=_parse_bool(extra, "overlap_conversion", True),
        top_k=top_k,
        block_size=block_size,
        max_decode_query_len=max_decode_query_len,
        ack_deadline_s=_parse_ack_deadline_s(extra),
        adaptive_hot_region=adaptive,
        hot_region_target_miss_rate=target,
        hot_region_eviction=_parse_choice(extra, "hot_region_eviction", HOT_REGION_EVICTIONS),
        host_layout=_parse_choice(extra, "host_layout", HOST_LAYOUT_CHOICES),
    )


# --------------------------------------------------------------------------------------
# Engine compatibility
# --------------------------------------------------------------------------------------


def model_top_k(vllm_config: VllmConfig) -> int:
    """The model's ``index_topk`` (positions the DSA indexer selects per token)."""
    model_config = vllm_config.model_config
    if model_config is None:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME} needs a model config; accepted: a DSA model whose HF "
            "config has index_topk (DeepSeek-V3.2, GLM-5.x)."
        )
    top_k = getattr(model_config.hf_text_config, "index_topk", None)
    if not _is_int(top_k) or top_k <= 0:
        raise HiSparseConfigError(
            f"{CONNECTOR_NAME} does not support model {model_config.model!r}: its HF "
            f"config has index_topk={top_k!r}; accepted: a DSA (top-k sparse "
            "attention) model whose HF config sets index_topk > 0 (DeepSeek-V3.2, GLM-5.x)."
        )
    return top_k


def max_decode_query_len(vllm_config: VllmConfig) -> int:
    """Tokens one request feeds in a decode step: 1 + speculative tokens."""
    spec = vllm_config.speculative_config
    if spec is None:
        return 1
    return 1 + (spec.num_speculative_tokens or 0)


def _round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b
