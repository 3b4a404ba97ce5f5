"""Pure-torch twins of the data-plane ops (docs/design.md, "Op contracts").

Every function here has the same name, arguments and results as the CUDA op in
``vllm_hisparse.ops`` and is the definition the kernels are tested against, bit for bit.
They run on any device (CPU in CI and in the simulator) and favour clarity over speed,
but are vectorised per request so that a CPU decode step stays in milliseconds.

Conventions shared by all ops:

* indices are int32 and ``-1`` is the sentinel for "none / padding";
* a "layer list" is a sequence of uint8 tensors ``[rows, row_bytes]`` (one per layer); a copy
  op moves whole rows for every layer of the list;
* nothing is allocated in the caller's tensors' place: outputs are written in place.

``resolve`` raises :class:`~vllm_hisparse.ops.errors.ResolveError` (a ``ValueError``) for
every broken precondition and then leaves every output and every IN/OUT tensor untouched,
because all requests are checked before anything is written. Every twin also runs the
data-dependent checks of ``ops/_checks.py`` (negative or int32-overflowing ids, duplicate
destinations, a corrupt ``lru``), which the CUDA backend runs only with
``HISPARSE_CHECK_INPUTS=1``; they raise the ``OpInputError`` subclasses of ``ops/errors.py``
before anything is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_hisparse.ops import _checks, _conversion_checks
from vllm_hisparse.ops.errors import ResolveError, ResolveErrorCode
# The score ops' twins live in their own module (one concept per file); re-exported here so
# that every op's twin is ``reference.<name>``.
from vllm_hisparse.ops.reference_scores import score_threshold, slot_classes

__all__ = ["resolve", "gather_rows", "copy_blocks", "mirror_rows", "token_state_rows",
           "merge_rows", "merge_table_rows", "score_threshold", "slot_classes", "MAX_SLOT_CLASS"]

#: ``slot_class`` values above this count as this (four eviction classes, 0 evicted first).
MAX_SLOT_CLASS = 3


# --------------------------------------------------------------------------------------
# resolve
# --------------------------------------------------------------------------------------


@dataclass
class _RequestPlan:
    """What resolving one request writes; computed for all requests before any write."""

    row: int
    first_token: int
    num_tokens: int
    token_rows_out: torch.Tensor  # int64 [num_tokens, K], -1 for padding selections
    copies_src: torch.Tensor  # int64 [num_misses]
    copies_dst: torch.Tensor  # int64 [num_misses]
    new_slot_pos: torch.Tensor | None  # int64 [D] or None when the hot state is untouched
    new_lru: torch.Tensor | None  # int64 [D]
    num_resident: int
    num_hits: int


def _request_runs(token_rows: list[int], num_rows: int) -> list[tuple[int, int, int]]:
    """Split the batch into (state_row, first_token, num_tokens) runs; padding tokens skipped."""
    runs: list[tuple[int, int, int]] = []
    first_token_of_row: dict[int, int] = {}
    t = 0
    num_tokens = len(token_rows)
    while t < num_tokens:
        row = token_rows[t]
        if row < -1 or row >= num_rows:
            raise ResolveError(ResolveErrorCode.STATE_ROW_OUT_OF_RANGE, -1, row, num_rows)
        if row == -1:
            t += 1
            continue
        start = t
        while t < num_tokens and token_rows[t] == row:
            t += 1
        if row in first_token_of_row:
            raise ResolveError(
                ResolveErrorCode.NOT_CONTIGUOUS, row, start, first_token_of_row[row]
            )
        first_token_of_row[row] = start
        runs.append((row, start, t - start))
    return runs


def _plan_request(
    row: int,
    first_token: int,
    selections: torch.Tensor,  # int64 [n, K]
    residency_row: torch.Tensor,  # int64 [P]
    host_blocks_row: torch.Tensor,  # int64 [P]
    hot_blocks_row: torch.Tensor,  # int64 [D // bs]
    slot_pos_row: torch.Tensor,  # int64 [D]
    lru_row: torch.Tensor,  # int64 [D]
    block_size: int,
    slot_class_row: torch.Tensor | None,  # int64 [D] or None
) -> _RequestPlan:
    num_tokens, k = selections.shape
    num_positions = residency_row.numel() * block_size
    num_slots = slot_pos_row.numel()
    flat = selections.reshape(-1)

    bad = (flat < -1) | (flat >= num_positions)
    if bool(bad.any()):
        value = int(flat[bad][0])
        raise ResolveError(ResolveErrorCode.POSITION_OUT_OF_RANGE, row, value, num_positions)

    valid = flat >= 0
    out_flat = torch.full_like(flat, -1)
    empty = torch.empty(0, dtype=torch.int64, device=flat.device)
    if not bool(valid.any()):
        return _RequestPlan(row, first_token, num_tokens, out_flat.view(num_tokens, k),
                            empty, empty, None, None, 0, 0)

    # Distinct positions in first-reference order (row-major over (t, k)).
    refs = flat[valid]
    uniq, inverse = torch.unique(refs, return_inverse=True)
    ref_index = torch.arange(refs.numel(), device=flat.device)
    first_ref = torch.full((uniq.numel(),), refs.numel(), dtype=torch.int64, device=flat.device)
    first_ref.scatter_reduce_(0, inverse, ref_index, reduce="amin")
    order = torch.argsort(first_ref)  # distinct positions sorted by first reference
    positions = uniq[order]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=flat.device)

    pages = positions // block_size
    offsets = positions % block_size
    resident_block = residency_row[pages]
    resident = resident_block >= 0
    rows_of_positions = torch.where(resident, resident_block * block_size + offsets,
                                    torch.full_like(positions, -1))

    host_backed = ~resident
    hb_positions = positions[host_backed]
    hb_host_block = host_blocks_row[pages[host_backed]]
    if bool((hb_host_block < 0).any()):
        missing = hb_positions[hb_host_block < 0][0]
        raise ResolveError(ResolveErrorCode.NO_HOST_BLOCK, row, int(missing),
                           int(missing) // block_size)
    num_host_backed = hb_positions.numel()
    # A slot is leased when its hot block is: only leased slots can take a miss.
    slot_leased = hot_blocks_row[torch.arange(num_slots, device=flat.device) // block_size] >= 0
    num_leased = int(slot_leased.sum())
    if num_host_backed > num_leased:
        raise ResolveError(ResolveErrorCode.HOT_OVERFLOW, row, num_host_backed, num_leased)

    num_resident = int(resident.sum())
    if num_host_backed == 0:
        # Resident positions never touch the hot state.
        out_flat[valid] = rows_of_positions[rank[inverse]]
        return _RequestPlan(row, first_token, num_tokens, out_flat.view(num_tokens, k),
                            empty, empty, None, None, num_resident, 0)

    # Hits: the slot (exactly one) whose slot_pos equals the position.
    sorted_pos, sorted_slot = torch.sort(slot_pos_row, stable=True)
    left = torch.searchsorted(sorted_pos, hb_positions, right=False)
    right = torch.searchsorted(sorted_pos, hb_positions, right=True)
    holders = right - left
    if bool((holders > 1).any()):
        dup = int(torch.nonzero(holders > 1)[0])
        raise ResolveError(ResolveErrorCode.DUPLICATE_SLOT, row, int(hb_positions[dup]),
                           int(sorted_slot[left[dup]]))
    # The kernel's order: the lru is read (and checked) only past every check above.
    _checks.check_lru_rows(torch.tensor([row]), lru_row[None])
    is_hit = holders == 1
    hb_slot = torch.full_like(hb_positions, -1)
    hb_slot[is_hit] = sorted_slot[left[is_hit]]

    # A hit on a slot whose hot block is -1: the slot should be empty (corrupt hot state).
    hit_block = hot_blocks_row[hb_slot[is_hit] // block_size]
    if bool((hit_block < 0).any()):
        j = int(torch.nonzero(hit_block < 0)[0])
        raise ResolveError(ResolveErrorCode.HOT_BLOCK_MISSING, row, int(hb_slot[is_hit][j]),
                           int(hb_positions[is_hit][j]))

    slot_is_hit = torch.zeros(num_slots, dtype=torch.bool, device=flat.device)
    slot_is_hit[hb_slot[is_hit]] = True
    lru_is_hit = slot_is_hit[lru_row]
    lru_leased = slot_leased[lru_row]
    unleased = lru_row[~lru_is_hit & ~lru_leased]  # never taken, in current LRU order
    evictable = lru_row[~lru_is_hit & lru_leased]  # not hit, leased, in current LRU order
    hit_slots = lru_row[lru_is_hit]  # hits, in current LRU order
    miss_positions = hb_positions[~is_hit]  # misses in first-reference order
    num_misses = miss_positions.numel()
    # Victims: lowest eviction class first (all 0 without slot_class), LRU order within one.
    if slot_class_row is None:
        victim_order = torch.arange(evictable.numel(), device=flat.device)
    else:
        victim_order = torch.sort(slot_class_row[evictable].clamp(max=MAX_SLOT_CLASS),
                                  stable=True).indices
    taken_mask = torch.zeros(evictable.numel(), dtype=torch.bool, device=flat.device)
    taken_mask[victim_order[:num_misses]] = True
    taken = evictable[victim_order[:num_misses]]  # victim i takes miss i
    hb_slot[~is_hit] = taken

    slot_block = hot_blocks_row[hb_slot // block_size]  # leased: checked above
    hb_rows = slot_block * block_size + hb_slot % block_size
    rows_of_positions[host_backed] = hb_rows

    miss_host_block = hb_host_block[~is_hit]
    copies_src = miss_host_block * block_size + miss_positions % block_size
    copies_dst = hb_rows[~is_hit]

    new_slot_pos = slot_pos_row.clone()
    new_slot_pos[taken] = miss_positions
    new_lru = torch.cat([unleased, evictable[~taken_mask], taken, hit_slots])

    out_flat[valid] = rows_of_positions[rank[inverse]]
    return _RequestPlan(row, first_token, num_tokens, out_flat.view(num_tokens, k),
                        copies_src, copies_dst, new_slot_pos, new_lru, num_resident,
                        int(is_hit.sum()))


def resolve(
    topk: torch.Tensor,
    token_rows: torch.Tensor,
    residency: torch.Tensor,
    host_blocks: torch.Tensor,
    hot_blocks: torch.Tensor,
    slot_pos: torch.Tensor,
    lru: torch.Tensor,
    block_size: int,
    out_rows: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    stats: torch.Tensor | None = None,
    slot_class: torch.Tensor | None = None,
) -> None:
    """Map logical top-k positions to device rows, planning host→hot copies for misses.

    Args (T tokens, K selections, R state rows, P pages, D hot slots, bs = ``block_size``):
        topk: int32 ``[T, K]`` logical positions per query token; ``-1`` = padding.
        token_rows: int32 ``[T]`` state row of each token; ``-1`` = padding token. The tokens
            of one request are contiguous.
        residency: int32 ``[R, P]`` device block of each resident page; ``-1`` = not resident.
        host_blocks: int32 ``[R, P]`` host block of each page; ``-1`` = none.
        hot_blocks: int32 ``[R, D // bs]`` device blocks of each hot region; ``-1`` = not
            leased: its slots are never taken by a miss (a region of fewer than D / bs blocks).
        slot_pos: int32 ``[R, D]`` IN/OUT, position held by each hot slot; ``-1`` = empty.
        lru: int16 ``[R, D]`` IN/OUT, a permutation of the hot slots, least recent first.
        block_size: positions per page (bs).
        out_rows: int32 ``[T, K]`` OUT, device row of every selection; ``-1`` for padding.
        miss_src, miss_dst: int32 ``[T, K]`` OUT, host row → device row copies. A request's
            copies fill its own token rows in row-major order: copy ``i`` of a request whose
            first token is ``t0`` sits at ``[t0 + i // K, i % K]``. Entries past
            ``miss_count[t]`` are unspecified (left as they were).
        miss_count: int32 ``[T]`` OUT, copies in each row.
        stats: int64 ``[3]`` IN/OUT or None; adds the counts of distinct (resident, hot hit,
            miss) positions.
        slot_class: uint8 ``[R, D]`` or None: eviction class of each slot this step (0 is
            evicted first; values above ``MAX_SLOT_CLASS`` count as it). None = every slot
            class 0, i.e. plain LRU.

    Per request, with U its distinct valid positions in first-reference order: resident
    positions map to ``residency * bs + p % bs`` and never touch the hot state; the others
    are hits (a slot holds them) or misses. Evictable slots are the leased slots (hot block
    not -1) that were not hit; misses take them in order of (class, ``lru`` order). The new
    ``lru`` is [unleased, old order] + [evictable not taken, old order] + [taken, miss order]
    + [hits, old order]. A request with no host-backed position leaves ``lru`` and
    ``slot_pos`` as they are.

    Raises:
        ResolveError: a position outside ``[0, P * bs)``; a host-backed page with host block
            -1; more distinct host-backed positions than leased slots (``HOT_OVERFLOW``); a
            request's tokens not contiguous; a state row outside ``[-1, R)``; a hit on a slot
            whose hot block is -1 (``HOT_BLOCK_MISSING``: such a slot must be empty); one
            host-backed position held by two slots; an ``lru`` value outside ``[0, D)``
            (``CORRUPT_LRU``) or a slot twice in it (``DUPLICATE_LRU_SLOT``), for a request
            with a host-backed selection only, after the checks before it (the kernel's order).
        NegativeIdError, RowOverflowError: a ``residency``/``host_blocks``/``hot_blocks`` entry
            of a state row in the batch below -1, or a block whose rows overflow int32.
        AliasedOutputError, MetaTensorError: an output or IN/OUT tensor sharing memory with
            another argument; a tensor on the meta device.
        Nothing is written when it raises.
    """
    _checks.check_resolve_args(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos,
                               lru, block_size, out_rows, miss_src, miss_dst, miss_count, stats,
                               slot_class)
    _resolve_unchecked(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru,
                       block_size, out_rows, miss_src, miss_dst, miss_count, stats, slot_class)


def _resolve_unchecked(topk, token_rows, residency, host_blocks, hot_blocks, slot_pos, lru,
                       block_size, out_rows, miss_src, miss_dst, miss_count, stats,
                       slot_class=None) -> None:
    num_rows = residency.shape[0]
    k = topk.shape[1]
    runs = _request_runs(token_rows.tolist(), num_rows)
    _checks.check_resolve_tables(token_rows, residency, host_blocks, hot_blocks, block_size)

    plans: list[_RequestPlan] = []
    for row, first_token, num_tokens in runs:
        plans.append(_plan_request(
            row, first_token,
            topk[first_token:first_token + num_tokens].to(torch.int64),
            residency[row].to(torch.int64), host_blocks[row].to(torch.int64),
            hot_blocks[row].to(torch.int64), slot_pos[row].to(torch.int64),
            lru[row].to(torch.int64), block_size,
            None if slot_class is None else slot_class[row].to(torch.int64),
        ))

    # Every check passed: write.
    out_rows.fill_(-1)
    miss_count.zero_()
    totals = [0, 0, 0]
    for plan in plans:
        t0, n = plan.first_token, plan.num_tokens
        out_rows[t0:t0 + n] = plan.token_rows_out.to(torch.int32)
        num_misses = plan.copies_src.numel()
        if num_misses:
            flat_src = miss_src[t0:t0 + n].view(-1)
            flat_dst = miss_dst[t0:t0 + n].view(-1)
            flat_src[:num_misses] = plan.copies_src.to(torch.int32)
            flat_dst[:num_misses] = plan.copies_dst.to(torch.int32)
        per_row = (num_misses - torch.arange(n, device=miss_count.device) * k).clamp(0, k)
        miss_count[t0:t0 + n] = per_row.to(torch.int32)
        if plan.new_lru is not None:
            slot_pos[plan.row] = plan.new_slot_pos.to(torch.int32)
            lru[plan.row] = plan.new_lru.to(torch.int16)
        totals[0] += plan.num_resident
        totals[1] += plan.num_hits
        totals[2] += num_misses
    if stats is not None:
        stats += torch.tensor(totals, dtype=torch.int64, device=stats.device)


# --------------------------------------------------------------------------------------
# finishing a conversion: the ops around resolve in an attention layer's top-k conversion
# --------------------------------------------------------------------------------------


def token_state_rows(batch_rows: torch.Tensor, step_table: torch.Tensor, out: torch.Tensor,
                     limit: int | None = None) -> None:
    """The state row of every token of a step, for ``resolve``'s ``token_rows``.

    Args:
        batch_rows: int32 or int64 ``[T]``: the batch row of each token (vLLM's
            ``req_id_per_token``).
        step_table: int32 ``[1 + B]``: ``[0]`` the step's real token count, ``[1 + b]`` the
            state row of batch row ``b`` (-1: not residency-managed).
        out: int32 ``[T]`` OUT: ``step_table[1 + batch_rows[t]]`` when
            ``0 <= batch_rows[t] < B``, ``t < step_table[0]`` and ``t < limit``; else -1.
        limit: tokens at or past it are padding (None: no limit beyond the table's count).
    """
    _conversion_checks.check_token_state_rows_args(batch_rows, step_table, out, limit)
    num_batch_rows = step_table.shape[0] - 1
    t = torch.arange(batch_rows.shape[0], device=batch_rows.device)
    b = batch_rows.to(torch.int64)
    valid = (b >= 0) & (b < num_batch_rows) & (t < step_table[0].to(torch.int64))
    if limit is not None:
        valid &= t < limit
    rows = step_table[1:][b.clamp(0, max(num_batch_rows - 1, 0))] if num_batch_rows else \
        torch.full_like(out, -1)
    out.copy_(torch.where(valid, rows, torch.full_like(rows, -1)))


def merge_rows(ours: torch.Tensor, token_rows: torch.Tensor, theirs: torch.Tensor,
               from_stride_rows: int, to_stride_rows: int, out: torch.Tensor,
               counts: torch.Tensor | None = None) -> None:
    """The last step of a residency-aware top-k conversion: each token's rows from ``ours``
    (resolve's rows, translated) or ``theirs`` (the engine's own conversion), optionally
    compacted.

    Args:
        ours: int32 ``[T, K]`` flat device rows ``block * from_stride_rows + offset``
            (-1 = none), e.g. ``resolve``'s ``out_rows``.
        token_rows: int32 ``[T]``: tokens with a value ``>= 0`` take ``ours``, the others
            ``theirs``.
        theirs: int32 ``[T, K]`` rows already in the target space, uncompacted.
        from_stride_rows, to_stride_rows: rows between consecutive device blocks in ``ours``
            and in the target space; a row ``r >= 0`` of ``ours`` becomes
            ``(r // from) * to + r % from``.
        out: int32 ``[T, K]`` OUT, overlapping no input. Without ``counts``: the merged rows
            column for column. With ``counts``: each token's valid (``>= 0``) entries moved
            to the front in column order, ``-1`` after.
        counts: int32 ``[T]`` OUT or None: the valid entries of each token.
    """
    _conversion_checks.check_merge_rows_args(ours, token_rows, theirs, from_stride_rows,
                                             to_stride_rows, out, counts)
    _merge_unchecked(ours, token_rows, theirs, from_stride_rows, to_stride_rows, out, counts)


def merge_table_rows(ours: torch.Tensor, token_rows: torch.Tensor, topk: torch.Tensor,
                     batch_rows: torch.Tensor, block_table: torch.Tensor, block_size: int,
                     from_stride_rows: int, to_stride_rows: int, out: torch.Tensor,
                     counts: torch.Tensor | None = None) -> None:
    """:func:`merge_rows` whose ``theirs`` is vLLM's decode conversion of ``topk``, computed
    in the same pass (so that vLLM's own conversion kernel need not run first).

    Args:
        ours, token_rows, from_stride_rows, to_stride_rows, out, counts: as in
            :func:`merge_rows`.
        topk: int32 ``[T, K]`` request-relative positions (``< 0`` = none).
        batch_rows: int32 ``[T]`` the batch row of each token (vLLM's ``req_id_per_token``).
        block_table: int32 ``[B, P]`` vLLM's block table (contiguous).
        block_size: positions per block.

    An untracked token's entry is ``block_table[batch_rows[t], p // block_size] *
    to_stride_rows + p % block_size`` for a position ``p = topk[t, k]``, wrapped to int32 as
    vLLM's Triton arithmetic wraps; -1 when ``p < 0``, ``p // block_size >= P`` or
    ``batch_rows[t]`` is outside ``[0, B)``. That is vLLM 0.33's
    ``triton_convert_req_index_to_global_index`` without a prefill workspace, decode context
    parallelism or ``idx_mapping`` (``BLOCK_STRIDE_ROWS = to_stride_rows``), which reads any
    memory for a batch row outside the table.
    """
    _conversion_checks.check_merge_table_rows_args(ours, token_rows, topk, batch_rows,
                                                   block_table, block_size, from_stride_rows,
                                                   to_stride_rows, out, counts)
    theirs = table_rows(topk, batch_rows, block_table, block_size, to_stride_rows)
    _merge_unchecked(ours, token_rows, theirs, from_stride_rows, to_stride_rows, out, counts)


def table_rows(topk: torch.Tensor, batch_rows: torch.Tensor, block_table: torch.Tensor,
               block_size: int, stride_rows: int) -> torch.Tensor:
    """int32 ``[T, K]``: the table-mode rows of :func:`merge_table_rows` for every token
    (vLLM's decode conversion, uncompacted)."""
    num_rows, num_pages = block_table.shape
    if num_rows == 0 or num_pages == 0:
        return torch.full(tuple(topk.shape), -1, dtype=torch.int32, device=topk.device)
    pos = topk.to(torch.int64)
    page = torch.div(pos, block_size, rounding_mode="floor")
    b = batch_rows.to(torch.int64)[:, None].expand_as(pos)
    ok = (pos >= 0) & (page < num_pages) & (b >= 0) & (b < num_rows)
    block = block_table.to(torch.int64)[b.clamp(0, num_rows - 1), page.clamp(0, num_pages - 1)]
    rows = block * stride_rows + pos - page * block_size
    # int64 -> int32 keeps the low 32 bits: the wrap-around of vLLM's int32 arithmetic.
    return torch.where(ok, rows, torch.full_like(rows, -1)).to(torch.int32)


def _merge_unchecked(ours, token_rows, theirs, from_stride_rows, to_stride_rows, out,
                     counts) -> None:
    r = ours.to(torch.int64)
    block = torch.div(r, from_stride_rows, rounding_mode="floor")
    translated = torch.where(r >= 0, block * to_stride_rows + r - block * from_stride_rows, r)
    merged = torch.where((token_rows >= 0)[:, None], translated, theirs.to(torch.int64))
    if counts is None:
        out.copy_(merged.to(torch.int32))
        return
    # A stable partition by prefix sums: a valid entry goes to (valid entries before it), an
    # invalid one to (row total) + (invalid entries before it).
    valid = merged >= 0
    ahead = torch.cumsum(valid, dim=1)
    total = ahead[:, -1:] if merged.shape[1] else \
        torch.zeros((merged.shape[0], 1), dtype=torch.int64, device=merged.device)
    column = torch.arange(merged.shape[1], device=merged.device)
    slot = torch.where(valid, ahead - 1, total + column - ahead)
    values = torch.where(valid, merged, torch.full_like(merged, -1))
    out.copy_(torch.empty_like(merged).scatter_(1, slot, values).to(torch.int32))
    counts.copy_(total[:, 0].to(torch.int32))


# --------------------------------------------------------------------------------------
# copies
# --------------------------------------------------------------------------------------


def _copy_rows_all_layers(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                          src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """dst_layers[l][dst_rows] = src_layers[l][src_rows] for every layer (int64 row ids)."""
    if src_rows.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        s = src_rows.to(src.device)
        d = dst_rows.to(dst.device)
        dst.index_copy_(0, d, src.index_select(0, s).to(dst.device))


def gather_rows(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
) -> None:
    """Execute a miss plan of :func:`resolve` for every layer of an index group.

    For every layer ``l``, token row ``t`` and ``j < miss_count[t]``:
    ``dst_layers[l][miss_dst[t, j]] = src_layers[l][miss_src[t, j]]``.

    Args:
        src_layers: L uint8 ``[src_rows, row_bytes]`` tensors (host pool views, pinned).
        dst_layers: L uint8 ``[dst_rows, row_bytes]`` tensors (device KV views); same
            ``row_bytes`` as the matching source layer.
        miss_src, miss_dst: int32 ``[T, K]`` source and destination rows.
        miss_count: int32 ``[T]``, each in ``[0, K]``.

    Destinations within one call must be distinct (``resolve`` guarantees it); a repeated
    destination raises ``DuplicateDestinationError``, a negative counted id
    ``NegativeIdError``.
    """
    _checks.check_gather_args(src_layers, dst_layers, miss_src, miss_dst, miss_count)
    src_rows, dst_rows = _checks.check_gather_values(src_layers, dst_layers, miss_src,
                                                     miss_dst, miss_count)
    _copy_rows_all_layers(src_layers, dst_layers, src_rows, dst_rows)


def copy_blocks(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    block_size: int,
) -> None:
    """Copy whole pages for every layer: spill (device→host) or restore (host→device).

    For every layer ``l`` and entry ``i`` with ``src_blocks[i] >= 0`` and ``dst_blocks[i] >= 0``:
    rows ``[dst_blocks[i] * bs, +bs)`` of ``dst_layers[l]`` = rows ``[src_blocks[i] * bs, +bs)``
    of ``src_layers[l]``. Entries with ``-1`` on either side are padding and skipped, so a
    caller can keep fixed-size (graph-capturable) id buffers.

    Args:
        src_layers, dst_layers: L uint8 ``[blocks * block_size, row_bytes]`` tensors each.
        src_blocks, dst_blocks: int32 ``[N]`` block ids, ``-1`` = skip; other negatives raise
            ``NegativeIdError``, a destination block of two kept entries
            ``DuplicateDestinationError``.
        block_size: rows per block.
    """
    _checks.check_block_copy_args(src_layers, dst_layers, src_blocks, dst_blocks, block_size)
    src_b, dst_b = _checks.check_block_copy_values(src_layers, dst_layers, src_blocks,
                                                   dst_blocks, block_size)
    offsets = torch.arange(block_size, device=src_b.device)
    src_rows = (src_b[:, None] * block_size + offsets).reshape(-1)
    dst_rows = (dst_b[:, None] * block_size + offsets).reshape(-1)
    _copy_rows_all_layers(src_layers, dst_layers, src_rows, dst_rows)


def mirror_rows(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
) -> None:
    """Copy single rows for every layer, typically newly written KV rows device→pinned host.

    For every layer ``l`` and entry ``i`` with both ids ``>= 0``:
    ``dst_layers[l][dst_rows[i]] = src_layers[l][src_rows[i]]``; ``-1`` entries are skipped.

    Args:
        src_layers, dst_layers: L uint8 ``[rows, row_bytes]`` tensors each.
        src_rows, dst_rows: int32 ``[N]`` row ids, ``-1`` = skip; other negatives raise
            ``NegativeIdError``, a destination row of two kept entries
            ``DuplicateDestinationError``.
    """
    _checks.check_row_copy_args(src_layers, dst_layers, src_rows, dst_rows)
    s, d = _checks.check_row_copy_values(src_layers, dst_layers, src_rows, dst_rows)
    _copy_rows_all_layers(src_layers, dst_layers, s, d)

