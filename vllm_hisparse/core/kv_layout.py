"""How a DSA model's sparse-MLA and indexer layers are packed into KV cache groups.

Residency releases sparse-MLA pages while the indexer keeps scoring every position, so the
two kinds of layer need different KV cache groups (docs/vllm-integration.md, "The planning
split"). vLLM's pool gives every group the same block (the largest group's page bytes,
aligned), and a request holds one block per group per page, so one page of tokens costs
``num_groups * bytes_per_block`` on the device. :func:`choose_split` packs *index units*
(an indexer leader and the IndexShare followers that reuse its top-k, never split) and
indexer layers contiguously into the groups that minimise that cost, with at most
``max_groups`` groups: each group is one more block table and one more manager call per
request and step in vLLM's scheduler.

The planner (``vllm.setup.kv_planner``) splits a real model's layer specs with it;
:func:`geometry_split` splits a :class:`~vllm_hisparse.core.capacity.ModelGeometry`
(``vllm-hisparse plan``), so both size the pool the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_SPLIT_GROUPS = 8
"""Most KV cache groups a split may create for the sparse-MLA and indexer layers."""


@dataclass(frozen=True)
class SplitChoice:
    """Which units / indexer layers go together, and what one block then costs."""

    sparse_parts: list[list[int]]
    """Indices into the unit list, one list per sparse-MLA group."""
    indexer_parts: list[list[int]]
    """Indices into the indexer layer list, one list per indexer group."""
    bytes_per_block: int
    """Pool block size the split needs (largest group page sum, aligned)."""

    @property
    def num_groups(self) -> int:
        return len(self.sparse_parts) + len(self.indexer_parts)

    @property
    def bytes_per_token_page(self) -> int:
        """Device bytes one page of tokens costs a request across these groups."""
        return self.num_groups * self.bytes_per_block


def _greedy_parts(sizes: Sequence[int], cap: int) -> list[list[int]] | None:
    """Contiguous packing of ``sizes`` into parts of sum <= cap; None if one is too big."""
    parts: list[list[int]] = []
    total = cap + 1
    for index, size in enumerate(sizes):
        if size > cap:
            return None
        if total + size > cap:
            parts.append([])
            total = 0
        parts[-1].append(index)
        total += size
    return parts


def _min_cap_for_parts(sizes: Sequence[int], num_parts: int) -> int:
    """Smallest cap for which contiguous greedy packing needs <= num_parts parts."""
    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        parts = _greedy_parts(sizes, mid)
        if parts is not None and len(parts) <= num_parts:
            high = mid
        else:
            low = mid + 1
    return low


def choose_split(
    unit_bytes: Sequence[int],
    indexer_bytes: Sequence[int],
    *,
    alignment: int = 1,
    max_groups: int = MAX_SPLIT_GROUPS,
) -> SplitChoice:
    """The contiguous split minimising ``num_groups * bytes_per_block``.

    ``unit_bytes[i]`` is the summed page bytes of index unit i, ``indexer_bytes[j]`` the
    page bytes of indexer layer j. Candidates: for every group count of one kind, the
    tightest cap it allows, and the fewest groups of the other kind under that cap.
    Ties go to fewer groups (less scheduler work per step). ``ValueError`` when no split
    fits ``max_groups``.
    """
    if not unit_bytes or not indexer_bytes:
        raise ValueError("choose_split needs at least one unit and one indexer layer")
    if max_groups < 2:
        raise ValueError("max_groups must be >= 2 (one sparse and one indexer group)")
    best: SplitChoice | None = None
    caps = {
        _min_cap_for_parts(unit_bytes, n) for n in range(1, len(unit_bytes) + 1)
    } | {_min_cap_for_parts(indexer_bytes, m) for m in range(1, len(indexer_bytes) + 1)}
    for cap in sorted(caps):
        sparse_parts = _greedy_parts(unit_bytes, cap)
        indexer_parts = _greedy_parts(indexer_bytes, cap)
        if sparse_parts is None or indexer_parts is None:
            continue
        if len(sparse_parts) + len(indexer_parts) > max_groups:
            continue
        largest = max(
            max(sum(unit_bytes[i] for i in part) for part in sparse_parts),
            max(sum(indexer_bytes[i] for i in part) for part in indexer_parts),
        )
        choice = SplitChoice(sparse_parts, indexer_parts, -(-largest // alignment) * alignment)
        if best is None or (choice.bytes_per_token_page, choice.num_groups) < (
            best.bytes_per_token_page,
            best.num_groups,
        ):
            best = choice
    if best is None:
        raise ValueError(
            f"cannot split {len(unit_bytes)} index units and {len(indexer_bytes)} indexer "
            f"layers into at most {max_groups} KV cache groups; accepted: models whose layers "
            "fit that many groups."
        )
    return best


def index_unit_layers(num_sparse_layers: int, num_index_units: int) -> list[int]:
    """Layers per index unit when ``num_sparse_layers`` layers share ``num_index_units``
    indexers as evenly as possible, larger units first (a real model's grouping may
    differ by a layer here and there)."""
    if not 1 <= num_index_units <= num_sparse_layers:
        raise ValueError(f"{num_index_units} index units for {num_sparse_layers} sparse layers")
    small, larger = divmod(num_sparse_layers, num_index_units)
    return [small + 1] * larger + [small] * (num_index_units - larger)


def geometry_split(num_sparse_layers: int, num_indexer_layers: int, block_size: int, row_bytes: int,
                   indexer_row_bytes: int, *, alignment: int = 1,
                   max_groups: int = MAX_SPLIT_GROUPS) -> SplitChoice:
    """The planner's split for a model described by its numbers: ``num_indexer_layers``
    index units over ``num_sparse_layers`` layers, one indexer layer per unit."""
    units = index_unit_layers(num_sparse_layers, num_indexer_layers)
    return choose_split([n * block_size * row_bytes for n in units],
                        [block_size * indexer_row_bytes] * num_indexer_layers,
                        alignment=alignment, max_groups=max_groups)
