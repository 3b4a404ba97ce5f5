"""Models of hot-region replacement policies, scored on selection traces.

A hot region of ``capacity`` slots serves one request. At each step the request needs a set S
of host-backed positions, all present at once; positions not in the region miss and must
replace positions that are not in S. Policies differ only in which positions they replace:

| name | victims (among slots not needed this step) | recency update |
|---|---|---|
| ``hisparse`` | least recent first | new order = [survivors] + [this step's misses] + [this step's hits] (DESIGN §4.1, what the kernel does) |
| ``lru`` | least recent first | every position used this step becomes most recent, misses and hits alike, in position order |
| ``fifo`` | oldest inserted first | none: hits keep their place |
| ``random`` | uniformly random | — |
| ``current`` | everything not needed this step (only the current selections stay: "swap-vanilla") | — |
| ``belady`` | the one used again furthest in the future (or never) | — (needs the future: an offline optimum) |

Empty slots are used before anything is replaced, as ``-1`` entries at the least recent end,
exactly like an empty hot region in ``resolve``. Within a step, misses are taken in ascending
position order (a trace keeps the set, not the order of first reference).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

POLICIES = ("hisparse", "lru", "fifo", "random", "current", "belady")
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
                   seed: int = 0) -> tuple[int, int]:
    """(misses, references) of one request's selection sets under ``policy``.

    Raises ValueError if a set holds more positions than ``capacity`` (the region could not
    serve that step at all) or ``policy`` is unknown.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(POLICIES)}")
    rng = np.random.default_rng(seed)
    sets = [np.unique(np.asarray(x, dtype=np.int64)) for x in sets]
    order = np.full(capacity, _EMPTY, dtype=np.int64)  # least recent (or oldest) first
    next_use = np.full(capacity, _NEVER, dtype=np.int64)  # belady only, parallel to order
    future = _next_uses(sets) if policy == "belady" else None
    misses = references = 0
    for s, needed in enumerate(sets):
        if needed.shape[0] > capacity:
            raise ValueError(f"step {s} selects {needed.shape[0]} host-backed positions, more "
                             f"than the capacity {capacity}")
        references += needed.shape[0]
        hit = np.isin(order, needed)
        missing = needed[~np.isin(needed, order)]
        n = missing.shape[0]
        misses += n
        if policy == "hisparse":
            evictable = order[~hit]
            order = np.concatenate([evictable[n:], missing, order[hit]])
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
    return misses, references


def replay(trace, policies: Sequence[str], capacities: Sequence[int],
           seed: int = 0) -> list[ReplayResult]:
    """Score every (policy, capacity) on every request of ``trace`` (a SelectionTrace).

    Capacities smaller than the largest selection set of the trace are skipped (no policy could
    serve it); the caller sees that as a missing row.
    """
    per_request = list(trace.requests())
    largest = max((s.shape[0] for _, sets in per_request for s in sets), default=0)
    results = []
    for capacity in capacities:
        if capacity < largest:
            continue
        for policy in policies:
            misses = refs = 0
            for rid, sets in per_request:
                m, r = replay_request(policy, sets, capacity, seed=seed + rid)
                misses += m
                refs += r
            results.append(ReplayResult(policy, capacity, refs, misses))
    return results
