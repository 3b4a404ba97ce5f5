"""Models of hot-region replacement policies, scored on selection traces.

A hot region of ``capacity`` slots serves one request. At each step the request needs a set S
of host-backed positions, all present at once; positions not in the region miss and must
replace positions that are not in S. Policies differ only in which positions they replace:

| name | victims (among slots not needed this step) | recency update |
|---|---|---|
| ``hisparse`` | least recent first | new order = [survivors] + [this step's misses] + [this step's hits] (docs/design.md, "resolve": what the kernel does) |
| ``lru`` | least recent first | every position used this step becomes most recent, misses and hits alike, in position order |
| ``fifo`` | oldest inserted first | none: hits keep their place |
| ``random`` | uniformly random | — |
| ``current`` | everything not needed this step (only the current selections stay: "swap-vanilla") | — |
| ``belady`` | the one used again furthest in the future (or never) | — (needs the future: an offline optimum) |
| ``score`` | lowest score class first (the indexer's score this step: ``SelectionTrace`` score classes), least recent first within a class | as ``hisparse`` (what ``resolve`` does with ``slot_class``) |
| ``frequency`` | lowest ``2 * log2(1 + selections in the last 32 steps) - steps since last selected`` first, least recent first on ties | as ``hisparse`` |

Empty slots are used before anything is replaced, as ``-1`` entries at the least recent end,
exactly like an empty hot region in ``resolve`` (class 0 for ``score``). Within a step, misses
are taken in ascending position order (a trace keeps the set, not the order of first
reference). ``score`` needs a trace with score classes; ``frequency`` is the best blend of
recency and selection history found on the default trace (the history a slot could keep).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

POLICIES = ("hisparse", "lru", "fifo", "random", "current", "belady", "score", "frequency")
#: Policies that need the trace's score classes.
SCORED_POLICIES = ("score",)
_EMPTY = -1
_NEVER = np.iinfo(np.int64).max


@dataclasses.dataclass
class ReplayResult:
    policy: str
    capacity: int
    references: int
    misses: int

    @property
    def miss_rate(self) -> float:
        return self.misses / self.references if self.references else 0.0


def _next_uses(sets: Sequence[np.ndarray]) -> list[np.ndarray]:
    """For every step s and position in sets[s], the next step that uses it again (or never)."""
    last_seen: dict[int, int] = {}
    out: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(sets)
    for s in range(len(sets) - 1, -1, -1):
        positions = sets[s]
        nxt = np.fromiter((last_seen.get(int(p), _NEVER) for p in positions), dtype=np.int64,
                          count=positions.shape[0])
        out[s] = nxt
        for p in positions:
            last_seen[int(p)] = s
    return out


def replay_request(policy: str, sets: Sequence[np.ndarray], capacity: int,
                   seed: int = 0, scores: Sequence[tuple[np.ndarray, np.ndarray]] | None = None
                   ) -> tuple[int, int]:
    """(misses, references) of one request's selection sets under ``policy``.

    ``scores``: per step, (positions, classes) of the score classes (``SelectionTrace``), needed
    by the ``score`` policy.

    Raises ValueError if a set holds more positions than ``capacity`` (the region could not
    serve that step at all), ``policy`` is unknown, or ``score`` has no scores.
    """
    misses = references = 0
    for needed, _, missing in replay_steps(policy, sets, capacity, seed, scores):
        references += needed.shape[0]
        misses += missing.shape[0]
    return misses, references


def replay_steps(policy: str, sets: Sequence[np.ndarray], capacity: int, seed: int = 0,
                 scores: Sequence[tuple[np.ndarray, np.ndarray]] | None = None
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The hot region of one request, a step at a time: per step of ``sets``,
    ``(needed, held, missing)``: the step's distinct positions (int64, ascending), the
    positions the region held before the step (int64, in the policy's order, empty slots left
    out; a fresh array) and the step's misses (int64, ascending: ``needed`` less ``held``).

    The same model and errors as :func:`replay_request` (which sums it)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    if policy in SCORED_POLICIES and scores is None:
        raise ValueError(f"policy {policy!r} needs a trace with score classes")
    rng = np.random.default_rng(seed)
    sets = [np.unique(np.asarray(x, dtype=np.int64)) for x in sets]
    order = np.full(capacity, _EMPTY, dtype=np.int64)  # least recent (or oldest) first
    next_use = np.full(capacity, _NEVER, dtype=np.int64)  # belady only, parallel to order
    future = _next_uses(sets) if policy == "belady" else None
    if policy == "frequency":  # per position: last step selected, 32-step history (bits)
        top = max((int(x[-1]) for x in sets if x.size), default=0) + 1
        last = np.zeros(top, dtype=np.int64)
        history = np.zeros(top, dtype=np.uint32)
    for s, needed in enumerate(sets):
        if needed.shape[0] > capacity:
            raise ValueError(f"step {s} selects {needed.shape[0]} host-backed positions, more "
                             f"than the capacity {capacity}")
        hit = np.isin(order, needed)
        missing = needed[~np.isin(needed, order)]
        n = missing.shape[0]
        yield needed, order[order != _EMPTY], missing
        if policy == "hisparse":
            evictable = order[~hit]
            order = np.concatenate([evictable[n:], missing, order[hit]])
        elif policy in ("score", "frequency"):
            evictable = order[~hit]
            filled = evictable != _EMPTY
            keys = np.full(evictable.shape[0], -np.inf)  # empty slots first
            if policy == "score":
                scored_pos, scored_cls = scores[s]
                keys[filled] = 0
                if scored_pos.shape[0]:
                    at = np.minimum(np.searchsorted(scored_pos, evictable[filled]),
                                    scored_pos.shape[0] - 1)
                    found = scored_pos[at] == evictable[filled]
                    keys[filled] = np.where(found, scored_cls[at], 0)
            else:
                p = evictable[filled]
                count = _popcount32(history[p])
                keys[filled] = 2.0 * np.log2(1.0 + count) - (s - last[p])
            taken = np.zeros(evictable.shape[0], dtype=bool)
            taken[np.argsort(keys, kind="stable")[:n]] = True  # lowest key, then LRU order
            order = np.concatenate([evictable[~taken], missing, order[hit]])
            if policy == "frequency":
                held = order[order != _EMPTY]
                history[held] <<= np.uint32(1)
                history[needed] |= np.uint32(1)
                history[missing] = np.uint32(1)  # a slot's history starts at its insertion
                last[needed] = s
        elif policy == "lru":
            evictable = order[~hit]
            used = np.sort(np.concatenate([order[hit], missing]))
            order = np.concatenate([evictable[n:], used])
        elif policy == "fifo":
            victims = np.flatnonzero(~hit)[:n]
            keep = np.ones(capacity, dtype=bool)
            keep[victims] = False
            order = np.concatenate([order[keep], missing])
        elif policy == "current":
            order = np.concatenate([np.full(capacity - needed.shape[0], _EMPTY, dtype=np.int64),
                                    needed])
        elif policy == "random":
            candidates = np.flatnonzero(~hit)
            empty = candidates[order[candidates] == _EMPTY]
            full = candidates[order[candidates] != _EMPTY]
            victims = np.concatenate([empty, rng.permutation(full)])[:n]
            order[victims] = missing
        else:  # belady
            nxt = dict(zip(needed.tolist(), future[s].tolist()))
            candidates = np.flatnonzero(~hit)
            empty = candidates[order[candidates] == _EMPTY]
            full = candidates[order[candidates] != _EMPTY]
            by_distance = full[np.argsort(-next_use[full], kind="stable")]
            victims = np.concatenate([empty, by_distance])[:n]
            order[victims] = missing
            used = np.flatnonzero(np.isin(order, needed))
            next_use[used] = [nxt[int(p)] for p in order[used]]


def _popcount32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    x = x - ((x >> np.uint32(1)) & np.uint32(0x55555555))
    x = (x & np.uint32(0x33333333)) + ((x >> np.uint32(2)) & np.uint32(0x33333333))
    x = (x + (x >> np.uint32(4))) & np.uint32(0x0F0F0F0F)
    return ((x * np.uint32(0x01010101)) >> np.uint32(24)).astype(np.int64)


def gap_closed(online: float, lru: float, belady: float) -> float:
    """Share of the LRU → Bélády miss-rate gap an online policy closes (0 when there is none)."""
    return (lru - online) / (lru - belady) if lru > belady else 0.0


def replay(trace, policies: Sequence[str], capacities: Sequence[int],
           seed: int = 0, group: int | None = None) -> list[ReplayResult]:
    """Score every (policy, capacity) on every request of ``trace`` (a SelectionTrace), in its
    index group ``group`` (None: the first; each group has its own hot region).

    Capacities smaller than the largest selection set of the trace are skipped (no policy could
    serve it); the caller sees that as a missing row. Policies that need score classes are
    skipped on a trace without them.
    """
    per_request = list(trace.scored_requests(group))
    largest = max((s.shape[0] for _, sets, _ in per_request for s in sets), default=0)
    if not trace.has_scores:
        policies = [p for p in policies if p not in SCORED_POLICIES]
    results = []
    for capacity in capacities:
        if capacity < largest:
            continue
        for policy in policies:
            misses = refs = 0
            for rid, sets, scores in per_request:
                m, r = replay_request(policy, sets, capacity, seed=seed + rid, scores=scores)
                misses += m
                refs += r
            results.append(ReplayResult(policy, capacity, refs, misses))
    return results
