"""The sparse-MLA attention read path under residency: logical top-k → physical rows.

vLLM 0.33's sparse-MLA backends (FlashMLA sparse, FlashInfer sparse) turn the indexer's
logical top-k (request-relative token positions) into physical KV rows in one place for
decode batches: ``SparseMLAIndexGroup.convert_logical_to_physical_topk``
(``v1/attention/backends/mla/index_group.py:95``). FlashMLA sparse calls it for
decode-only batches (``flashmla_sparse.py:907,1040,1243``); the generic
``SparseMLACommonImpl.forward_mqa`` that FlashInfer sparse uses calls it for every batch
(``model_executor/layers/attention/sparse_mla_attention.py:783``). It maps position ``p``
of the token's request (batch row ``req_id_per_token[t]``) through the layer group's
block table: ``block_table[req, p // bs] * block_stride_rows + p % bs`` (``-1`` for padding).

The ``topk_conversion_hook`` patch (``vllm/patches/attention.py``, one of the package's runtime patches
of vLLM, all listed there) wraps that method with :func:`hooked_conversion`. An index group
with no :class:`IndexGroupResidency` attached, or a step whose batch has only FULL requests,
runs vLLM's method unchanged (zero added work). Otherwise :func:`convert_with_residency` runs:

* FULL requests' tokens get vLLM's rows (their pages are all resident and vLLM's block
  table names them), computed by the final merge from that block table
  (``ops.merge_table_rows``: vLLM's method itself does not run);
* tokens of MIXED / NONE requests get their rows from ``HotState.resolve`` (resident page →
  its row; hot hit → the slot's row; miss → an LRU victim slot) at the leader layer
  (``layer_index == 0``); followers reuse the leader's rows, exactly as vLLM's own group
  conversion shares one result. The misses are copied from the pinned host pool by the
  binding's ``GroupGather``: by default (``gather_mode="side"``, IndexShare prefetch) the
  leader's launch runs on the compute stream before its attention and the followers' on a
  side stream kept to a few SMs, each follower's conversion making the compute stream wait
  on that layer's own ready event (a stream wait, no host sync); ``gather_mode="single"``
  copies every layer of the group in one launch at the leader;
* rows are translated to the index space the kernel asked for (``block_stride_rows``) and,
  when ``return_valid_counts``, compacted to the front with per-row counts. A follower that
  converts what its leader converted (the same top-k, batch rows, block table and row space:
  vLLM's fixed buffers, compared by identity) takes the leader's final rows, as vLLM's
  group conversion shares one result; it only waits for its own layer's copies.

Where it runs: at the group method, the leader's conversion (token rows, resolve, the
leader's copies, the merge) runs on the index group's side stream from the event vLLM's model
records after the indexer, where vLLM's own conversion runs, and the compute stream waits on
one event at the end (:mod:`.conversion_stream`; config ``overlap_conversion``). The layer's
KV write and absorbed query projection run meanwhile. The direct conversion sites run in line,
as vLLM's function does there.

Token → state row: the worker role publishes, per step, the state row of every batch row
whose request is not FULL (``StepView``); ``req_id_per_token`` indexes it.

The backends also convert **without** the group, straight from vLLM's batch block table
(FlashMLA sparse mixed / prefill batches, FlashInfer sparse SM90 / SM120, FlashAttention
sparse; ``compat.DIRECT_CONVERSION_SITES``). The ``direct_conversion_routing`` patch
routes those calls through :func:`routed_direct_conversion` while a bound layer's
``forward_mqa`` runs (the ``layer_forward_context`` patch sets the layer context), so every
conversion of a bound group ends in :func:`convert_with_residency`, whatever the batch mix.
Without a prefill workspace vLLM's function does not run there either: as at the group
method, the final merge computes its rows for FULL requests' tokens from the same block
table (``ops.merge_table_rows``, the same values), one launch fewer per layer.
Tokens that vLLM maps into its prefill upconvert workspace (``HAS_PREFILL_WORKSPACE``) keep
vLLM's workspace offsets: that workspace is filled from the batch block table, which the
worker role rewrites for tracked requests (``worker_side``), and it holds their whole context.

Prefill tokens of tracked requests resolve like decode tokens. The worker role only lets a
tracked request prefill when none of its pages is host-only (requirement R1 in
``docs/worker.md``), so its prefill selections are all resident rows and never touch the hot
region.

CUDA graphs (``cudagraph_mode`` ``FULL_AND_PIECEWISE``, vLLM's default, or ``FULL``): a
captured forward replays the residency path whatever the step holds, so everything it reads
per step lives in fixed device buffers of the :class:`StepView` (the step's real token count
and the state row of every batch row), written before the replay by ``start_load_kv``, and
resolve's output storage is allocated by the eager warm-up vLLM runs before each capture. The
view is inert outside a step (every token padding: the resolver skips them all and the rows
are vLLM's), so a capture, its warm-up and vLLM's dummy batches change no hot state. Padding
tokens past the step's real count (vLLM maps them to batch row 0) and padding batch rows are
skipped. See :func:`uses_residency_path`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vllm_hisparse import ops
from vllm_hisparse.vllm.worker_side.conversion_stream import ConversionStream
from vllm_hisparse.vllm.worker_side.score_tap import ScoreTap
from vllm_hisparse.vllm.worker_side.step_view import StepView, capturing
from vllm_hisparse.worker.device_rows import DeviceRowLayout
from vllm_hisparse.worker.hot_state import (DEFAULT_GATHER_MODE, DEFAULT_LEADER_CTAS_PER_SM,
                                            DEFAULT_SIDE_MAX_CTAS,
                                            GroupGather, HotState)

#: Attribute under which a vLLM index group object carries its binding.
BINDING_ATTR = "_vllm_hisparse_residency"


@dataclasses.dataclass
class IndexGroupResidency:
    """One vLLM index group (leader + IndexShare followers) bound to its hot state.

    The fields are set at construction and stay as they are (:meth:`release_layers` empties
    the layer lists once, at shutdown). The per-step state is the leader's last resolve
    (``(step_id, flat rows, token rows)``, replaced by each :meth:`resolve_leader`: a plain
    tuple, for this runs per layer on every eager step) and whatever the hot
    state and the gather hold. The gather executor is built from the fields at construction
    (benchmarks replace it through :meth:`swap_gather`).

    Attributes:
        hot_state: the group's residency tables and hot slots.
        host_layers: uint8 ``[host_rows, row_bytes]`` host-pool views of the group's layers,
            leader first (the order of the vLLM index group).
        device_layers: uint8 flat row views of the same layers' device KV.
        layout: device row addressing (flat rows, ``block_stride_rows``).
        step: the worker's per-step view.
        record: optional callback ``(state_rows int32 [T], topk int32 [T, K])`` called at
            the leader for tracing (syncs; only when tracing is on).
        gather_mode: ``"side"`` (followers' gathers on a side stream, each follower waiting
            on its own event; the default, ``hot_state.DEFAULT_GATHER_MODE`` says why) or
            ``"single"`` (every layer in one launch at the leader); see
            :class:`~vllm_hisparse.worker.hot_state.GroupGather`.
        gather_chunks: side-mode launch schedule (``None`` = the default).
        prefetch_max_ctas: grid cap of the side-mode launches, in CTAs (0 = none; the
            default is ``hot_state.DEFAULT_SIDE_MAX_CTAS``).
        gather_ctas_per_sm: grid of the leader's gather launch, CTAs per SM (0 = the kernel's
            default; the default is ``hot_state.DEFAULT_LEADER_CTAS_PER_SM``).
        scores: the tap of the indexer's decode scores with score-aware eviction (the hot
            state's ``slot_class`` is filled from it before each resolve), or None (LRU).
    """

    hot_state: HotState
    host_layers: list[torch.Tensor]
    device_layers: list[torch.Tensor]
    layout: DeviceRowLayout
    step: StepView
    record: Callable[[torch.Tensor, torch.Tensor], None] | None = None
    gather_mode: str = DEFAULT_GATHER_MODE
    gather_chunks: tuple[int, ...] | None = None
    prefetch_max_ctas: int = DEFAULT_SIDE_MAX_CTAS
    gather_ctas_per_sm: int = DEFAULT_LEADER_CTAS_PER_SM
    scores: ScoreTap | None = None
    _gather: GroupGather = dataclasses.field(init=False, repr=False)
    _leader: tuple[int, torch.Tensor, torch.Tensor] | None = dataclasses.field(
        init=False, default=None, repr=False)
    _merged: tuple[tuple, Any] | None = dataclasses.field(init=False, default=None,
                                                          repr=False)
    _conversion: ConversionStream | None = dataclasses.field(init=False, default=None,
                                                             repr=False)

    def __post_init__(self):
        # Built now so that a bad mode or schedule fails at bind time, not in a forward.
        if self.scores is not None:
            self.hot_state.enable_slot_classes()
        self._gather = GroupGather(self.hot_state, self.host_layers, self.device_layers,
                                   mode=self.gather_mode, chunks=self.gather_chunks,
                                   side_max_ctas=self.prefetch_max_ctas,
                                   leader_ctas_per_sm=self.gather_ctas_per_sm)

    def attach(self, group: Any, conversion: ConversionStream | None = None) -> None:
        """Attach this binding to one vLLM index-group object (what the hooks look up).
        ``conversion``: the group's side stream, where the leader's conversion through the
        group method then runs, as vLLM's own does (:mod:`.conversion_stream`); None: the
        current stream."""
        setattr(group, BINDING_ATTR, self)
        self._conversion = conversion

    @property
    def conversion(self) -> ConversionStream | None:
        """The side stream of the leader's group-method conversion, or None."""
        return self._conversion

    def release_layers(self) -> None:
        """Drop the references to the KV and host tensors (shutdown)."""
        self.device_layers, self.host_layers = [], []

    def swap_gather(self, gather: Any) -> Any:
        """Run the group's miss plans through ``gather`` from now on; returns the executor
        it replaces. Benchmarks time the read path without copies this way."""
        previous, self._gather = self._gather, gather
        return previous

    @property
    def num_layers(self) -> int:
        return len(self.device_layers)

    @property
    def gather(self) -> GroupGather:
        """The executor of this group's miss plans."""
        return self._gather

    def resolve_leader(self, logical_topk: torch.Tensor, token_rows: torch.Tensor) -> None:
        """Resolve the group's top-k and launch its miss copies (leader layer): the leader's
        layer before this returns (in stream order), the followers' per ``gather_mode``.

        ``token_rows``: int32 ``[T]`` state row per token, -1 for tokens the resolver must
        skip (FULL requests, padding, workspace-mapped prefill tokens)."""
        if self.scores is not None:
            self._fill_slot_classes(logical_topk)
        result = self.hot_state.resolve(logical_topk.contiguous(), token_rows.contiguous())
        self._gather.launch(result)
        self._leader = (self.step.step_id, result.out_rows, token_rows)
        self._merged = None
        if self.record is not None:
            self.record(token_rows, logical_topk)

    def _fill_slot_classes(self, logical_topk: torch.Tensor) -> None:
        """This step's eviction classes from the leader's own indexer scores; all class 0
        (LRU) when the tap holds none for this top-k."""
        slot_class = self.hot_state.slot_class
        record = self.scores.take(logical_topk)
        if record is None:
            slot_class.zero_()
            return
        self.hot_state.fill_slot_classes(record.logits, record.threshold, record.width,
                                         record.next_n, self.step.batch_state_rows)

    def leader_rows(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat rows int32 [T, K], token state rows int32 [T]) the leader resolved this step."""
        if self._leader is None or self._leader[0] != self.step.step_id:
            raise RuntimeError("residency hook: a follower layer converted its top-k before "
                               "the index group's leader layer did in this step")
        _, rows, token_rows = self._leader
        if rows.shape[0] != num_tokens:
            raise RuntimeError(f"residency hook: follower converts {num_tokens} tokens but the "
                               f"leader resolved {rows.shape[0]}")
        return rows, token_rows

    def keep_merge(self, key: tuple, result: Any) -> None:
        """Keep the leader's final rows (``result`` of :func:`convert_with_residency`) for
        the followers that convert with the same ``key``."""
        self._merged = (key, result)

    def leader_merge(self, key: tuple) -> Any | None:
        """The leader's final rows of this step when it converted with ``key``, else None."""
        if self._merged is None or self._merged[0] != key:
            return None
        return self._merged[1]

    def wait_for_layer(self, layer_index: int) -> None:
        """Order the current stream (the layer's attention) after the copy of layer
        ``layer_index``'s misses (a stream wait on that layer's event; no host sync)."""
        if layer_index >= self.num_layers:
            raise RuntimeError(f"residency hook: layer {layer_index} of an index group bound "
                               f"with {self.num_layers} layers")
        self._gather.wait(layer_index)


def compact_valid_to_front(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid (``>= 0``) entries of each row moved to the front in their order, -1 after;
    plus int32 ``[T]`` counts: what vLLM's conversion returns with ``return_valid_counts=True``
    (its kernel only guarantees the set, we keep the order). ``ops.merge_rows`` with no
    tracked token; the CPU simulator's and the benchmarks' stand-in for vLLM's compaction."""
    rows = rows.to(torch.int32).contiguous()
    untracked = torch.full((rows.shape[0],), -1, dtype=torch.int32, device=rows.device)
    compacted = torch.empty_like(rows)
    counts = torch.empty(rows.shape[0], dtype=torch.int32, device=rows.device)
    ops.merge_rows(rows, untracked, rows, 1, 1, compacted, counts)
    return compacted, counts


def convert_with_residency(
    binding: IndexGroupResidency,
    layer_index: int,
    logical_topk: torch.Tensor,
    req_id_per_token: torch.Tensor,
    num_actual_tokens: int,
    vllm_rows: torch.Tensor | None,
    *,
    block_stride_rows: int | None,
    return_valid_counts: bool,
    keep_vllm: torch.Tensor | None = None,
    vllm_table: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Physical rows for a batch that holds tracked (residency-managed) requests.

    Args:
        binding: the index group's residency binding.
        layer_index: position of the layer in its index group (0 = leader: resolves and
            launches the group's gathers; a follower waits for its own layer's rows).
        logical_topk: int32 ``[T, K]`` request-relative positions, -1 = padding.
        req_id_per_token: int32 ``[T]`` batch row of each token.
        num_actual_tokens: tokens ``>=`` this are padding.
        vllm_rows: int32 ``[T, K]``: vLLM's own conversion of ``logical_topk``, uncompacted
            (column ``k`` ↔ selection ``k``), in the ``block_stride_rows`` index space; used
            for FULL requests' tokens. None with ``vllm_table``.
        block_stride_rows: the kernel's row space (``None`` = dense page rows).
        return_valid_counts: compact to the front and return counts, like vLLM.
        keep_vllm: optional bool ``[T]``: tokens that keep vLLM's value whatever their
            request (vLLM mapped them to its prefill workspace); never resolved.
        vllm_table: ``(block_table int32 [B, P], block_size)`` instead of ``vllm_rows``: the
            merge computes vLLM's decode conversion itself (``ops.merge_table_rows``), so
            vLLM's conversion kernel does not run. Only where vLLM's conversion has no prefill
            workspace, decode context parallelism or ``idx_mapping``.

    Returns:
        int32 ``[T, K]`` rows (and int32 ``[T]`` counts when ``return_valid_counts``).
    """
    num_tokens = logical_topk.shape[0]
    if (vllm_rows is None) == (vllm_table is None):
        raise ValueError("convert_with_residency: give vLLM's rows or its block table, not "
                         f"{'both' if vllm_rows is not None else 'neither'}")
    if vllm_rows is not None and vllm_rows.shape != logical_topk.shape:
        raise ValueError(f"convert_with_residency: vLLM rows {tuple(vllm_rows.shape)} do not "
                         f"match top-k {tuple(logical_topk.shape)}")
    if vllm_table is not None and keep_vllm is not None:
        raise ValueError("convert_with_residency: tokens that keep vLLM's rows need vLLM's "
                         "rows, not its block table")
    ops = binding.hot_state.ops
    if layer_index == 0:
        token_rows = binding.step.token_state_rows(req_id_per_token[:num_tokens],
                                                   num_actual_tokens, ops, consumer=binding)
        if keep_vllm is not None:
            token_rows = torch.where(keep_vllm[:num_tokens].to(torch.bool),
                                     torch.full_like(token_rows, -1), token_rows)
        binding.resolve_leader(logical_topk, token_rows)
    flat_rows, token_rows = binding.leader_rows(num_tokens)
    if layer_index > 0:
        binding.wait_for_layer(layer_index)
    layout = binding.layout
    target = layout.block_size if block_stride_rows is None else block_stride_rows
    # A follower that converts what its leader converted gets the leader's rows, as vLLM's
    # group conversion shares one result: every layer of the group names a row by the same
    # index (its own KV tensor), and the hot slots are the group's.
    key = None if vllm_table is None else _merge_key(
        binding.step.step_id, logical_topk, req_id_per_token, vllm_table, target,
        return_valid_counts)
    if layer_index > 0 and key is not None:
        shared = binding.leader_merge(key)
        if shared is not None:
            return shared
    # One launch: tracked tokens take resolve's rows (translated to the kernel's row space),
    # the others vLLM's (given, or computed from its block table), compacted when asked.
    rows = torch.empty_like(flat_rows)
    counts = (torch.empty(num_tokens, dtype=torch.int32, device=rows.device)
              if return_valid_counts else None)
    if vllm_table is None:
        ops.merge_rows(flat_rows, token_rows, vllm_rows.to(torch.int32).contiguous(),
                       layout.block_stride_rows, target, rows, counts)
    else:
        block_table, block_size = vllm_table
        ops.merge_table_rows(flat_rows, token_rows, logical_topk.contiguous(),
                             req_id_per_token[:num_tokens].to(torch.int32).contiguous(),
                             block_table.contiguous(), int(block_size),
                             layout.block_stride_rows, target, rows, counts)
    result = (rows, counts) if return_valid_counts else rows
    if layer_index == 0 and key is not None:
        binding.keep_merge(key, result)
    return result


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _merge_key(step_id: int, logical_topk: torch.Tensor, req_id_per_token: torch.Tensor,
               vllm_table: tuple[torch.Tensor, int], target: int,
               return_valid_counts: bool) -> tuple:
    """What a conversion's final rows depend on besides the leader's resolve (by identity:
    the inputs are vLLM's fixed buffers, the same tensors for every layer of a group)."""
    block_table, block_size = vllm_table
    return (step_id, _tensor_key(logical_topk), _tensor_key(req_id_per_token),
            _tensor_key(block_table), int(block_size), target, return_valid_counts)


def vllm_reference_conversion(req_id_per_token: torch.Tensor, block_table: torch.Tensor,
                              logical_topk: torch.Tensor, block_size: int,
                              block_stride_rows: int | None = None) -> torch.Tensor:
    """Pure-torch twin of vLLM's ``triton_convert_req_index_to_global_index`` without
    compaction (``sparse_utils.py:493``): ``block_table[req, p // bs] * stride + p % bs``,
    -1 for ``p < 0`` or a page outside the table. For CPU tests and the CPU simulator,
    where the Triton kernel cannot run. The rows ``ops.merge_table_rows`` computes
    (``reference.table_rows``)."""
    stride = block_size if block_stride_rows is None else block_stride_rows
    return ops.reference.table_rows(logical_topk, req_id_per_token, block_table, block_size,
                                    stride)


def uses_residency_path(binding: IndexGroupResidency) -> bool:
    """True when a conversion of a bound group goes through the residency path, False when
    vLLM's conversion answers alone (no added work).

    * In a step (``start_load_kv`` ran): the residency path when the step has tracked
      requests, or when the forward is being captured into a CUDA graph (a replay serves
      every later step, tracked or not).
    * vLLM bound the step's metadata but ``start_load_kv`` has not run: an error (the scheduler
      side must set ``has_sync_kv_loads``; the rows of host-backed requests are not known yet).
    * Outside a step: vLLM is capturing a CUDA graph, running the eager warm-up before a
      capture, or running a dummy batch (profiling, a data-parallel padding step). The view is
      inert, so the residency path resolves nothing and changes no state; it runs so that the
      captured graph holds it and the warm-up allocates its output storage outside the
      capture.
    """
    step = binding.step
    if step.ready:
        return step.uses_residency or capturing()
    if step.bound:
        raise RuntimeError(
            "HiSparseResidencyConnector: attention ran before the step's residency command was "
            "applied; the scheduler side must set scheduler_output.has_sync_kv_loads so that "
            "start_load_kv runs before the forward")
    return True


def hooked_conversion(group: Any, original: Callable[..., Any], layer_index: int,
                      logical_topk: torch.Tensor, attn_metadata: Any, *,
                      block_stride_rows: int | None, return_valid_counts: bool) -> Any:
    """Replacement body of ``SparseMLAIndexGroup.convert_logical_to_physical_topk``.

    ``original`` is vLLM's method (bound). Unbound groups and all-FULL steps take it as is
    (:func:`uses_residency_path`). Otherwise the leader's conversion runs where vLLM's would
    have: on the group's side stream from the indexer's ready event, when the binding has it
    (:mod:`.conversion_stream`), the followers' on the compute stream. vLLM's method does
    not run: it converts
    ``attn_metadata``'s ``req_id_per_token``, ``block_table`` and ``block_size`` (on a side
    stream, at the leader, for the group), which the final merge of
    :func:`convert_with_residency` computes for FULL requests' tokens in its own pass, with
    the same values (``ops.merge_table_rows``). Every layer of a bound group converts here
    in such a step, so none reads the group's buffers that the method would have filled.
    """
    binding: IndexGroupResidency | None = getattr(group, BINDING_ATTR, None)
    if binding is None or not uses_residency_path(binding):
        return original(layer_index, logical_topk, attn_metadata,
                        block_stride_rows=block_stride_rows,
                        return_valid_counts=return_valid_counts)
    num_actual = int(getattr(attn_metadata, "num_actual_tokens", logical_topk.shape[0]))
    convert = functools.partial(
        convert_with_residency, binding, layer_index, logical_topk,
        attn_metadata.req_id_per_token, num_actual, None, block_stride_rows=block_stride_rows,
        return_valid_counts=return_valid_counts,
        vllm_table=(attn_metadata.block_table, attn_metadata.block_size))
    if layer_index > 0 or binding.conversion is None:
        return convert()
    with binding.conversion.running():
        return convert()


_DIRECT_SIGNATURE: inspect.Signature | None = None


def _direct_arguments(original: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    global _DIRECT_SIGNATURE
    if _DIRECT_SIGNATURE is None:
        _DIRECT_SIGNATURE = inspect.signature(original)
    bound = _DIRECT_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def routed_direct_conversion(context: tuple[Any, int, Any], original: Callable[..., Any],
                             *args: Any, **kwargs: Any) -> Any:
    """Replacement of ``triton_convert_req_index_to_global_index`` at the backends' direct
    conversion sites (``compat.DIRECT_CONVERSION_SITES``) while a sparse-MLA layer runs.

    ``context`` is ``(index_group, index_in_group, attn_metadata)`` of the running layer.
    Unbound groups and steps without tracked requests call vLLM's function unchanged.
    Otherwise tracked requests' tokens get :func:`convert_with_residency` rows and the others
    vLLM's: with a prefill workspace vLLM's function computes them (uncompacted; they stay
    the answer for the tokens it maps to the workspace too), without one the merge computes
    them from the block table in its own pass (``ops.merge_table_rows``, the same values),
    so vLLM's kernel does not run. The caller's ``return_valid_counts`` / ``out`` /
    ``valid_counts_out`` contract is honoured.
    """
    group, layer_index, attn_metadata = context
    binding: IndexGroupResidency | None = getattr(group, BINDING_ATTR, None)
    if binding is None or not uses_residency_path(binding):
        return original(*args, **kwargs)
    a = _direct_arguments(original, args, kwargs)
    if int(a.get("dcp_size", 1)) != 1:
        raise NotImplementedError("HiSparseResidencyConnector: decode context parallelism "
                                  "(dcp_size > 1) is not supported with residency")
    if a.get("idx_mapping") is not None:
        raise NotImplementedError("HiSparseResidencyConnector: a direct top-k conversion with "
                                  "idx_mapping (state-row block tables) is not supported")
    return_valid_counts = bool(a["return_valid_counts"])
    out, counts_out = a["out"], a["valid_counts_out"]
    topk = a["token_indices"]
    num_actual = int(getattr(attn_metadata, "num_actual_tokens", topk.shape[0]))
    common = dict(block_stride_rows=a["BLOCK_STRIDE_ROWS"],
                  return_valid_counts=return_valid_counts)
    if a.get("HAS_PREFILL_WORKSPACE"):
        # vLLM's rows stay the answer for the tokens it maps to its prefill workspace.
        a.update(return_valid_counts=False, out=None, valid_counts_out=None)
        keep = a["prefill_workspace_request_ids"][: topk.shape[0]] >= 0
        result = convert_with_residency(binding, layer_index, topk, a["req_id"], num_actual,
                                        original(**a), keep_vllm=keep, **common)
    else:
        # Decode: the merge computes vLLM's rows itself; vLLM's kernel does not run.
        result = convert_with_residency(binding, layer_index, topk, a["req_id"], num_actual,
                                        None, vllm_table=(a["block_table"], a["BLOCK_SIZE"]),
                                        **common)
    return finish_conversion(result, return_valid_counts, out, counts_out)


def finish_conversion(result: Any, return_valid_counts: bool, out: torch.Tensor | None,
                      counts_out: torch.Tensor | None) -> Any:
    """The tail every conversion shares with vLLM's: ``result`` is the rows, or ``(rows,
    counts)`` when ``return_valid_counts``; they are written into the caller's ``out`` /
    ``counts_out`` buffers when given, and returned as vLLM's conversion returns them."""
    rows, counts = result if return_valid_counts else (result, None)
    if counts is not None and counts_out is not None:
        counts_out.copy_(counts)
        counts = counts_out
    if out is not None:
        out.copy_(rows)
        rows = out
    return (rows, counts) if return_valid_counts else rows


def host_backed_positions(hot_state: HotState, token_rows: torch.Tensor,
                          topk: torch.Tensor) -> dict[int, np.ndarray]:
    """Per state row, the distinct host-backed positions its tokens selected (syncs).

    Used for trace recording only."""
    rows = token_rows.cpu().numpy()
    sel = topk.cpu().numpy()
    residency = hot_state.residency.cpu().numpy()
    bs = hot_state.block_size
    out: dict[int, list[np.ndarray]] = {}
    for t, row in enumerate(rows):
        if row < 0:
            continue
        p = sel[t][sel[t] >= 0]
        host = p[residency[row, p // bs] < 0]
        out.setdefault(int(row), []).append(host)
    return {row: np.unique(np.concatenate(parts)) for row, parts in out.items()}
