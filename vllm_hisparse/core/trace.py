"""Selection traces: which host-backed positions each request selected at each decode step.

A trace is what replacement policies are scored on (``vllm-hisparse replay``). The connector
records one when ``record_trace`` is configured; :func:`synthetic_trace` makes the embedded
default.

File format (``.npz``, written by :meth:`SelectionTrace.save`, numpy only):

| array | dtype, shape | meaning |
|---|---|---|
| ``request`` | int32 ``[N]`` | request id of record i |
| ``step`` | int32 ``[N]`` | decode step of record i (non-decreasing per request) |
| ``offsets`` | int64 ``[N + 1]`` | record i's positions are ``positions[offsets[i]:offsets[i+1]]`` |
| ``positions`` | int32 ``[M]`` | distinct host-backed positions selected (union over the step's tokens and the index group's layers) |
| ``meta`` | 0-d unicode | JSON: ``{"format": "vllm-hisparse-trace", "version": 1 or 2, "top_k": ..., "block_size": ..., "source": ...}`` |
| ``group`` | int32 ``[N]`` | optional (version 2): index group of record i, ``0`` = the model's first index group, in layer order; without it every record is group 0 |
| ``score_offsets`` | int64 ``[N + 1]`` | optional: record i's scored positions are ``score_positions[score_offsets[i]:score_offsets[i+1]]`` |
| ``score_positions`` | int32 ``[S]`` | optional: positions *not* selected at that step whose indexer score was close below the selection threshold |
| ``score_classes`` | uint8 ``[S]`` | optional: their eviction class, 1 .. ``NUM_SCORE_CLASSES - 1`` (higher = closer to the threshold); every other unselected position is class 0 |

Only host-backed positions are recorded: resident pages never touch the hot region, so they do
not matter to its replacement policy. The score arrays are what the ``score`` replacement
policy reads (``core/replacement.py``); a trace without them scores every other policy.

A trace with several index groups (the connector records each group's leader; each group has
its own hot region) holds one record per (request, step, group). Replacement policies are
scored on one group at a time (``requests(group)``, the first by default); the cross-group
miss predictors (``core/miss_prediction.py``) read them all. A trace without ``group`` is
written as version 1, which every earlier build reads; one with it as version 2, which an
earlier build refuses instead of mixing the groups' records into one sequence.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterator

import numpy as np

FORMAT = "vllm-hisparse-trace"
#: The version written by a trace with index groups (``group``); one without is written as 1.
VERSION = 2
#: The versions :meth:`SelectionTrace.load` reads.
READ_VERSIONS = (1, 2)
#: Eviction classes of the score-aware policy (the resolve op's ``slot_class`` range).
NUM_SCORE_CLASSES = 4
#: Width of one score class, in units of how far the step's mean selected score lies above its
#: selection threshold (``score_classes``; the runtime's ``ops.score_threshold``).
SCORE_CLASS_WIDTH = 1.0
#: Lanes of the fixed-order float64 sum of the selected scores (:func:`lane_tree_sum`; the
#: CUDA op sums with one thread per lane, so the order is part of the op's contract).
SCORE_SUM_LANES = 256
_SCORE_ARRAYS = ("score_offsets", "score_positions", "score_classes")


@dataclasses.dataclass
class SelectionTrace:
    """Per-request sequences of selection sets (see the module docstring for the file format)."""

    request: np.ndarray
    step: np.ndarray
    offsets: np.ndarray
    positions: np.ndarray
    meta: dict
    score_offsets: np.ndarray | None = None
    score_positions: np.ndarray | None = None
    score_classes: np.ndarray | None = None
    #: int32 ``[N]``: index group of each record, or None (every record is group 0).
    group: np.ndarray | None = None

    def __post_init__(self):
        n = self.request.shape[0]
        if self.step.shape != (n,) or self.offsets.shape != (n + 1,):
            raise ValueError(f"trace: request has {n} records but step has "
                             f"{self.step.shape[0]} and offsets {self.offsets.shape[0]} (want n+1)")
        if n and (self.offsets[0] != 0 or self.offsets[-1] != self.positions.shape[0]
                  or np.any(np.diff(self.offsets) < 0)):
            raise ValueError("trace: offsets must start at 0, never decrease and end at "
                             "len(positions)")
        present = [a is not None for a in (self.score_offsets, self.score_positions,
                                            self.score_classes)]
        if any(present) and not all(present):
            raise ValueError("trace: score_offsets, score_positions and score_classes come "
                             "together")
        if all(present):
            if (self.score_offsets.shape != (n + 1,) or self.score_offsets[0] != 0
                    or self.score_offsets[-1] != self.score_positions.shape[0]
                    or np.any(np.diff(self.score_offsets) < 0)
                    or self.score_classes.shape != self.score_positions.shape):
                raise ValueError("trace: score_offsets must have n+1 entries, start at 0, never "
                                 "decrease and end at len(score_positions) == len(score_classes)")
            if self.score_classes.size and (int(self.score_classes.min()) < 1 or int(
                    self.score_classes.max()) >= NUM_SCORE_CLASSES):
                raise ValueError(f"trace: score_classes must be in [1, {NUM_SCORE_CLASSES})")
        if self.group is not None:
            if self.group.shape != (n,):
                raise ValueError(f"trace: group has {self.group.shape[0] if self.group.ndim else 0}"
                                 f" entries for {n} records (want one per record)")
            if n and int(self.group.min()) < 0:
                raise ValueError("trace: group ids must be >= 0")

    @property
    def index_groups(self) -> tuple[int, ...]:
        """The distinct index groups of the records, ascending (``(0,)`` without ``group``)."""
        if self.group is None:
            return (0,)
        return tuple(int(g) for g in np.unique(self.group)) or (0,)

    @property
    def has_scores(self) -> bool:
        """True when the trace carries score classes (the ``score`` policy can be replayed)."""
        return self.score_offsets is not None

    @property
    def num_records(self) -> int:
        return int(self.request.shape[0])

    def requests(self, group: int | None = None) -> Iterator[tuple[int, list[np.ndarray]]]:
        """(request id, its selection sets in step order) for every request, in index group
        ``group`` (None: the first, ``index_groups[0]``)."""
        for rid, records in self._records_by_request(group):
            yield rid, [self.positions[self.offsets[i]:self.offsets[i + 1]] for i in records]

    def stepped_requests(self, group: int | None = None
                         ) -> Iterator[tuple[int, list[int], list[np.ndarray]]]:
        """(request id, steps, selection sets) per request of index group ``group`` (None: the
        first): ``steps[i]`` is the step of ``sets[i]`` (int32 sorted positions), ascending."""
        for rid, records in self._records_by_request(group):
            yield (rid, [int(self.step[i]) for i in records],
                   [self.positions[self.offsets[i]:self.offsets[i + 1]] for i in records])

    def scored_requests(self, group: int | None = None
                        ) -> Iterator[tuple[int, list[np.ndarray], list | None]]:
        """(request id, selection sets, score classes) per request of index group ``group``
        (None: the first): the classes are one ``(positions, classes)`` pair per step, or None
        when the trace has no scores."""
        for rid, records in self._records_by_request(group):
            sets = [self.positions[self.offsets[i]:self.offsets[i + 1]] for i in records]
            scores = None
            if self.has_scores:
                so = self.score_offsets
                scores = [(self.score_positions[so[i]:so[i + 1]],
                           self.score_classes[so[i]:so[i + 1]]) for i in records]
            yield rid, sets, scores

    def _records_by_request(self, group: int | None = None) -> Iterator[tuple[int, list[int]]]:
        order = np.lexsort((self.step, self.request))
        if self.group is not None:
            wanted = self.index_groups[0] if group is None else group
            order = order[self.group[order] == wanted]
        elif group not in (None, 0):
            order = order[:0]
        current, records = None, []
        for i in order:
            r = int(self.request[i])
            if r != current and current is not None:
                yield current, records
                records = []
            current = r
            records.append(int(i))
        if current is not None:
            yield current, records

    def save(self, path: str) -> None:
        scores = {}
        if self.has_scores:
            scores = dict(score_offsets=self.score_offsets.astype(np.int64),
                          score_positions=self.score_positions.astype(np.int32),
                          score_classes=self.score_classes.astype(np.uint8))
        if self.group is not None:
            scores["group"] = self.group.astype(np.int32)
        version = VERSION if self.group is not None else 1
        np.savez_compressed(path, request=self.request.astype(np.int32),
                            step=self.step.astype(np.int32),
                            offsets=self.offsets.astype(np.int64),
                            positions=self.positions.astype(np.int32),
                            meta=np.array(json.dumps({**self.meta, "format": FORMAT,
                                                      "version": version})), **scores)

    @classmethod
    def load(cls, path: str) -> "SelectionTrace":
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in ("request", "step", "offsets", "positions", "meta")}
                arrays.update({k: data[k] for k in _SCORE_ARRAYS + ("group",)
                               if k in data.files})
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{path}: not a vllm-hisparse selection trace ({exc})") from exc
        meta = json.loads(str(arrays.pop("meta")))
        if meta.get("format") != FORMAT or meta.get("version") not in READ_VERSIONS:
            raise ValueError(f"{path}: trace format {meta.get('format')!r} version "
                             f"{meta.get('version')!r}; this build reads {FORMAT!r} "
                             + " and ".join(f"v{v}" for v in READ_VERSIONS))
        if meta["version"] == 1 and "group" in arrays:
            raise ValueError(f"{path}: a version 1 trace with index groups ('group')")
        return cls(meta=meta, **arrays)


class TraceRecorder:
    """Accumulates records in memory and writes them with :meth:`SelectionTrace.save`."""

    def __init__(self, **meta):
        self.meta = meta
        self._request: list[int] = []
        self._step: list[int] = []
        self._sets: list[np.ndarray] = []
        self._scored: list[tuple[np.ndarray, np.ndarray]] = []
        self._group: list[int] = []

    def add(self, request: int, step: int, positions, scored=None, group: int = 0) -> None:
        """One record; ``scored`` = (positions, classes) of the step's score classes, given
        for every record or for none; ``group`` = the index group (0 = the model's first, in
        layer order) whose selections these are."""
        if group < 0:
            raise ValueError(f"TraceRecorder: group {group} < 0")
        self._request.append(request)
        self._step.append(step)
        self._group.append(int(group))
        self._sets.append(np.unique(np.asarray(positions, dtype=np.int32)))
        if scored is not None:
            where = np.asarray(scored[0], dtype=np.int32)
            order = np.argsort(where, kind="stable")  # the score policy searches them
            self._scored.append((where[order], np.asarray(scored[1], dtype=np.uint8)[order]))

    def trace(self) -> SelectionTrace:
        offsets, positions = _pack(self._sets, np.int32)
        scores = {}
        if self._scored:
            if len(self._scored) != len(self._sets):
                raise ValueError("TraceRecorder: score classes given for some records only")
            scores["score_offsets"], scores["score_positions"] = _pack(
                [p for p, _ in self._scored], np.int32)
            scores["score_classes"] = _pack([c for _, c in self._scored], np.uint8)[1]
        if any(self._group):
            scores["group"] = np.array(self._group, dtype=np.int32)
        return SelectionTrace(np.array(self._request, dtype=np.int32),
                              np.array(self._step, dtype=np.int32), offsets, positions, self.meta,
                              **scores)


def _pack(arrays: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [n + 1], concatenation) of a list of 1-D arrays."""
    lengths = np.array([a.shape[0] for a in arrays], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return offsets, flat.astype(dtype)


#: The figures the default synthetic trace is calibrated to: the HiSparse paper's replay of a
#: GLM-5.1 LongBenchV2 trace (k = 2048, a 100K-token prompt, the first 1000 decode steps), as
#: (policy, hot rows) -> miss rate. ``current`` keeps only the previous step's selections.
PAPER_MISS_RATES = {
    ("current", 2048): 0.300,
    ("fifo", 4096): 0.172,
    ("random", 4096): 0.161,
    ("hisparse", 4096): 0.134,
    ("belady", 4096): 0.082,
    ("hisparse", 8192): 0.067,
}


@dataclasses.dataclass(frozen=True)
class ScoreProfile:
    """The terms of :class:`ScoreProcess` (defaults: the calibrated trace's)."""

    anchor_weight: float = 1.4
    anchor_persistence: float = 0.99
    noise_weight: float = 0.6
    noise_persistence: float = 0.6
    burst_rate: float = 0.08
    burst_tokens: int = 128
    burst_gain: float = 1.0
    burst_decay: float = 0.87

    def __post_init__(self):
        if not 0 <= self.anchor_persistence < 1 or not 0 <= self.noise_persistence < 1:
            raise ValueError("ScoreProfile: persistences must be in [0, 1)")


class ScoreProcess:
    """One request's indexer score per position, a step at a time.

    Position p scores ``base[p] + anchor_weight * anchor[p] + noise_weight * noise[p] +
    burst[p]``. ``base`` (standard normal, fixed) is how relevant a position is to the request;
    ``anchor`` is a slowly drifting AR(1) term (``anchor_persistence`` per step), so the set of
    recurring "anchor" positions moves over hundreds of steps; ``noise`` is a fast AR(1) term
    (``noise_persistence``), the flicker of positions near the selection threshold; and with
    probability ``burst_rate`` per step a span of ``burst_tokens`` positions gains
    ``burst_gain``, decaying by ``burst_decay`` a step (a burst of new positions).

    Args:
        num_positions: positions the request will ever have.
        rng: numpy generator every draw comes from (in a fixed order).
    """

    def __init__(self, num_positions: int, rng: np.random.Generator,
                 profile: ScoreProfile = ScoreProfile()):
        self.rng, self.profile = rng, profile
        self.base = rng.standard_normal(num_positions, dtype=np.float32)
        self.anchor = rng.standard_normal(num_positions, dtype=np.float32)
        self.noise = rng.standard_normal(num_positions, dtype=np.float32)
        self.burst = np.zeros(num_positions, dtype=np.float32)
        self._anchor_step = np.float32(np.sqrt(1.0 - profile.anchor_persistence ** 2))
        self._noise_step = np.float32(np.sqrt(1.0 - profile.noise_persistence ** 2))

    def step(self, context_len: int, out: np.ndarray) -> np.ndarray:
        """Advance every term one step over positions ``[0, context_len)``; write their scores
        into ``out[:context_len]`` (float32) and return that view."""
        p, ctx, rng = self.profile, context_len, self.rng
        if ctx > self.base.shape[0]:
            raise ValueError(f"ScoreProcess: context {ctx} past the request's "
                             f"{self.base.shape[0]} positions")
        anchor, noise, burst = self.anchor[:ctx], self.noise[:ctx], self.burst[:ctx]
        anchor *= np.float32(p.anchor_persistence)
        anchor += self._anchor_step * rng.standard_normal(ctx, dtype=np.float32)
        noise *= np.float32(p.noise_persistence)
        noise += self._noise_step * rng.standard_normal(ctx, dtype=np.float32)
        burst *= np.float32(p.burst_decay)
        if rng.random() < p.burst_rate and ctx > p.burst_tokens:
            first = int(rng.integers(0, ctx - p.burst_tokens))
            burst[first:first + p.burst_tokens] += np.float32(p.burst_gain)
        score = out[:ctx]
        np.multiply(anchor, np.float32(p.anchor_weight), out=score)
        score += self.base[:ctx]
        score += np.float32(p.noise_weight) * noise
        score += burst
        return score


def synthetic_trace(num_requests: int = 2, num_steps: int = 300, top_k: int = 2048,
                    context_tokens: int = 100_000, seed: int = 0, *, recent_tokens: int = 128,
                    profile: ScoreProfile = ScoreProfile(), resident_tail_tokens: int = 128,
                    score_class_width: float | None = SCORE_CLASS_WIDTH,
                    index_groups: int = 1) -> SelectionTrace:
    """The embedded default trace: an indexer's top-k over a score per position.

    Each step every request's :class:`ScoreProcess` (``profile``) advances, and the ``top_k``
    best positions are selected, the newest ``recent_tokens`` always (the recency window). The
    context grows by one token a step. The newest ``resident_tail_tokens`` are resident (the
    tail pages) and left out, as a recorded trace would.

    ``index_groups`` > 1 gives each request one :class:`ScoreProcess` per index group, each
    drawn on its own: the groups' selections are **independent by construction** (they share
    only the statistics), so what one group's selections say about another's misses is chance.
    With 1 (the default) the draws, and so the trace, are those of the calibrated default.

    Score classes (for the ``score`` replacement policy; None leaves them out): see
    :func:`score_classes`, with ``score_class_width`` as its width.
    They draw nothing from the generator, so the selections are the same with or without them.

    With the defaults it reproduces :data:`PAPER_MISS_RATES` within half a point
    (``vllm-hisparse replay`` prints both; docs/core.md has the table).
    """
    if index_groups < 1:
        raise ValueError(f"synthetic_trace: index_groups {index_groups} < 1")
    rng = np.random.default_rng(seed)
    meta = dict(top_k=top_k, block_size=64, source="synthetic", seed=seed,
                context_tokens=context_tokens)
    if index_groups > 1:
        meta["index_groups"] = index_groups
        meta["index_groups_independent"] = True
    rec = TraceRecorder(**meta)
    for r in range(num_requests):
        n = context_tokens + num_steps
        processes = [ScoreProcess(n, rng, profile) for _ in range(index_groups)]
        buffer = np.empty(n, dtype=np.float32)
        for s in range(num_steps):
            ctx = context_tokens + s
            for g, process in enumerate(processes):
                score = process.step(ctx, buffer)
                score[max(0, ctx - recent_tokens):] = np.inf
                k = min(top_k, ctx)
                chosen = np.argpartition(-score, k - 1)[:k] if k < ctx else np.arange(ctx)
                host_backed = np.sort(chosen[chosen < ctx - resident_tail_tokens])
                scored = None
                if score_class_width is not None:
                    scored = score_classes(score[:max(0, ctx - resident_tail_tokens)], chosen,
                                           score_class_width)
                rec.add(r, s, host_backed, scored, group=g)
    return rec.trace()


#: ``synthetic_trace`` overrides of the requests of the mixed trace: very stable, stable,
#: default, drifting.
MIXED_PROFILES = (
    ScoreProfile(noise_weight=0.15, burst_rate=0.0, anchor_persistence=0.998),
    ScoreProfile(noise_weight=0.3, burst_rate=0.02),
    ScoreProfile(),
    ScoreProfile(noise_weight=0.9, burst_rate=0.15),
)


def mixed_trace(num_steps: int = 300, top_k: int = 2048, context_tokens: int = 100_000,
                seed: int = 0) -> SelectionTrace:
    """Requests whose selections drift differently (``MIXED_PROFILES``: request i follows
    profile i), for the per-request hot-size model (``core.hot_sizing``). No score classes."""
    rec = TraceRecorder(top_k=top_k, block_size=64, source="synthetic-mixed", seed=seed,
                        context_tokens=context_tokens)
    for r, profile in enumerate(MIXED_PROFILES):
        one = synthetic_trace(1, num_steps, top_k, context_tokens, seed + 10 + r,
                              score_class_width=None, profile=profile)
        for step, positions in enumerate(next(one.requests())[1]):
            rec.add(r, step, positions)
    return rec.trace()


def lane_tree_sum(values: np.ndarray) -> np.ndarray:
    """float64 sums over the last axis in the fixed order of the score ops' contract.

    Entry ``j`` goes to lane ``j % SCORE_SUM_LANES``; each lane adds its entries to ``+0.0``
    in increasing ``j``; then the lanes are halved pairwise (lane ``l`` += lane ``l + h`` for
    ``h`` = 128, 64, ..., 1). Every step is one IEEE float64 addition, so numpy, torch and the
    CUDA kernel (``ops.score_threshold``) get the same bits for the same ``values``."""
    values = np.asarray(values, dtype=np.float64)
    lanes = SCORE_SUM_LANES
    cols = values.shape[-1]
    padded = -(-cols // lanes) * lanes
    if padded != cols:
        pad = [(0, 0)] * (values.ndim - 1) + [(0, padded - cols)]
        values = np.pad(values, pad)
    rounds = values.reshape(values.shape[:-1] + (padded // lanes, lanes))
    acc = np.zeros(values.shape[:-1] + (lanes,), dtype=np.float64)
    for r in range(rounds.shape[-2]):
        acc = acc + rounds[..., r, :]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    return acc[..., 0]


def score_classes(score: np.ndarray, chosen: np.ndarray, width_units: float = SCORE_CLASS_WIDTH
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(positions, classes 1..NUM_SCORE_CLASSES-1) of the unselected positions close below the
    selection threshold; every other unselected position is class 0.

    ``chosen`` is one top-k row: entry ``j`` is a selected position, or padding when outside
    ``[0, len(score))`` (``-1``). ``thr`` is the lowest finite selected score, ``w`` is
    ``width_units`` times the distance of the mean finite selected score above ``thr`` (the
    scores summed in float64 in :func:`lane_tree_sum`'s order over the entries of ``chosen``,
    padding and non-finite scores as 0), at least the smallest normal float32, and a position
    scoring ``s`` has class ``[s >= thr - w] + [s >= thr - 2 w] + [s >= thr - 3 w]`` (float32
    edges). A row with no finite selection has no class above 0. The numpy twin of the
    runtime's ``ops.score_threshold`` + ``ops.slot_classes``."""
    chosen = np.asarray(chosen)
    inside = (chosen >= 0) & (chosen < score.shape[0])
    values = np.zeros(chosen.shape[0], dtype=np.float32)
    values[inside] = score[chosen[inside]].astype(np.float32)
    valid = inside & np.isfinite(values)
    if not valid.any():
        return np.zeros(0, np.int32), np.zeros(0, np.uint8)
    threshold = np.float32(values[valid].min())
    total = lane_tree_sum(np.where(valid, values, np.float32(0)))
    mean = total / np.float64(valid.sum())
    width = np.float32((mean - np.float64(threshold)) * width_units)
    tiny = np.finfo(np.float32).tiny
    width = width if np.isfinite(width) and width > tiny else tiny
    width = np.float32(width)
    classes = np.zeros(score.shape[0], dtype=np.uint8)
    values = score.astype(np.float32)
    for c in range(1, NUM_SCORE_CLASSES):
        classes += values >= threshold - np.float32(c) * width
    classes[chosen[inside]] = 0
    positions = np.flatnonzero(classes)
    return positions.astype(np.int32), classes[positions]
