"""Per-index-group residency tables and hot-region state, and the resolve + gather step.

One :class:`HotState` exists per index group (a layer that runs the indexer plus the layers
that reuse its top-k). Every table is indexed by **state row** (the request's persistent row,
never its batch position):

| table | dtype, shape | meaning |
|---|---|---|
| ``residency`` | int32 ``[R, P]`` | device block of each resident page, -1 = not resident |
| ``host_blocks`` | int32 ``[R, P]`` | host block of each page, -1 = none |
| ``hot_blocks`` | int32 ``[R, D / bs]`` | device blocks of the hot region, -1 = no region |
| ``slot_pos`` | int32 ``[R, D]`` | position held by each hot slot, -1 = empty |
| ``lru`` | int16 ``[R, D]`` | hot slots, least recently used first |

Updates arrive as vectors (one ``index_put_`` per table and step, not one per entry), so a step
that changes n pages costs O(n) on the host and a handful of small copies on the GPU.

:class:`GroupGather` executes a resolve's miss plan for the group's layers: in one launch before
the leader's attention (``mode="single"``), or the leader's launch now and the followers' on a
side stream, each follower's attention waiting only on its own event (``mode="side"``, the
default: IndexShare prefetch; docs/worker.md, "Follower prefetch").
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import torch

from vllm_hisparse import ops
from vllm_hisparse.core.capacity import PREFETCH_FIRST_LAUNCH_LAYERS
from vllm_hisparse.worker.hot_counts import RowHotCounts
from vllm_hisparse.worker.page_tables import PageTables

#: ``"side"``: leader's layer on the current stream, followers' on a side stream (one ready
#: event per follower layer). ``"single"``: every layer in one launch on the current stream.
GATHER_MODES = ("side", "single")
#: ``"side"``: the followers' transfers run under the compute of the layers before them. It
#: pays only with the side launches kept to a few SMs (:data:`DEFAULT_SIDE_MAX_CTAS`), and it
#: is a single launch for an index group of one layer. The measured figures behind this and
#: the four side-mode defaults below: docs/benchmarks.md, "Side-stream gather defaults".
DEFAULT_GATHER_MODE = "side"
#: Launch schedule of side mode (see :func:`fit_chunks`): the leader with its first follower
#: on the current stream, then followers in launches of 2, 4, 8, ... layers. One layer alone
#: reads a position-major host pool at the host-page translation limit (docs/kernels.md,
#: "Host pool layout") and two adjacent layers take nearly the same time per position, so the
#: leader alone is no sooner ready than leader + one follower.
DEFAULT_SIDE_CHUNKS: tuple[int, ...] = (PREFETCH_FIRST_LAUNCH_LAYERS, 2, 4, 8, 16, 32, 64)
#: Grid cap of the side-stream launches, in CTAs per SM (0 = the gather kernel's default, 4).
#: The gather kernel's CTAs stride over the whole plan and stay resident until it is done; at
#: 4 per SM they hold nearly the whole register file, which the compute kernels they should
#: overlap with need. One per SM still keeps far more reads in flight than the PCIe link needs.
DEFAULT_SIDE_CTAS_PER_SM = 1
#: CUDA priority of the side stream (lower = higher; the compute stream is 0): pending side
#: work gets freed SM slots before pending compute blocks.
DEFAULT_SIDE_PRIORITY = -1
#: Cap on the whole grid of a side-stream launch, in CTAs (0 = none, ``side_ctas_per_sm``
#: alone decides). A gather CTA keeps dozens of host loads in flight; spread over every SM,
#: those loads hold the memory pipeline the compute kernels beside them need, and the
#: compute slows by as much as the gather hid. A few CTAs still keep the PCIe link nearly busy.
DEFAULT_SIDE_MAX_CTAS = 16
#: Grid of the launch that holds the leader (the gather on the step's critical path), in CTAs
#: per SM (0 = the kernel's default, 4). One CTA per SM keeps a narrower span of host memory
#: in flight, which the host's address translation serves faster, and still keeps the link
#: busy (docs/benchmarks.md, "The critical-path gather's grid").
DEFAULT_LEADER_CTAS_PER_SM = 1


def fit_chunks(spec: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """The launch schedule of an index group of ``num_layers`` layers from a chunk spec.

    ``spec`` lists layers per launch in layer order; the first launch holds the leader. The
    last launch is cut to fit and, when the spec runs out, its last size repeats. So ``(1,)``
    is one launch per layer, ``(1, 99)`` the leader then all followers at once, ``(2, 2, 4)``
    the leader with its first follower, then launches of 2 and 4 followers.

    Returns:
        positive chunk sizes summing to ``num_layers``.
    """
    if num_layers <= 0:
        raise ValueError(f"fit_chunks: num_layers must be positive, got {num_layers}")
    sizes = list(spec)
    if not sizes or any(isinstance(c, bool) or not isinstance(c, int) or c <= 0 for c in sizes):
        raise ValueError(f"gather chunks must be a non-empty list of positive ints, got {spec!r}")
    out: list[int] = []
    left = num_layers
    while left:
        size = min(sizes[min(len(out), len(sizes) - 1)], left)
        out.append(size)
        left -= size
    return tuple(out)


@dataclasses.dataclass
class ResolveResult:
    """Outputs of one :meth:`HotState.resolve` (views of the first rows of buffers the state
    reuses, whose addresses a CUDA graph may hold)."""

    out_rows: torch.Tensor  # int32 [T, K] device row per selection, -1 padding
    miss_src: torch.Tensor  # int32 [T, K] host rows to copy
    miss_dst: torch.Tensor  # int32 [T, K] device rows to fill
    miss_count: torch.Tensor  # int32 [T]


class HotState:
    """Residency and hot-slot state of one index group.

    Args:
        num_state_rows: R, the number of request-state rows (vLLM ``max_num_seqs``).
        max_pages: P, pages of the longest request (``ceil(max_model_len / block_size)``).
        hot_slots: D, the widest hot region (rows), a multiple of ``block_size`` and at most
            32768; a lease may hold fewer blocks (adaptive hot regions).
        block_size: rows per page.
        device: where the tables live (the GPU in production, CPU in tests).
        ops_backend: ``"auto"``, ``"cuda"`` or ``"reference"``, or an :class:`ops.Backend`
            (:func:`ops.select` with kernel tuning).
        page_tables: the lane's :class:`PageTables` this state reads (shared by the index
            groups of one lane); None = tables of its own.
    """

    def __init__(self, num_state_rows: int, max_pages: int, hot_slots: int, block_size: int,
                 device: torch.device | str = "cpu", *, ops_backend: str | ops.Backend = "auto",
                 page_tables: PageTables | None = None):
        if hot_slots <= 0 or hot_slots % block_size:
            raise ValueError(f"HotState: hot_slots must be a positive multiple of block_size "
                             f"({block_size}), got {hot_slots}")
        if hot_slots > 32768:
            raise ValueError(f"HotState: hot_slots = {hot_slots} exceeds 32768 (int16 lru)")
        self.num_state_rows = num_state_rows
        self.max_pages = max_pages
        self.hot_slots = hot_slots
        self.block_size = block_size
        self.hot_blocks_per_request = hot_slots // block_size
        self.device = torch.device(device)
        self._ops = ops_backend if isinstance(ops_backend, ops.Backend) else ops.select(ops_backend)
        i32 = dict(dtype=torch.int32, device=self.device)
        if page_tables is None:
            page_tables = PageTables(num_state_rows, max_pages, self.device)
        elif tuple(page_tables.residency.shape) != (num_state_rows, max_pages):
            raise ValueError(f"HotState: page tables of shape "
                             f"{tuple(page_tables.residency.shape)}, expected "
                             f"{(num_state_rows, max_pages)}")
        self.page_tables = page_tables
        self.hot_blocks = torch.full((num_state_rows, self.hot_blocks_per_request), -1, **i32)
        self.slot_pos = torch.full((num_state_rows, hot_slots), -1, **i32)
        self.lru = torch.arange(hot_slots, dtype=torch.int16,
                                device=self.device).repeat(num_state_rows, 1)
        self.stats = torch.zeros(3, dtype=torch.int64, device=self.device)
        #: Per-row miss counts for adaptive hot regions (``RowHotCounts``), or None.
        self.row_counts: RowHotCounts | None = None
        #: uint8 ``[R, D]`` eviction classes for resolve (score-aware eviction, filled by
        #: :meth:`fill_slot_classes`), or None: plain LRU.
        self.slot_class: torch.Tensor | None = None
        # resolve's outputs: views of the rows of one storage, sized by the largest batch so
        # far (vLLM warms up and captures its CUDA graphs largest batch first, so one storage
        # serves them all). A storage outgrown later is kept: graphs captured while it was
        # current still write it.
        self._result: ResolveResult | None = None
        self._retired: list[ResolveResult] = []
        # The GroupGather whose side-stream gathers may still read this state's miss plan and
        # write its hot rows (None once joined); see fence_side_work.
        self._side_work: GroupGather | None = None

    # ---------------------------------------------------------------- table updates

    @property
    def residency(self) -> torch.Tensor:
        """int32 ``[R, P]``: device block of each page, -1 = not resident (the page tables')."""
        return self.page_tables.residency

    @property
    def host_blocks(self) -> torch.Tensor:
        """int32 ``[R, P]``: host block of each page, -1 = none (the page tables')."""
        return self.page_tables.host_blocks

    def _ids(self, values: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(values), dtype=torch.int64).to(self.device, non_blocking=True)

    def set_pages(self, rows: Sequence[int], pages: Sequence[int],
                  device_blocks: Sequence[int]) -> None:
        """``residency[rows[i], pages[i]] = device_blocks[i]`` (-1 releases the page)."""
        self.page_tables.set_pages(rows, pages, device_blocks)

    def set_host_blocks(self, rows: Sequence[int], pages: Sequence[int],
                        host_blocks: Sequence[int]) -> None:
        """``host_blocks[rows[i], pages[i]] = host_blocks[i]``."""
        self.page_tables.set_host_blocks(rows, pages, host_blocks)

    def _region(self, row: int, device_blocks: Sequence[int]) -> int:
        """``hot_blocks[row]`` = ``device_blocks`` then -1 (unleased); returns their number."""
        n = len(device_blocks)
        if not 0 < n <= self.hot_blocks_per_request:
            raise ValueError(f"HotState: a hot region is 1 to {self.hot_blocks_per_request} "
                             f"blocks, got {n} for state row {row}")
        self.hot_blocks[row, :n] = self._ids(device_blocks).to(torch.int32)
        self.hot_blocks[row, n:] = -1
        return n

    def lease_hot_region(self, row: int, device_blocks: Sequence[int]) -> None:
        """Give ``row`` a fresh hot region of ``device_blocks`` (1 to D / bs blocks; the
        slots past them unleased): all slots empty, LRU in slot order."""
        self._region(row, device_blocks)
        self.slot_pos[row] = -1
        self.lru[row] = torch.arange(self.hot_slots, dtype=torch.int16, device=self.device)

    def resize_hot_region(self, row: int, device_blocks: Sequence[int]) -> None:
        """Grow or shrink ``row``'s region to ``device_blocks`` (the old blocks as a prefix,
        or a prefix of them): the kept blocks' slots keep their positions, the slots past
        the new region are emptied (``resolve`` never takes an unleased slot and puts it
        first in the LRU order, so a later grow fills those slots first)."""
        n = self._region(row, device_blocks)
        self.slot_pos[row, n * self.block_size:] = -1

    def enable_slot_classes(self) -> torch.Tensor:
        """Evict in (class, LRU) order from now on; returns the class table to fill before
        each resolve (all class 0, plain LRU, until then)."""
        if self.slot_class is None:
            self.slot_class = torch.zeros((self.num_state_rows, self.hot_slots),
                                          dtype=torch.uint8, device=self.device)
        return self.slot_class

    def fill_slot_classes(self, logits: torch.Tensor, threshold: torch.Tensor,
                          width: torch.Tensor, next_n: int, batch_state_rows: torch.Tensor
                          ) -> None:
        """This step's classes of the decode requests' slots from the indexer's scores
        (``ops.slot_classes`` of this state's backend: one launch on CUDA); the rows of other
        requests keep theirs. Needs :meth:`enable_slot_classes`."""
        if self.slot_class is None:
            raise RuntimeError("fill_slot_classes: slot classes are not enabled on this "
                               "hot state (enable_slot_classes)")
        self._ops.slot_classes(logits, threshold, width, next_n, batch_state_rows,
                               self.slot_pos, self.slot_class)

    def release_hot_region(self, row: int) -> None:
        """Drop ``row``'s hot region (its blocks go back to the scheduler's pool)."""
        self.hot_blocks[row] = -1
        self.slot_pos[row] = -1

    def clear_row(self, row: int) -> None:
        """Forget everything about ``row`` (request finished, aborted or preempted): its pages
        (in the page tables, shared with the lane's other states) and its hot region."""
        self.page_tables.clear_rows([row])
        self.release_hot_region(row)

    # ---------------------------------------------------------------- per step

    def _result_buffers(self, num_tokens: int, k: int) -> ResolveResult:
        """Output views for a batch of ``num_tokens`` tokens of ``k`` selections."""
        storage = self._result
        if storage is None or storage.out_rows.shape[0] < num_tokens \
                or storage.out_rows.shape[1] != k:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"HotState: a CUDA graph captures a resolve of {num_tokens} tokens that no "
                    "eager call allocated outputs for; run the forward once before the capture")
            if storage is not None:
                self._retired.append(storage)
            rows = max(num_tokens, storage.out_rows.shape[0] if storage is not None else 0)
            i32 = dict(dtype=torch.int32, device=self.device)
            storage = ResolveResult(torch.empty((rows, k), **i32), torch.empty((rows, k), **i32),
                                    torch.empty((rows, k), **i32), torch.empty((rows,), **i32))
            self._result = storage
        return ResolveResult(*(t[:num_tokens] for t in (storage.out_rows, storage.miss_src,
                                                          storage.miss_dst, storage.miss_count)))

    @property
    def ops(self) -> ops.Backend:
        """The ops backend this group's tables are resolved with (the read path's other
        per-layer ops run on the same one)."""
        return self._ops

    @property
    def side_work(self) -> "GroupGather | None":
        """The gather whose side-stream launches may still write this group's hot rows
        (None once every follower waited or a fence joined them)."""
        return self._side_work

    def note_side_work(self, gather: "GroupGather") -> None:
        """``gather`` has side-stream launches in flight (the next fence joins them)."""
        self._side_work = gather

    def side_work_joined(self, gather: "GroupGather") -> None:
        """The current stream has waited on every side launch of ``gather``."""
        if self._side_work is gather:
            self._side_work = None

    def fence_side_work(self) -> None:
        """Order the current stream after this group's gathers still running on a side stream.

        Called by :meth:`resolve` and :meth:`gather` (the next resolve rewrites the miss-plan
        buffers those gathers read, the next gather the hot rows they write) and by the step
        executor before a step's table and block changes. A no-op once every follower layer
        has waited for its rows (the usual case: that wait already joined the side stream)."""
        pending = self._side_work
        if pending is not None:
            pending.join()

    def resolve(self, topk: torch.Tensor, token_rows: torch.Tensor) -> ResolveResult:
        """Resolve the step's top-k (int32 ``[T, K]``) of tokens whose state rows are
        ``token_rows`` (int32 ``[T]``); see ``ops.resolve``."""
        self.fence_side_work()
        res = self._result_buffers(*topk.shape)
        self._ops.resolve(topk, token_rows, self.residency, self.host_blocks, self.hot_blocks,
                          self.slot_pos, self.lru, self.block_size, res.out_rows, res.miss_src,
                          res.miss_dst, res.miss_count, self.stats,
                          self.slot_class)
        if self.row_counts is not None:
            self.row_counts.add(topk, token_rows, self.residency, res.miss_count, self.block_size)
        return res

    def gather(self, result: ResolveResult, host_layers: Sequence[torch.Tensor],
               device_layers: Sequence[torch.Tensor]) -> None:
        """Copy the misses of ``result`` from the host pool into the hot rows, for every layer
        of the index group (leader and followers) in one call."""
        self.fence_side_work()
        self._ops.gather_rows(host_layers, device_layers, result.miss_src, result.miss_dst,
                              result.miss_count)

    def poll_errors(self) -> None:
        """Raise the :class:`~vllm_hisparse.ops.ResolveError` a completed kernel launch
        recorded, if any; never waits (a read of pinned memory). The op raises it at its next
        call anyway; this is for launches replayed in a CUDA graph, which never call it."""
        if self.device.type == "cuda" and self._ops.name != "reference":
            from vllm_hisparse.ops import cuda as cuda_ops

            if cuda_ops.available():
                cuda_ops.poll_errors(self.device)

    def counters(self) -> tuple[int, int, int]:
        """Distinct (resident, hot hit, miss) selections counted so far (syncs on CUDA)."""
        resident, hit, miss = self.stats.tolist()
        return resident, hit, miss


class GroupGather:
    """Executes one index group's miss plan into the hot rows of its layers, layer by layer.

    ``mode="single"``: one ``ops.gather_rows`` launch for every layer, on the current
    stream, before the leader's attention.

    ``mode="side"`` (IndexShare prefetch; the default, :data:`DEFAULT_GATHER_MODE` says why):
    the launches follow ``chunks`` (:func:`fit_chunks`).
    The first launch holds the leader and runs on the current (compute) stream: the leader's
    attention needs it now. The side stream then forks from the current stream (an event, so
    it also waits for everything before, the leader's gather included) and runs the other
    launches in layer order, recording one ready event per launch; every follower layer maps
    to the event of the launch that holds it. The host issues those launches at the first
    follower's wait, after the leader's layer is queued (:meth:`launch` says why).
    :meth:`wait` makes the current stream wait on that event only: no host sync, and the
    follower's attention runs as soon as its own rows have landed. The plan is the leader's,
    replayed for the followers' bytes (exact: the followers' hot slots are in lockstep with
    the leader's).

    Memory safety: the side launches read the plan buffers of ``hot_state.resolve`` and write
    hot rows. Until they are joined (every follower waited, or :meth:`join`), the hot state
    remembers them, and its next ``resolve`` / ``gather`` (and the step executor, before a
    step's table and block changes) first makes the current stream wait for them.

    CUDA graphs: fork and join are event record / wait pairs between the capturing stream and
    the side stream, so a step is capturable once every follower waits inside the capture
    (a side stream left unjoined makes the capture fail, as CUDA requires). Join before a
    capture begins. Nothing is allocated per step.

    On CPU tensors there are no streams; the side launches are queued and run when a layer
    waits or the work is joined, the latest moment a real stream could finish them. A
    missing wait therefore reads stale rows in CPU tests too, instead of passing by accident.

    Args:
        hot_state: the group's state; its resolve writes the plan this executes.
        host_layers: uint8 ``[host_rows, row_bytes]`` views, leader first (group order).
        device_layers: uint8 ``[device_rows, row_bytes]`` views of the same layers.
        mode: ``"side"`` or ``"single"``.
        chunks: side-mode schedule spec (default :data:`DEFAULT_SIDE_CHUNKS`; ``(1,)`` puts
            the leader alone on the current stream and every follower in its own launch).
        side_stream: the CUDA stream for the followers' launches (default: a new one).
        side_ctas_per_sm: grid cap of the side launches with the CUDA kernels (default
            :data:`DEFAULT_SIDE_CTAS_PER_SM`; 0 = the kernel's default grid).
        side_priority: CUDA priority of the side stream this creates (default
            :data:`DEFAULT_SIDE_PRIORITY`; ignored when ``side_stream`` is given).
        side_max_ctas: cap on the whole grid of each side launch with the CUDA kernels
            (default :data:`DEFAULT_SIDE_MAX_CTAS`; 0 = none).
        leader_ctas_per_sm: grid of the leader's launch with the CUDA kernels, CTAs per SM
            (default :data:`DEFAULT_LEADER_CTAS_PER_SM`; 0 = the kernel's default grid).
    """

    def __init__(self, hot_state: HotState, host_layers: Sequence[torch.Tensor],
                 device_layers: Sequence[torch.Tensor], *, mode: str = DEFAULT_GATHER_MODE,
                 chunks: Sequence[int] | None = None,
                 side_stream: "torch.cuda.Stream | None" = None,
                 side_ctas_per_sm: int = DEFAULT_SIDE_CTAS_PER_SM,
                 side_priority: int = DEFAULT_SIDE_PRIORITY,
                 side_max_ctas: int = DEFAULT_SIDE_MAX_CTAS,
                 leader_ctas_per_sm: int = DEFAULT_LEADER_CTAS_PER_SM):
        for name, value in (("side_ctas_per_sm", side_ctas_per_sm),
                            ("side_max_ctas", side_max_ctas),
                            ("leader_ctas_per_sm", leader_ctas_per_sm)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GroupGather: {name} must be an int >= 0, got {value!r}")
        if mode not in GATHER_MODES:
            raise ValueError(f"GroupGather: mode must be one of {', '.join(GATHER_MODES)}; "
                             f"got {mode!r}")
        if not host_layers or len(host_layers) != len(device_layers):
            raise ValueError(f"GroupGather: need one host layer per device layer and at least "
                             f"one; got {len(host_layers)} and {len(device_layers)}")
        self.hot_state = hot_state
        self.host_layers = list(host_layers)
        self.device_layers = list(device_layers)
        self.num_layers = len(self.device_layers)
        self.mode = mode
        # A schedule is checked in either mode, so a bad setting fails wherever it is given.
        side_chunks = fit_chunks(DEFAULT_SIDE_CHUNKS if chunks is None else chunks,
                                 self.num_layers)
        self.chunks: tuple[int, ...] = (self.num_layers,) if mode == "single" else side_chunks
        starts = [sum(self.chunks[:c]) for c in range(len(self.chunks))]
        self._spans = [(s, s + n) for s, n in zip(starts, self.chunks)]
        self._chunk_of = [c for c, n in enumerate(self.chunks) for _ in range(n)]
        self._cuda = hot_state.device.type == "cuda"
        self.side_ctas_per_sm = side_ctas_per_sm
        self.side_max_ctas = side_max_ctas
        # The leader's launch goes through the checked op of a backend that differs from the
        # hot state's only in its grid (the reference twins ignore tuning).
        ops_ = hot_state.ops
        self.leader_ops = ops_ if leader_ctas_per_sm == ops_.tuning.copy_ctas_per_sm else \
            ops.select(ops_.name, **{**dataclasses.asdict(ops_.tuning),
                                     "copy_ctas_per_sm": leader_ctas_per_sm})
        # Side launches with a capped grid go to the tuned kernel entry directly; the layer
        # lists are checked once here by the checked op (an empty plan copies nothing) and
        # the plan buffers are the hot state's own, checked at every leader launch.
        self._side_kernel = None
        if self._cuda and len(self.chunks) > 1 and (side_ctas_per_sm or side_max_ctas) \
                and hot_state.ops.name != "reference":
            from vllm_hisparse.ops import cuda as cuda_ops

            if cuda_ops.available():
                self._side_kernel = cuda_ops.gather_rows_tuned
                empty = torch.empty((0, 1), dtype=torch.int32, device=hot_state.device)
                hot_state.ops.gather_rows(self.host_layers, self.device_layers, empty, empty,
                                          torch.empty((0,), dtype=torch.int32,
                                                      device=hot_state.device))
        self._side_stream = side_stream
        self.side_priority = side_priority
        self._fork = None
        self._ready: list = []
        # The plan whose side launches are not issued yet (see launch).
        self._pending: ResolveResult | None = None
        # CPU: side launches not run yet, in stream order: (chunk index, launch).
        self._queue: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        # Chunks launched since the last join that the current stream has not waited on.
        self._unjoined: set[int] = set()
        #: Gather launches issued so far (both streams; tests and benchmarks).
        self.launches = 0

    @property
    def side_launches(self) -> int:
        """Launches per step that run on the side stream (0 in single mode)."""
        return len(self.chunks) - 1

    @property
    def side_stream(self) -> "torch.cuda.Stream":
        """The stream of the followers' launches (CUDA only; created on first use)."""
        if not self._cuda:
            raise RuntimeError("GroupGather: CPU tensors have no side stream")
        return self._side()

    def _side(self):
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.hot_state.device,
                                                  priority=self.side_priority)
        if self._fork is None:
            self._fork = torch.cuda.Event()
            self._ready = [None] + [torch.cuda.Event() for _ in self.chunks[1:]]
        return self._side_stream

    def _gather_span(self, result: ResolveResult, chunk: int) -> None:
        start, end = self._spans[chunk]
        if chunk and self._side_kernel is not None:
            self._side_kernel(self.host_layers[start:end], self.device_layers[start:end],
                              result.miss_src, result.miss_dst, result.miss_count,
                              rows_per_warp=None, ctas_per_sm=self.side_ctas_per_sm,
                              max_ctas=self.side_max_ctas, tuning=self.hot_state.ops.tuning)
        else:
            ops_ = self.leader_ops if chunk == 0 else self.hot_state.ops
            ops_.gather_rows(self.host_layers[start:end], self.device_layers[start:end],
                             result.miss_src, result.miss_dst, result.miss_count)
        self.launches += 1

    def launch(self, result: ResolveResult) -> None:
        """Execute ``result``'s plan (just resolved by ``hot_state.resolve``): the leader's
        launch now on the current stream, the followers' on the side stream.

        The side stream's fork point is recorded now (right after the leader's launch), but
        the side launches are *issued* by the host at the first follower's :meth:`wait` (or a
        join / fence), i.e. after the leader layer's own kernels are queued: their host-side
        cost then overlaps the leader's GPU work instead of delaying its attention, and on
        the GPU they still start as soon as the leader's launch is done. Inside a CUDA-graph
        capture they are issued here, so that they belong to the same capture as the fork."""
        self.hot_state.fence_side_work()
        self._gather_span(result, 0)
        if len(self.chunks) == 1:
            return
        if self._cuda:
            self._side()
            self._fork.record(torch.cuda.current_stream(self.hot_state.device))
        self._pending = result
        self._unjoined = set(range(1, len(self.chunks)))
        self.hot_state.note_side_work(self)
        if self._cuda and torch.cuda.is_current_stream_capturing():
            # In a CUDA-graph capture the host cost is paid once; issuing now keeps fork and
            # launches in the same capture (a later issue would wait on a captured event).
            self._issue_side()

    @property
    def side_pending(self) -> bool:
        """True between :meth:`launch` and the issue of its side launches (first follower
        wait, join or fence)."""
        return self._pending is not None

    def _issue_side(self) -> None:
        result, self._pending = self._pending, None
        if result is None:
            return
        if self._cuda:
            side = self._side()
            side.wait_event(self._fork)
            with torch.cuda.stream(side):
                for chunk in range(1, len(self.chunks)):
                    self._gather_span(result, chunk)
                    self._ready[chunk].record(side)
        else:
            for chunk in range(1, len(self.chunks)):
                self._queue.append((chunk, lambda c=chunk: self._gather_span(result, c)))

    def wait(self, layer_index: int) -> None:
        """Make the current stream wait until the rows of layer ``layer_index`` (0 = leader)
        are in place. A no-op for the layers of the first launch and once waited."""
        if not 0 <= layer_index < self.num_layers:
            raise ValueError(f"GroupGather: layer {layer_index} is outside the index group "
                             f"of {self.num_layers} layers")
        self._wait_chunk(self._chunk_of[layer_index])

    def join(self) -> None:
        """Make the current stream wait for every side launch of the last :meth:`launch`."""
        self._wait_chunk(len(self.chunks) - 1)

    def _wait_chunk(self, chunk: int) -> None:
        if chunk == 0 or chunk not in self._unjoined:
            return
        self._issue_side()
        if self._cuda:
            torch.cuda.current_stream(self.hot_state.device).wait_event(self._ready[chunk])
        else:
            while self._queue and self._queue[0][0] <= chunk:
                self._queue.popleft()[1]()
        # One stream runs the launches in order: this chunk's event covers the earlier ones.
        self._unjoined = {c for c in self._unjoined if c > chunk}
        if not self._unjoined:
            self.hot_state.side_work_joined(self)
