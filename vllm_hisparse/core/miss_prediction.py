"""Cross-layer miss prediction, scored on selection traces with several index groups.

A speculative prefetch for index group L+1 (its hot region is its own) could be issued before
L+1's indexer runs, from what is already known: group L's selections this step, or the
selections of the step before. What it is worth depends on how well those predict L+1's
misses, which only a trace recorded on a real model can tell (``record_trace`` records every
index group; a synthetic trace's groups are independent by construction). This module measures
it; it prefetches nothing.

For each request, each group's hot region is replayed exactly as ``vllm-hisparse replay``
replays it (``core.replacement.replay_steps``, the kernel's ``hisparse`` LRU by default), so the
misses are exactly those a region of ``capacity_rows`` rows takes. At step t, with
``held`` = the positions L+1's region holds before the step and ``S_g(t)`` = group g's
selections (host-backed positions), L+1's misses are ``S_L+1(t) - held``, and the predictors
name, for L+1, the rows outside ``held`` of:

| predictor | rows | issued |
|---|---|---|
| ``layer`` | ``S_L(t)`` | once group L's indexer ran (a layer ahead) |
| ``step`` | ``S_L+1(t-1)``: L+1's own previous selections | a step ahead (the control, below) |
| ``layer_step`` | ``S_L(t-1)`` | a step ahead |
| ``union`` | all three | |

``step`` is empty by construction: a region holds every position of the step before (its
capacity is at least one step's selections), so L+1's own last step names no miss. It is kept
as the control that says the hot region already holds the temporal signal; what a step-ahead
prefetch can add comes from another group (``layer_step``).

``t-1`` is the request's previous recorded step (a request is not scheduled in every engine
step). Per predictor, over the steps where L+1 has a record:

* **recall** = covered / misses: the share of L+1's misses a prefetch issued early would have
  hidden (covered = predicted rows that L+1 then missed);
* **precision** = covered / predicted;
* **extra traffic** = (predicted - covered) / misses: rows copied for nothing, as a fraction
  of the miss rows the link moves anyway (it can exceed 1).

Every count is an exact integer (:class:`PredictionCounts`); the ratios are None where the
denominator is 0. stdlib + numpy only.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from vllm_hisparse.core.replacement import POLICIES, SCORED_POLICIES, replay_steps

#: Predictor id -> what it prefetches for group L+1 at step t (table and JSON order).
PREDICTORS = {
    "layer": "group L's selections at step t",
    "step": "group L+1's selections at step t-1",
    "layer_step": "group L's selections at step t-1",
    "union": "the union of the three",
}
ONE_GROUP_NOTE = "one index group: nothing to predict across layers"
_NONE = np.zeros(0, dtype=np.int64)


@dataclasses.dataclass
class PredictionCounts:
    """Rows of one predictor for one target group's hot region, summed over steps.

    Attributes:
        miss_rows: the target group's misses (host rows its region copied).
        predicted_rows: rows the predictor named that the region did not hold.
        covered_rows: predicted rows the target group then missed.
    """

    miss_rows: int = 0
    predicted_rows: int = 0
    covered_rows: int = 0

    @property
    def recall(self) -> float | None:
        """Share of the misses the prediction covered (None without misses)."""
        return self.covered_rows / self.miss_rows if self.miss_rows else None

    @property
    def precision(self) -> float | None:
        """Share of the predicted rows that were misses (None when nothing was predicted)."""
        return self.covered_rows / self.predicted_rows if self.predicted_rows else None

    @property
    def extra_rows(self) -> int:
        """Predicted rows that were not missed: link traffic for nothing."""
        return self.predicted_rows - self.covered_rows

    @property
    def extra_traffic(self) -> float | None:
        """``extra_rows`` as a fraction of the miss rows (None without misses)."""
        return self.extra_rows / self.miss_rows if self.miss_rows else None

    def add(self, other: "PredictionCounts") -> None:
        self.miss_rows += other.miss_rows
        self.predicted_rows += other.predicted_rows
        self.covered_rows += other.covered_rows

    def to_dict(self) -> dict:
        return {"miss_rows": self.miss_rows, "predicted_rows": self.predicted_rows,
                "covered_rows": self.covered_rows, "extra_rows": self.extra_rows,
                "recall": self.recall, "precision": self.precision,
                "extra_traffic": self.extra_traffic}


def _empty_counts() -> dict[str, PredictionCounts]:
    return {name: PredictionCounts() for name in PREDICTORS}


@dataclasses.dataclass
class GapPrediction:
    """The predictors of group ``target_group``'s misses from ``source_group`` (the group
    before it in the trace's order).

    Attributes:
        steps: (request, step) pairs at which the target group has a record.
        references: the target group's host-backed selections over those steps.
        counts: predictor id (:data:`PREDICTORS`) -> its counts.
    """

    source_group: int
    target_group: int
    steps: int = 0
    references: int = 0
    counts: dict[str, PredictionCounts] = dataclasses.field(default_factory=_empty_counts)

    @property
    def miss_rows(self) -> int:
        return self.counts["layer"].miss_rows

    @property
    def miss_rate(self) -> float | None:
        """The target group's misses per host-backed selection."""
        return self.miss_rows / self.references if self.references else None

    def to_dict(self) -> dict:
        return {"source_group": self.source_group, "target_group": self.target_group,
                "steps": self.steps, "references": self.references,
                "miss_rows": self.miss_rows, "miss_rate": self.miss_rate,
                "predictors": {name: c.to_dict() for name, c in self.counts.items()}}


@dataclasses.dataclass
class PredictionReport:
    """What :func:`evaluate_prediction` measured on one trace.

    Attributes:
        policy: the replacement policy of every hot region.
        capacity_rows: hot rows per request per index group.
        index_groups: the trace's groups in order (each gap is a neighbouring pair).
        requests: requests evaluated.
        gaps: one per neighbouring pair of groups; empty with one group.
    """

    policy: str
    capacity_rows: int
    index_groups: tuple[int, ...]
    requests: int
    gaps: list[GapPrediction]

    @property
    def note(self) -> str | None:
        """:data:`ONE_GROUP_NOTE` when the trace has a single index group, else None."""
        return ONE_GROUP_NOTE if len(self.index_groups) < 2 else None

    @property
    def overall(self) -> dict[str, PredictionCounts]:
        """Per predictor, the counts summed over every gap."""
        total = _empty_counts()
        for gap in self.gaps:
            for name, counts in gap.counts.items():
                total[name].add(counts)
        return total

    def to_dict(self) -> dict:
        return {"policy": self.policy, "capacity_rows": self.capacity_rows,
                "index_groups": list(self.index_groups), "requests": self.requests,
                "note": self.note, "predictors": dict(PREDICTORS),
                "overall": {name: c.to_dict() for name, c in self.overall.items()},
                "gaps": [gap.to_dict() for gap in self.gaps]}


def _outside(rows: np.ndarray, held_sorted: np.ndarray) -> np.ndarray:
    """The entries of ``rows`` (int64, ascending, distinct) not in ``held_sorted`` (int64,
    ascending)."""
    if not rows.shape[0] or not held_sorted.shape[0]:
        return rows
    at = np.minimum(np.searchsorted(held_sorted, rows), held_sorted.shape[0] - 1)
    return rows[held_sorted[at] != rows]


def _count_in(rows: np.ndarray, sorted_set: np.ndarray) -> int:
    """How many entries of ``rows`` (int64) are in ``sorted_set`` (int64, ascending)."""
    if not rows.shape[0] or not sorted_set.shape[0]:
        return 0
    at = np.minimum(np.searchsorted(sorted_set, rows), sorted_set.shape[0] - 1)
    return int(np.count_nonzero(sorted_set[at] == rows))


def _request_steps(per_group: dict[int, tuple[list[int], list[np.ndarray]]], policy: str,
                   capacity_rows: int, seed: int
                   ) -> Iterator[dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """One request's groups replayed in lockstep: per step of the request (ascending, over
    every group's records), group -> (needed, held sorted, missing) for the groups with a
    record at that step (int64 arrays, see ``replay_steps``)."""
    replays = {g: replay_steps(policy, sets, capacity_rows, seed=seed)
               for g, (_, sets) in per_group.items()}
    at_step = {g: set(steps) for g, (steps, _) in per_group.items()}
    for t in sorted(set().union(*at_step.values())):
        now = {}
        for g, replay in replays.items():
            if t in at_step[g]:
                needed, held, missing = next(replay)
                now[g] = (needed, np.sort(held), missing)
        yield now


def evaluate_prediction(trace, capacity_rows: int, policy: str = "hisparse",
                        seed: int = 0) -> PredictionReport:
    """Score the :data:`PREDICTORS` of each index group's misses on ``trace``.

    Args:
        trace: a ``SelectionTrace``; its index groups (``trace.index_groups``) in ascending id
            order are the layer order, and each neighbouring pair (L, L+1) is a gap.
        capacity_rows: hot rows of every request's region in every group.
        policy: the regions' replacement policy (``core.replacement.POLICIES`` except the
            score-aware ones; default ``hisparse``, the kernel's LRU).
        seed: for the ``random`` policy (request id added, as ``replay`` does).

    Raises ValueError for an unknown or score-aware policy, or a capacity smaller than the
    trace's largest selection set (no region could serve that step).
    """
    if policy not in POLICIES or policy in SCORED_POLICIES:
        accepted = [p for p in POLICIES if p not in SCORED_POLICIES]
        raise ValueError(f"miss prediction: policy {policy!r}; accepted: {', '.join(accepted)}")
    groups = trace.index_groups
    by_group = {g: {rid: (steps, [np.asarray(s, dtype=np.int64) for s in sets])
                    for rid, steps, sets in trace.stepped_requests(g)} for g in groups}
    largest = max((s.shape[0] for per in by_group.values() for _, sets in per.values()
                   for s in sets), default=0)
    if capacity_rows < largest:
        raise ValueError(f"a hot region of {capacity_rows} rows is smaller than the largest "
                         f"selection set of the trace ({largest} rows)")
    rids = sorted(set().union(*(per.keys() for per in by_group.values())))
    gaps = [GapPrediction(a, b) for a, b in zip(groups, groups[1:])]
    for rid in rids:
        if not gaps:
            break
        per_group = {g: by_group[g][rid] for g in groups if rid in by_group[g]}
        before: dict[int, np.ndarray] = {}
        for now in _request_steps(per_group, policy, capacity_rows, seed + rid):
            for gap in gaps:
                if gap.target_group not in now:
                    continue
                needed, held, missing = now[gap.target_group]
                source = now.get(gap.source_group, (_NONE,))[0]
                predicted = {
                    "layer": _outside(source, held),
                    "step": _outside(before.get(gap.target_group, _NONE), held),
                    "layer_step": _outside(before.get(gap.source_group, _NONE), held),
                }
                predicted["union"] = np.union1d(np.union1d(predicted["layer"],
                                                           predicted["step"]),
                                                predicted["layer_step"])
                gap.steps += 1
                gap.references += needed.shape[0]
                for name, rows in predicted.items():
                    counts = gap.counts[name]
                    counts.miss_rows += missing.shape[0]
                    counts.predicted_rows += rows.shape[0]
                    counts.covered_rows += _count_in(rows, missing)
            before = {g: entry[0] for g, entry in now.items()}
    return PredictionReport(policy, capacity_rows, tuple(groups), len(rids), gaps)
