"""The simulator's model: a synthetic DSA forward reduced to what decides which KV rows
attention reads.

:class:`SyntheticModel` stands in for the model inside vLLM's model runner. Per step it

* writes each scheduled token's KV (the ground truth of :mod:`.ground_truth`: one row per
  request, position and layer) into the slots the model runner's block tables name, in
  every sparse-MLA layer and every indexer layer (vLLM's slot mapping);
* draws the top-k of each scheduled token (the indexer's output): ``TopkGenerator`` for
  decode tokens (recent tokens, a drifting focus window and a few scattered positions), or,
  with ``topk_drift="scored"``, vLLM's ``SparseIndexerTopk`` over synthetic indexer scores
  (:mod:`.scored_indexer`), a seeded stride walk over the whole prefix for prefill tokens;
* runs every sparse-MLA layer's ``forward_mqa`` (:class:`SyntheticSparseMLAImpl`), which
  converts the top-k through vLLM's ``SparseMLAIndexGroup`` objects or the backend's direct
  conversion exactly as vLLM's sparse-MLA attention calls them, and checks every row the
  conversion returns against the ground truth.

The indexer's own scores (except for ``scored``) and the attention arithmetic are not
simulated. On CPU, where Triton cannot run, vLLM's conversions are replaced by pure-torch twins
(:func:`cpu_direct_conversion`, :func:`cpu_convert_once`; patches ``cpu_direct_conversion`` and
``cpu_group_conversion`` of ``vllm.patches``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.worker_side.read_path import (
    compact_valid_to_front,
    finish_conversion,
    vllm_reference_conversion,
)
from vllm_hisparse.vllm.setup.kv_plan import indexer_group_ids, sparse_group_ids
from vllm_hisparse.vllm.simulation.ground_truth import (INDEXER_LAYER_BASE, GroundTruth,
                                                        SimulationFailure)
from vllm_hisparse.vllm.simulation.scored_indexer import (DecodeLogits, RequestScores,
                                                          ScoredIndexer, is_decode)
from vllm_hisparse.vllm.simulation.spec import (SCORED_DRIFT, TOPK_DRIFTS, RequestPlan,
                                                SimulationSpec)
from vllm_hisparse.worker.device_rows import flat_row_view
from vllm_hisparse.worker.indexer_pages import page_view
from vllm_hisparse.worker.synthetic import TopkGenerator, describe_row, kv_rows

#: Where the generic sparse-MLA backend calls the direct conversion (a module global).
DIRECT_SITE_MODULE = "vllm.model_executor.layers.attention.sparse_mla_attention"


class SyntheticSparseMLAImpl:
    """Stands in for vLLM's sparse-MLA attention impl of one layer, reduced to what decides
    which KV rows attention reads. ``forward_mqa`` takes the indexer's top-k from
    ``topk_indices_buffer`` and converts it as vLLM's generic ``SparseMLACommonImpl.forward_mqa``
    does (``sparse_mla_attention.py:749-790``): through the layer's index group
    (``convert_logical_to_physical_topk``), or, with ``group_conversion_decode_only`` and a
    batch holding prefill tokens, through the module-global direct conversion on the batch
    block table. ``block_stride_rows`` comes from the cache's flat row view. It returns
    ``(physical rows, valid counts)`` instead of attention output: the simulator checks them."""

    def __init__(self, index_group: Any, index_group_index: int, topk_indices_buffer: torch.Tensor,
                 group_conversion_decode_only: bool):
        self.index_group = index_group
        self.index_group_index = index_group_index
        self.topk_indices_buffer = topk_indices_buffer
        self.group_conversion_decode_only = group_conversion_decode_only

    def record_logical_topk_ready(self) -> None:
        """What vLLM's model calls right after the layer's indexer (``mla.py:235``): the
        group's conversion starts from the event this records (on CUDA, at the leader)."""
        compat.record_logical_topk_ready(self.index_group, self.index_group_index)

    def forward_mqa(self, q: torch.Tensor, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any,
                    layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens = q.shape[0]
        topk = self.topk_indices_buffer[:num_tokens]
        block_size = attn_metadata.block_size
        _, block_stride_rows = flat_row_view(kv_c_and_k_pe_cache, block_size)
        if self.group_conversion_decode_only and not (
                self.index_group.num_layers > 1
                and attn_metadata.num_decode_tokens >= num_tokens):
            convert = compat.direct_conversion_at(DIRECT_SITE_MODULE)
            return convert(attn_metadata.req_id_per_token[:num_tokens], attn_metadata.block_table,
                           topk, BLOCK_SIZE=block_size, BLOCK_STRIDE_ROWS=block_stride_rows,
                           NUM_TOPK_TOKENS=topk.shape[1], return_valid_counts=True)
        return self.index_group.convert_logical_to_physical_topk(
            self.index_group_index, topk, attn_metadata, block_stride_rows=block_stride_rows,
            return_valid_counts=True)


def cpu_direct_conversion(req_id, block_table, token_indices, BLOCK_SIZE=64,
                          BLOCK_STRIDE_ROWS=None, NUM_TOPK_TOKENS=2048, BLOCK_N=128,
                          HAS_PREFILL_WORKSPACE=False, prefill_workspace_request_ids=None,
                          prefill_workspace_starts=None, prefill_workspace_rank_stride=None,
                          dcp_size=1, dcp_rank=0, cp_kv_cache_interleave_size=1,
                          return_valid_counts=False, out=None, valid_counts_out=None,
                          idx_mapping=None):
    """Pure-torch twin of vLLM's ``triton_convert_req_index_to_global_index``
    (``sparse_utils.py:493``, same signature) for CPU runs, where Triton cannot run. With
    ``HAS_PREFILL_WORKSPACE``, a token of a workspace request (``prefill_workspace_request_ids``
    ``>= 0``) gets its request's ``prefill_workspace_starts`` entry plus the logical index
    (-1 stays -1), as vLLM's kernel gives it. DCP and ``idx_mapping`` are not simulated."""
    if dcp_size != 1 or idx_mapping is not None:
        raise NotImplementedError("cpu_direct_conversion: DCP and idx_mapping are not simulated")
    rows = vllm_reference_conversion(req_id, block_table, token_indices, BLOCK_SIZE,
                                     BLOCK_STRIDE_ROWS)
    if HAS_PREFILL_WORKSPACE:
        ws = prefill_workspace_request_ids[: token_indices.shape[0]].to(torch.int64)
        start = prefill_workspace_starts.to(torch.int64)[ws.clamp(0)][:, None]
        offsets = torch.where(token_indices >= 0, start + token_indices, -1).to(torch.int32)
        rows = torch.where((ws >= 0)[:, None], offsets, rows)
    result = compact_valid_to_front(rows) if return_valid_counts else rows
    return finish_conversion(result, return_valid_counts, out, valid_counts_out)


def cpu_convert_once(layer_index, logical_topk_indices, req_id_per_token, block_table,
                     block_size, *, block_stride_rows, return_valid_counts, idx_mapping=None):
    """Pure-torch twin of ``SparseMLAIndexGroup._convert_once`` (same arguments) for CPU
    runs: vLLM's runs Triton on a side stream."""
    rows = vllm_reference_conversion(req_id_per_token, block_table, logical_topk_indices,
                                     block_size, block_stride_rows)
    return compact_valid_to_front(rows) if return_valid_counts else rows


@contextlib.contextmanager
def cpu_direct_twin() -> Iterator[None]:
    """:func:`cpu_direct_conversion` in place of vLLM's Triton function for one CPU run, so
    that the worker role's ``direct_conversion_routing`` (installed when it binds) wraps the
    twin; vLLM's function is back afterwards."""
    patches.DIRECT_CONVERSION_ROUTING.remove()  # it must wrap the twin: re-installed at bind
    patches.CPU_DIRECT_CONVERSION.install(cpu_direct_conversion)
    try:
        yield
    finally:
        patches.DIRECT_CONVERSION_ROUTING.remove()
        patches.CPU_DIRECT_CONVERSION.remove()


def make_index_group(top_k: int, max_tokens: int, device: torch.device) -> Any:
    """vLLM's ``SparseMLAIndexGroup`` for one index unit. On CUDA it has an indexer, as a
    DSA model's groups do: its conversion starts from the event
    :meth:`SyntheticSparseMLAImpl.record_logical_topk_ready` records. On CPU its conversion
    is the pure-torch twin :func:`cpu_convert_once`."""
    cls = compat.sparse_mla_index_group_class()
    buf = torch.zeros((max_tokens, top_k), dtype=torch.int32, device=device)
    on_cuda = device.type == "cuda"
    group = cls(logical_topk_indices=buf, physical_topk_indices=torch.zeros_like(buf),
                valid_topk_counts=torch.zeros(max_tokens, dtype=torch.int32, device=device),
                side_stream=torch.cuda.Stream(device) if on_cuda else None,
                logical_topk_ready=torch.cuda.Event() if on_cuda else None,
                physical_topk_ready=torch.cuda.Event() if on_cuda else None,
                has_indexer=on_cuda)
    if not on_cuda:
        patches.CPU_GROUP_CONVERSION.install(group, cpu_convert_once)
    return group


@dataclass
class RequestState:
    """One request as the model runner holds it."""

    plan: RequestPlan
    block_ids: list[list[int]] | None = None  # per sparse group (model runner's view)
    next_pos: int = 0  # the position the model runner expects next
    topk: TopkGenerator | None = None
    scores: RequestScores | None = None  # topk_drift "scored"
    indexer_block_ids: list[list[int]] | None = None  # per indexer group


#: One request of a step's batch: ``(request id, state, first position, tokens)``.
BatchEntry = tuple[str, RequestState, int, int]


class SyntheticModel:
    """The synthetic DSA model over vLLM's per-layer KV tensors of one plan.

    Args:
        spec: the simulation.
        full_config: vLLM's KV cache config of the plan (every layer).
        kv: layer name -> the KV tensor vLLM's worker allocated for it.
        forward_context: vLLM's static forward context; the model registers its sparse-MLA
            attention layers there, as vLLM's model construction does, so that the worker
            role finds their index groups.
        sequences: serial -> every token of the request (the ground truth's input).
    """

    def __init__(self, spec: SimulationSpec, full_config: Any, kv: dict[str, torch.Tensor],
                 forward_context: dict[str, Any], sequences: Mapping[int, Sequence[int]]):
        self.spec = spec
        self.device = torch.device(spec.device)
        self.block_size = spec.block_size
        self.kv = kv
        self.sparse_groups = sparse_group_ids(full_config)
        # Sparse-MLA layers: name -> (group id, model layer, flat row view, block stride rows).
        self.layers: dict[str, tuple[int, int, torch.Tensor, int]] = {}
        units: list[tuple[int, list[str]]] = []  # (group id, layer names), leader first
        for g in self.sparse_groups:
            group = full_config.kv_cache_groups[g]
            per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
            for name in group.layer_names:
                rows, stride = flat_row_view(kv[name], self.block_size)
                self.layers[name] = (g, int(name.split(".")[2]), rows, stride)
                leader = getattr(per_layer.get(name), "is_index_group_leader", True)
                if leader or not units or units[-1][0] != g:
                    units.append((g, [name]))
                else:
                    units[-1][1].append(name)
        self.row_bytes = next(iter(self.layers.values()))[2].shape[1]
        # Indexer layers: name -> (index among the indexer groups, layer, uint8 view
        # [num_blocks, block_size, row_bytes]). The forward writes them; prefix hits must
        # bring them back. (Their blocks are packed at a stride that is not a whole number
        # of rows, so no flat row view.)
        self.indexer_groups = indexer_group_ids(full_config)
        self.indexer_layers: dict[str, tuple[int, int, torch.Tensor]] = {}
        for i, g in enumerate(self.indexer_groups):
            for name in full_config.kv_cache_groups[g].layer_names:
                pages = page_view(kv[name])
                view = pages.view(torch.uint8).as_strided(
                    (pages.shape[0], self.block_size, pages.shape[1] // self.block_size),
                    (pages.stride(0), pages.shape[1] // self.block_size, 1))
                self.indexer_layers[name] = (i, int(name.split(".")[2]), view)
        # The model's sparse-MLA attention layers, as the connector finds them (static
        # forward context): one per layer, the layers of an index unit sharing one group and
        # one top-k buffer (what the unit's indexer writes).
        max_tokens = spec.max_num_batched_tokens + spec.max_num_seqs
        #: (group id, layer names, vLLM index group) per index unit.
        self.units: list[tuple[int, list[str], Any]] = []
        self.impls: dict[str, SyntheticSparseMLAImpl] = {}
        for g, names in units:
            group = make_index_group(spec.top_k, max_tokens, self.device)
            self.units.append((g, names, group))
            topk_buffer = torch.full((max_tokens, spec.top_k), -1, dtype=torch.int32,
                                     device=self.device)
            for i, name in enumerate(names):
                group.register_layer()
                impl = SyntheticSparseMLAImpl(group, i, topk_buffer, spec.attention == "direct")
                self.impls[name] = impl
                forward_context[name] = SimpleNamespace(impl=impl)
        #: topk_drift "scored": the decode indexer, and the logits of the step's decode rows
        #: (from :meth:`selections` to :meth:`attend`).
        self.scored = (ScoredIndexer(spec.top_k, spec.seed, self.device)
                       if spec.topk_drift == SCORED_DRIFT else None)
        self._decode_logits: DecodeLogits | None = None
        #: The ground truth, or None without checks (``spec.check`` False: timing runs), when
        #: the KV bytes are written without a per-request store and nothing is compared.
        self.truth = (GroundTruth(sequences, num_layers=spec.num_layers,
                                  max_model_len=spec.max_model_len, block_size=self.block_size,
                                  row_bytes=self.row_bytes, device=self.device)
                      if spec.check else None)

    # ------------------------------------------------------------------ writing KV

    def write_kv(self, batch: Sequence[BatchEntry], step: int,
                 slots: dict[str, Any] | None = None) -> None:
        """Each scheduled token's KV into the slot the model runner's block table names
        (vLLM's slot mapping), in every sparse-MLA and indexer layer. Without a ground truth
        (timing runs) ``slots`` (:meth:`slot_mapping`) is required: one write per layer for
        the whole batch, bytes from :func:`kv_rows` of each position (request 0: nothing is
        compared, only the traffic and the slots matter)."""
        if self.truth is None:
            pos, offsets = slots["positions"], slots["positions"] % self.block_size
            for name, (g, layer, view, stride) in self.layers.items():
                view[slots["sparse"][g] * stride + offsets] = kv_rows(0, pos, layer,
                                                                      view.shape[1])
            for name, (i, layer, view) in self.indexer_layers.items():
                view[slots["indexer"][i], offsets] = kv_rows(0, pos, INDEXER_LAYER_BASE + layer,
                                                             view.shape[2])
            return
        bs = self.block_size
        group_index = {g: i for i, g in enumerate(self.sparse_groups)}
        for rid, state, start, n in batch:
            serial = state.plan.serial
            slot = self.truth.slot(serial)
            truth = self.truth.store[slot]  # after slot(): the store may have grown
            pos = torch.arange(start, start + n, device=self.device)
            blocks = {g: self._block_of(state, i, pos // bs, step) for g, i in group_index.items()}
            for name, (g, layer, view, stride) in self.layers.items():
                rows = blocks[g] * stride + pos % bs
                view[rows] = truth[layer, start:start + n]
            for name, (g, layer, view) in self.indexer_layers.items():
                table = torch.as_tensor(state.indexer_block_ids[g], dtype=torch.int64,
                                        device=self.device)
                view[table[pos // bs], pos % bs] = self.truth.indexer_rows(
                    serial, pos, layer, view.shape[2])

    def slot_mapping(self, batch: Sequence[BatchEntry], step: int) -> dict[str, Any]:
        """Where the step's tokens go, as the model runner prepares it before the forward:
        ``positions`` (int64 ``[T]``), ``sparse`` (sparse group id -> block of each token) and
        ``indexer`` (indexer group index -> block of each token), all on the model's device."""
        bs = self.block_size
        counts = np.asarray([n for *_, n in batch], dtype=np.int64)
        starts = np.asarray([start for _, _, start, _ in batch], dtype=np.int64)
        first = np.cumsum(counts) - counts
        req = np.repeat(np.arange(len(batch)), counts)
        positions = np.repeat(starts, counts) + np.arange(int(counts.sum())) - first[req]
        pages = positions // bs

        def blocks(tables: list[list[int]], what: str) -> torch.Tensor:
            lengths = np.asarray([len(t) for t in tables], dtype=np.int64)
            short = np.nonzero(pages >= lengths[req])[0]
            if short.size:
                t = int(short[0])
                raise SimulationFailure(
                    f"step {step}: {batch[req[t]][0]} writes page {int(pages[t])} but the model "
                    f"runner's {what} has {int(lengths[req[t]])} blocks")
            padded = np.zeros((len(tables), int(lengths.max())), dtype=np.int64)
            for b, ids in enumerate(tables):
                padded[b, :len(ids)] = ids
            return torch.from_numpy(padded[req, pages]).to(self.device)

        return dict(
            positions=torch.from_numpy(positions).to(self.device),
            sparse={g: blocks([state.block_ids[i] for _, state, _, _ in batch],
                              f"block table of KV cache group {g}")
                    for i, g in enumerate(self.sparse_groups)},
            indexer={i: blocks([state.indexer_block_ids[i] for _, state, _, _ in batch],
                               f"indexer block table {i}")
                     for i in range(len(self.indexer_groups))})

    def _block_of(self, state: RequestState, group_index: int, pages: torch.Tensor,
                  step: int) -> torch.Tensor:
        table = state.block_ids[group_index]
        if int(pages.max()) >= len(table):
            raise SimulationFailure(f"step {step}: {state.plan.request_id} writes page "
                                    f"{int(pages.max())} but the model runner's block table of "
                                    f"KV cache group {self.sparse_groups[group_index]} has "
                                    f"{len(table)} blocks")
        return torch.as_tensor(table, dtype=torch.int64, device=self.device)[pages]

    def indexer_prefix_mismatch(self, state: RequestState, num_computed: int
                                ) -> tuple[int, int, str, str] | None:
        """A request that starts a step with ``num_computed`` computed tokens (a prefix hit,
        local or from the host tier, or a resume) must find its indexer KV in place for all
        of them: ``(layer, position, got, want)`` of the first wrong row, or None."""
        bs = self.block_size
        pos = torch.arange(num_computed, device=self.device)
        for name, (g, layer, view) in self.indexer_layers.items():
            blocks = torch.as_tensor(state.indexer_block_ids[g], dtype=torch.int64,
                                     device=self.device)[pos // bs]
            got = view[blocks, pos % bs]
            want = self.truth.indexer_rows(state.plan.serial, pos, layer, view.shape[2])
            bad = (got != want).any(dim=1).nonzero()
            if bad.numel():
                p = int(bad[0])
                return layer, p, describe_row(got[p]), describe_row(want[p])
        return None

    # ------------------------------------------------------------------ attention

    def attention_metadata(self, batch: Sequence[BatchEntry]) -> dict[str, Any]:
        """Layer name -> the attention metadata of its KV cache group: the batch block table
        (one tensor per group, shared by its layers, as vLLM builds it), the batch row of
        every token, and the decode / prefill split (decodes first, as vLLM orders them)."""
        bs = self.block_size
        req_of_token = [torch.full((n,), b, dtype=torch.int32)
                        for b, (_, _, _, n) in enumerate(batch)]
        req_id_per_token = torch.cat(req_of_token).to(self.device)
        num_tokens = int(req_id_per_token.shape[0])
        num_decode_tokens = 0
        for _, _, _, n in batch:
            if n > 1:
                break
            num_decode_tokens += n
        out: dict[str, Any] = {}
        for g_index, g in enumerate(self.sparse_groups):
            width = max(len(state.block_ids[g_index]) for _, state, _, _ in batch)
            table = torch.zeros((len(batch), max(1, width)), dtype=torch.int32)
            for b, (_, state, _, _) in enumerate(batch):
                ids = state.block_ids[g_index]
                table[b, :len(ids)] = torch.as_tensor(ids, dtype=torch.int32)
            md = SimpleNamespace(req_id_per_token=req_id_per_token,
                                 block_table=table.to(self.device), block_size=bs,
                                 num_actual_tokens=num_tokens,
                                 num_decode_tokens=num_decode_tokens)
            for name, (layer_group, *_rest) in self.layers.items():
                if layer_group == g:
                    out[name] = md
        return out

    def selections(self, batch: Sequence[BatchEntry]) -> tuple[torch.Tensor, list[tuple]]:
        """The step's top-k (what the indexers would output), on the model's device: int32
        ``[T, K]`` in token order, and the spans ``(request id, serial, first token, tokens,
        first position)`` of the batch's requests. With ``scored`` decode selections the
        decode rows (the batch's first, :func:`.scored_indexer.decodes_first`) are -1 here:
        :meth:`attend` selects them from the logits this computes."""
        spans, topks = [], []
        t = 0
        self._decode_logits = None
        if self.scored is not None:
            self._decode_logits, topks = self._decode_rows(batch)
            t = len(topks)
        for rid, state, start, n in batch[t:]:
            topks.append(self._selections(state, start, n))
        t = 0
        for rid, state, start, n in batch:
            spans.append((rid, state.plan.serial, t, n, start))
            t += n
        if all(s.device.type == "cpu" for s in topks):  # decode-only: one copy
            return torch.cat(topks).to(self.device), spans
        return torch.cat([s.to(self.device) for s in topks]), spans

    def attend(self, batch: Sequence[BatchEntry], metadata: dict[str, Any], topk: torch.Tensor,
               spans: Sequence[tuple], *, fail: Callable[[str, int, int, str], None],
               request_note: Callable[[str], str],
               after_layer: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None,
               ) -> tuple[int, int]:
        """Every sparse-MLA layer's attention, reduced to its top-k conversion: the unit's
        indexer fills the top-k buffer (``topk``, ``spans`` from :meth:`selections`), each
        layer's ``forward_mqa`` converts it, and every row it returns is checked against the
        ground truth (unless the model has none). ``fail(request id, layer, token position,
        what)`` raises; ``after_layer(layer name, rows, counts)`` sees each conversion.
        Returns ``(rows checked, tokens)``. With ``scored`` decode selections the unit's
        indexer runs vLLM's ``SparseIndexerTopk`` into the buffer's decode rows right before
        the unit's leader converts: each leader's conversion follows a fresh top-k."""
        t = topk.shape[0]
        q = torch.empty((t, 1), device=self.device)
        rows_checked = 0
        decode = self._decode_logits
        for _, names, _ in self.units:
            leader = self.impls[names[0]]
            buffer = leader.topk_indices_buffer
            buffer[:t] = topk
            if decode is not None:
                self.scored.select(decode, buffer[:decode.num_rows])
                topk = buffer[:t].clone()  # what the unit's layers convert
            leader.record_logical_topk_ready()
            for name in names:
                _, layer, view, _ = self.layers[name]
                rows, counts = self.impls[name].forward_mqa(q, self.kv[name], metadata[name],
                                                            None)
                if after_layer is not None:
                    after_layer(name, rows, counts)
                if self.truth is None:
                    continue
                rows_checked += self.truth.check_conversion(
                    rows, counts, topk, spans, layer, view,
                    any_order=self.device.type == "cuda",
                    fail=lambda rid, pos, what, layer=layer: fail(rid, layer, pos, what),
                    request_note=request_note)
        return rows_checked, t

    def _selections(self, state: RequestState, start: int, n: int) -> torch.Tensor:
        """int32 ``[n, K]`` top-k of the tokens at positions ``start .. start + n - 1`` (each
        attends to ``[0, p]``); -1 padding only at the end of a row. Decode tokens' come from
        the CPU generator; prefill tokens' are computed on the model's device (a long prompt's
        ``[n, K]`` is large), from a start drawn on the CPU: the same values on any device."""
        k = self.spec.top_k
        if is_decode(state, start, n):
            if state.topk is None:
                profiles = TOPK_DRIFTS[self.spec.topk_drift]
                drift, scatter = profiles[state.plan.serial % len(profiles)]
                state.topk = TopkGenerator(k, seed=state.plan.serial * 1_000 + self.spec.seed,
                                           recent=min(32, k // 2), drift_tokens=drift,
                                           random_fraction=scatter)
            return state.topk.select(start + 1).reshape(1, k)
        # Prefill: ``prefill_top_k`` distinct positions per token spread over the whole
        # prefix (a stride walk from a seeded random start), -1 after them. Fewer than K
        # keeps the check of long prompts cheap; every returned row is still checked.
        kp = min(k, self.spec.prefill_top_k)
        g = torch.Generator().manual_seed(state.plan.serial * 65_537 + start)
        ctx_cpu = torch.arange(start + 1, start + n + 1, dtype=torch.int64)
        first = (torch.rand(n, generator=g) * ctx_cpu).to(torch.int64).to(self.device)
        ctx = ctx_cpu.to(self.device)
        j = torch.arange(k, dtype=torch.int64, device=self.device)
        stride = torch.clamp(ctx // kp, min=1)  # j * stride < ctx for j < min(kp, ctx)
        sel = (first[:, None] + j[None, :] * stride[:, None]) % ctx[:, None]
        valid = (j[None, :] < ctx[:, None]) & (j[None, :] < kp)
        sel = torch.where(valid, sel, torch.full_like(sel, -1))
        return sel.to(torch.int32)

    def _decode_rows(self, batch: Sequence[BatchEntry]
                     ) -> tuple[DecodeLogits | None, list[torch.Tensor]]:
        """``scored``: the logits of the batch's leading decode tokens and a -1 ``[1, K]`` row
        per decode token; a decode token after another request's tokens is a failure (logits
        row i must be batch row i)."""
        decodes = []
        for b, (rid, state, start, n) in enumerate(batch):
            if not is_decode(state, start, n):
                if any(is_decode(*entry[1:]) for entry in batch[b:]):
                    raise SimulationFailure(f"{rid} ({n} tokens at {start}) precedes a decode "
                                            "token: the scored indexer needs decodes first")
                break
            if state.scores is None:
                state.scores = self.scored.request_scores(
                    state.plan.serial, state.plan.prompt_len + state.plan.output_len)
            decodes.append((state.scores, start + 1))
        if not decodes:
            return None, []
        unset = torch.full((1, self.spec.top_k), -1, dtype=torch.int32)
        return self.scored.logits(decodes), [unset] * len(decodes)
