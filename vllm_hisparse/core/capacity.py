"""Capacity math: the one function behind the startup table and ``vllm-hisparse plan``.

An engine's KV layout (:class:`EngineLayout`) is what the planner made of the model: a pool
of ``device_blocks`` blocks of ``bytes_per_block`` bytes shared by the sparse-MLA, indexer
and other KV cache groups, a host pool of ``host_blocks`` blocks (one page of every
sparse-MLA and indexer layer each), the hot region of a request in pages, and the admission
window (``max_num_batched_tokens``). The startup table reads it off the planned engine
(``vllm.setup.capacity_report.engine_capacity_report``); ``plan`` derives it from a
:class:`ModelGeometry` with the planner's own group split (:func:`layout_for_geometry`).
Both then call :func:`concurrency_report`, so they agree to the request.

Per request of ``T`` tokens (``P = cdiv(T, block_size)`` pages), every group holds one
block per page it keeps on the device. Indexer (and other) groups keep every page; the
sparse-MLA groups keep:

* without residency (vLLM alone): every page;
* at admission: the admission window (prefill in flight, not yet on the host) plus the
  hot region, at most ``P``;
* in steady state (MIXED): the hot region plus ``ACTIVE_TAIL_PAGES``, at most ``P``.

Each figure is ``(device_blocks - 1) // blocks_per_request`` (vLLM keeps a null block),
and the hierarchical ones are also capped by the host pool (``host_blocks // P``).

Host memory: ``host_pool_gib`` is *logical* and per data-parallel replica (the KV of the
requests one replica serves). *Physical* pinned memory per node multiplies it by the
replicas on the node and, when tensor-parallel ranks keep private pools, by the TP size
(MLA KV is replicated across TP ranks); a pool shared by the TP ranks of a replica stores it
once. Block rounding makes the usable size slightly smaller than the budget.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from vllm_hisparse.core.kv_layout import MAX_SPLIT_GROUPS, geometry_split, index_unit_layers
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, GIB, cdiv

ROW_BYTES_FP8_DS_MLA = 656
"""One token, one layer, ``fp8_ds_mla``: 512 fp8 latent + 4 fp32 scales + 64 bf16 rope."""
ROW_BYTES_BF16 = 1152
"""One token, one layer, bf16 (576 elements)."""
INDEXER_ROW_BYTES = 132
"""One token, one layer of indexer keys (128 fp8 + one fp32 scale)."""


@dataclass(frozen=True)
class ModelGeometry:
    """KV geometry of a top-k sparse-attention model.

    ``num_indexer_layers`` counts the layers that keep indexer keys: every sparse layer in
    DeepSeek-V3.2 and GLM-5.1, fewer with IndexShare (GLM-5.2: 21 of 78), where followers
    reuse their leader's top-k. ``None`` means one per sparse layer.
    """

    name: str
    num_sparse_layers: int
    block_size: int
    row_bytes: int
    indexer_row_bytes: int
    top_k: int
    num_indexer_layers: int | None = None

    @property
    def indexer_layers(self) -> int:
        """Layers holding indexer keys."""
        return self.num_sparse_layers if self.num_indexer_layers is None else self.num_indexer_layers

    @property
    def device_full_bytes_per_token(self) -> int:
        """Device bytes per token of a FULL request (MLA + indexer, all layers)."""
        return self.num_sparse_layers * self.row_bytes + self.device_indexer_bytes_per_token

    @property
    def device_indexer_bytes_per_token(self) -> int:
        """Device bytes per token that stay resident for any request (indexer rows)."""
        return self.indexer_layers * self.indexer_row_bytes

    @property
    def host_bytes_per_token(self) -> int:
        """Host bytes per token: the MLA row of every layer and the indexer row of every
        indexer layer (a host-prefix hit loads both)."""
        return self.num_sparse_layers * self.row_bytes + self.device_indexer_bytes_per_token

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host block (one page of tokens, :attr:`host_bytes_per_token` each)."""
        return self.block_size * self.host_bytes_per_token


DEEPSEEK_V32_FP8 = ModelGeometry("deepseek-v3.2-fp8_ds_mla", 61, 64, ROW_BYTES_FP8_DS_MLA, INDEXER_ROW_BYTES, 2048)
DEEPSEEK_V32_BF16 = ModelGeometry("deepseek-v3.2-bf16", 61, 64, ROW_BYTES_BF16, INDEXER_ROW_BYTES, 2048)
# GLM-5.x: 78 decoder layers, all sparse MLA (kv_lora_rank 512, qk_rope 64), index_topk 2048.
GLM_51_FP8 = ModelGeometry("glm-5.1-fp8_ds_mla", 78, 64, ROW_BYTES_FP8_DS_MLA, INDEXER_ROW_BYTES, 2048)
# GLM-5.2: IndexShare, 21 anchor layers run the indexer, 57 reuse an anchor's top-k.
GLM_52_FP8 = ModelGeometry("glm-5.2-fp8_ds_mla", 78, 64, ROW_BYTES_FP8_DS_MLA, INDEXER_ROW_BYTES, 2048,
                           num_indexer_layers=21)
# GLM-5.3: IndexShare with one indexer per 4 sparse layers (20 of 78).
GLM_53_FP8 = ModelGeometry("glm-5.3-fp8_ds_mla", 78, 64, ROW_BYTES_FP8_DS_MLA, INDEXER_ROW_BYTES, 2048,
                           num_indexer_layers=20)

PRESETS = {
    "deepseek-v3.2": DEEPSEEK_V32_FP8,
    "deepseek-v3.2-bf16": DEEPSEEK_V32_BF16,
    "glm-5.1": GLM_51_FP8,
    "glm-5.2": GLM_52_FP8,
    "glm-5.3": GLM_53_FP8,
}
"""Model geometries by name (``vllm-hisparse plan --model``); fp8_ds_mla KV unless named."""


def default_device_buffer_size_rows(geometry: ModelGeometry, max_decode_query_len: int = 1) -> int:
    """Default hot rows per request: ``(max_decode_query_len + 1) * top_k``, page aligned."""
    rows = (max_decode_query_len + 1) * geometry.top_k
    return cdiv(rows, geometry.block_size) * geometry.block_size


@dataclass(frozen=True)
class EngineLayout:
    """What the KV planner made of a model, per engine (data-parallel replica)."""

    device_blocks: int
    """Blocks of the device pool, vLLM's null block included."""
    bytes_per_block: int
    num_sparse_groups: int
    num_indexer_groups: int
    num_other_groups: int
    host_blocks: int
    host_block_bytes: int
    """One page of every sparse-MLA and indexer layer: what one host block holds."""
    host_copies: int
    """Ranks of the replica that each pin a copy of the host pool."""
    block_size: int
    hot_blocks_per_request: int
    """Pages of one request's hot region (in every sparse-MLA group)."""
    admission_window_tokens: int
    """Prefill tokens in flight per request at admission (``max_num_batched_tokens``)."""


@dataclass(frozen=True)
class CapacityReport:
    """Concurrency of requests of ``context_tokens`` tokens on one engine: the startup
    table and each row of ``vllm-hisparse plan``."""

    context_tokens: int
    device_blocks: int
    bytes_per_block: int
    num_sparse_groups: int
    num_indexer_groups: int
    host_blocks: int
    host_block_bytes: int
    host_copies: int
    max_concurrency_without_residency: int
    """Full residency (every page of every group on the device): vLLM without us."""
    max_concurrency_at_admission: int
    """Every request holding its admission window plus its hot region (a burst)."""
    max_concurrency_steady: int
    """Hybrid residency in steady state (hot region + tail on the device), host-capped."""
    max_concurrency_steady_device: int
    """The steady state on the device alone (what a larger host pool would allow)."""
    max_concurrency_host: int
    """Requests of ``context_tokens`` tokens the host pool backs at once."""
    hot_rows_per_request: int
    """Device rows one request's hot region holds per sparse-MLA layer."""

    @property
    def logical_host_gib(self) -> float:
        return self.host_blocks * self.host_block_bytes / GIB

    @property
    def physical_host_gib(self) -> float:
        return self.logical_host_gib * self.host_copies

    def to_dict(self) -> dict:
        """JSON-able form."""
        return asdict(self)


def concurrency_report(layout: EngineLayout, context_tokens: int) -> CapacityReport:
    """How many requests of ``context_tokens`` tokens fit ``layout``, by residency state
    (formulas in the module docstring)."""
    pages = cdiv(int(context_tokens), layout.block_size)
    always_resident = (layout.num_indexer_groups + layout.num_other_groups) * pages
    usable = max(layout.device_blocks - 1, 0)

    def fit(sparse_pages: int) -> int:
        per_request = always_resident + layout.num_sparse_groups * min(sparse_pages, pages)
        return usable // per_request if per_request else 0

    host_fit = layout.host_blocks // pages if pages else 0
    window_pages = cdiv(layout.admission_window_tokens, layout.block_size)
    steady_device = fit(layout.hot_blocks_per_request + ACTIVE_TAIL_PAGES)
    return CapacityReport(
        context_tokens=int(context_tokens),
        device_blocks=layout.device_blocks,
        bytes_per_block=layout.bytes_per_block,
        num_sparse_groups=layout.num_sparse_groups,
        num_indexer_groups=layout.num_indexer_groups,
        host_blocks=layout.host_blocks,
        host_block_bytes=layout.host_block_bytes,
        host_copies=layout.host_copies,
        max_concurrency_without_residency=fit(pages),
        max_concurrency_at_admission=min(fit(window_pages + layout.hot_blocks_per_request), host_fit),
        max_concurrency_steady=min(steady_device, host_fit),
        max_concurrency_steady_device=steady_device,
        max_concurrency_host=host_fit,
        hot_rows_per_request=layout.hot_blocks_per_request * layout.block_size,
    )


def layout_for_geometry(
    geometry: ModelGeometry,
    *,
    device_kv_bytes: int,
    host_pool_bytes: int,
    device_buffer_size_rows: int,
    admission_window_tokens: int,
    host_copies: int = 1,
    max_groups: int = MAX_SPLIT_GROUPS,
) -> EngineLayout:
    """The layout vLLM's planner makes with the connector configured: our group split of
    ``geometry`` (:func:`~vllm_hisparse.core.kv_layout.geometry_split`), ``device_kv_bytes``
    of HBM cut into blocks of that split's size, the host budget cut into host blocks."""
    choice = geometry_split(geometry.num_sparse_layers, geometry.indexer_layers, geometry.block_size,
                            geometry.row_bytes, geometry.indexer_row_bytes, max_groups=max_groups)
    return EngineLayout(
        device_blocks=int(device_kv_bytes) // choice.bytes_per_block,
        bytes_per_block=choice.bytes_per_block,
        num_sparse_groups=len(choice.sparse_parts),
        num_indexer_groups=len(choice.indexer_parts),
        num_other_groups=0,
        host_blocks=host_blocks_for_budget(host_pool_bytes, geometry.host_block_bytes, host_copies),
        host_block_bytes=geometry.host_block_bytes,
        host_copies=host_copies,
        block_size=geometry.block_size,
        hot_blocks_per_request=cdiv(device_buffer_size_rows, geometry.block_size),
        admission_window_tokens=int(admission_window_tokens),
    )


#: Layers in the first gather launch of an index group with IndexShare prefetch (the leader and
#: its first follower, on the compute stream; ``worker.hot_state.DEFAULT_SIDE_CHUNKS`` starts
#: with it). The other followers' copies run on a side stream under earlier layers' compute.
PREFETCH_FIRST_LAUNCH_LAYERS = 2


def critical_path_layers(geometry: ModelGeometry,
                         first_launch_layers: int = PREFETCH_FIRST_LAUNCH_LAYERS) -> int:
    """Sparse layers whose miss copies stay on a decode step's critical path with IndexShare
    prefetch: the first launch of every index group (``min(first_launch_layers, group
    size)`` layers). The other layers' copies can run under compute, so this is the best
    case; with an indexer in every layer (DeepSeek-V3.2) it is every layer.

    Groups are the ``num_sparse_layers`` layers spread as evenly as possible over the
    ``indexer_layers`` leaders (a model's real grouping may differ by a layer here and there).
    """
    if first_launch_layers < 1:
        raise ValueError(f"first_launch_layers must be >= 1, got {first_launch_layers}")
    layers, groups = geometry.num_sparse_layers, geometry.indexer_layers
    if not 1 <= groups <= layers:
        raise ValueError(f"{geometry.name}: {groups} index groups for {layers} sparse layers")
    return sum(min(first_launch_layers, n) for n in index_unit_layers(layers, groups))


# --------------------------------------------------------------------------------------
# Host memory: sizing the pool and bounding it by what the machine has
# --------------------------------------------------------------------------------------


def host_blocks_for_budget(host_pool_bytes: int, host_block_bytes: int, host_copies: int) -> int:
    """Host blocks a per-replica budget buys when ``host_copies`` ranks each pin a copy.

    The one sizing rule: the planner, the scheduler role, the worker role and
    ``vllm-hisparse plan`` all size the pool with it, so they agree on the block count."""
    if host_block_bytes <= 0 or host_copies <= 0:
        raise ValueError(f"host_block_bytes={host_block_bytes} and host_copies={host_copies} "
                         "must be positive")
    return int(host_pool_bytes) // (host_block_bytes * host_copies)


@dataclass(frozen=True)
class HostMemoryLimit:
    """What bounds the host memory of this process: physical RAM and its memory cgroup."""

    physical_bytes: int | None
    """``SC_PHYS_PAGES * SC_PAGE_SIZE``; None when the OS does not say."""
    cgroup_bytes: int | None
    """The smallest memory limit of this process's cgroup and its ancestors; None: no limit."""
    cgroup_file: str | None
    """The file ``cgroup_bytes`` was read from (cgroup v2 ``memory.max`` or v1
    ``memory.limit_in_bytes``)."""

    @property
    def limit_bytes(self) -> int | None:
        """The binding limit (the smaller of the two), or None when neither is known."""
        known = [b for b in (self.physical_bytes, self.cgroup_bytes) if b is not None]
        return min(known) if known else None

    def describe(self) -> str:
        """Both numbers, for error messages."""
        physical = ("physical RAM unknown" if self.physical_bytes is None
                    else f"physical RAM {self.physical_bytes / GIB:.2f} GiB")
        cgroup = ("no cgroup memory limit" if self.cgroup_bytes is None
                  else f"cgroup memory limit {self.cgroup_bytes / GIB:.2f} GiB ({self.cgroup_file})")
        return f"{physical}, {cgroup}"


_CGROUP_V1_UNLIMITED = 1 << 62


def _physical_memory_bytes() -> int | None:
    try:
        pages, page_bytes = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_bytes if pages > 0 and page_bytes > 0 else None


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2): no limit


def _cgroup_limit(proc_root: str, cgroup_root: str) -> tuple[int | None, str | None]:
    """The smallest limit over this process's memory cgroup and its ancestors (v2 and v1).

    Inside a container the cgroup path in ``/proc/self/cgroup`` may not exist under the
    (namespaced) mount, so every ancestor down to the mount root is tried."""
    try:
        with open(os.path.join(proc_root, "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    candidates = []  # (directory, limit file name)
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            candidates.append((cgroup_root, path, "memory.max"))
        elif "memory" in controllers.split(","):
            candidates.append((os.path.join(cgroup_root, "memory"), path, "memory.limit_in_bytes"))
    best: tuple[int | None, str | None] = (None, None)
    for mount, path, file_name in candidates:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            limit_file = os.path.join(mount, *parts[:depth], file_name)
            limit = _read_limit(limit_file)
            # cgroup v1 writes "no limit" as a huge number (2^63 rounded down to a page).
            if limit is None or limit >= _CGROUP_V1_UNLIMITED:
                continue
            if best[0] is None or limit < best[0]:
                best = (limit, limit_file)
    return best


def host_memory_limit(*, proc_root: str = "/proc",
                      cgroup_root: str = "/sys/fs/cgroup") -> HostMemoryLimit:
    """Physical RAM and the cgroup memory limit of this process (roots injectable for tests)."""
    cgroup_bytes, cgroup_file = _cgroup_limit(proc_root, cgroup_root)
    return HostMemoryLimit(_physical_memory_bytes(), cgroup_bytes, cgroup_file)
