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
| ``positions`` | int32 ``[M]`` | distinct host-backed positions selected (union over the step's tokens and the index group) |
| ``meta`` | 0-d unicode | JSON: ``{"format": "vllm-hisparse-trace", "version": 1, "top_k": ..., "block_size": ..., "source": ...}`` |

Only host-backed positions are recorded: resident pages never touch the hot region, so they do
not matter to its replacement policy.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterator

import numpy as np

FORMAT = "vllm-hisparse-trace"
VERSION = 1


@dataclasses.dataclass
class SelectionTrace:
    """Per-request sequences of selection sets (see the module docstring for the file format)."""

    request: np.ndarray
    step: np.ndarray
    offsets: np.ndarray
    positions: np.ndarray
    meta: dict

    def __post_init__(self):
        n = self.request.shape[0]
        if self.step.shape != (n,) or self.offsets.shape != (n + 1,):
            raise ValueError(f"trace: request has {n} records but step has "
                             f"{self.step.shape[0]} and offsets {self.offsets.shape[0]} (want n+1)")
        if n and (self.offsets[0] != 0 or self.offsets[-1] != self.positions.shape[0]
                  or np.any(np.diff(self.offsets) < 0)):
            raise ValueError("trace: offsets must start at 0, never decrease and end at "
                             "len(positions)")

    @property
    def num_records(self) -> int:
        return int(self.request.shape[0])

    def requests(self) -> Iterator[tuple[int, list[np.ndarray]]]:
        """(request id, its selection sets in step order) for every request."""
        order = np.lexsort((self.step, self.request))
        current, sets = None, []
        for i in order:
            r = int(self.request[i])
            if r != current and current is not None:
                yield current, sets
                sets = []
            current = r
            sets.append(self.positions[self.offsets[i]:self.offsets[i + 1]])
        if current is not None:
            yield current, sets

    def save(self, path: str) -> None:
        np.savez_compressed(path, request=self.request.astype(np.int32),
                            step=self.step.astype(np.int32),
                            offsets=self.offsets.astype(np.int64),
                            positions=self.positions.astype(np.int32),
                            meta=np.array(json.dumps({**self.meta, "format": FORMAT,
                                                      "version": VERSION})))

    @classmethod
    def load(cls, path: str) -> "SelectionTrace":
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {k: data[k] for k in ("request", "step", "offsets", "positions", "meta")}
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{path}: not a vllm-hisparse selection trace ({exc})") from exc
        meta = json.loads(str(arrays.pop("meta")))
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise ValueError(f"{path}: trace format {meta.get('format')!r} version "
                             f"{meta.get('version')!r}; this build reads {FORMAT!r} v{VERSION}")
        return cls(meta=meta, **arrays)


class TraceRecorder:
    """Accumulates records in memory and writes them with :meth:`SelectionTrace.save`."""

    def __init__(self, **meta):
        self.meta = meta
        self._request: list[int] = []
        self._step: list[int] = []
        self._sets: list[np.ndarray] = []

    def add(self, request: int, step: int, positions) -> None:
        self._request.append(request)
        self._step.append(step)
        self._sets.append(np.unique(np.asarray(positions, dtype=np.int32)))

    def trace(self) -> SelectionTrace:
        lengths = np.array([s.shape[0] for s in self._sets], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        positions = (np.concatenate(self._sets) if self._sets
                     else np.zeros(0, dtype=np.int32)).astype(np.int32)
        return SelectionTrace(np.array(self._request, dtype=np.int32),
                              np.array(self._step, dtype=np.int32), offsets, positions, self.meta)


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


def synthetic_trace(num_requests: int = 2, num_steps: int = 300, top_k: int = 2048,
                    context_tokens: int = 100_000, seed: int = 0, *, recent_tokens: int = 128,
                    anchor_weight: float = 1.4, anchor_persistence: float = 0.99,
                    noise_weight: float = 0.6, noise_persistence: float = 0.6,
                    burst_rate: float = 0.08, burst_tokens: int = 128, burst_gain: float = 1.0,
                    burst_decay: float = 0.87,
                    resident_tail_tokens: int = 128) -> SelectionTrace:
    """The embedded default trace: an indexer's top-k over a score per position.

    Each step, position p scores ``base[p] + anchor_weight * anchor[p] + noise_weight * noise[p]
    + burst[p]`` and the ``top_k`` best are selected, the newest ``recent_tokens`` always (the
    recency window). ``base`` (standard normal, fixed) is how relevant a position is to the
    request; ``anchor`` is a slowly drifting AR(1) term (``anchor_persistence`` per step), so the
    set of recurring "anchor" positions moves over hundreds of steps; ``noise`` is a fast AR(1)
    term (``noise_persistence``), the flicker of positions near the selection threshold; and
    with probability ``burst_rate`` per step a span of ``burst_tokens`` positions gains
    ``burst_gain``, decaying by ``burst_decay`` a step (a burst of new positions). The context
    grows by one token a step. The newest ``resident_tail_tokens`` are resident (the tail pages)
    and left out, as a recorded trace would.

    With the defaults it reproduces :data:`PAPER_MISS_RATES` within half a point
    (``vllm-hisparse replay`` prints both; docs/core.md has the table).
    """
    if not 0 <= anchor_persistence < 1 or not 0 <= noise_persistence < 1:
        raise ValueError("synthetic_trace: persistences must be in [0, 1)")
    rng = np.random.default_rng(seed)
    rec = TraceRecorder(top_k=top_k, block_size=64, source="synthetic", seed=seed,
                        context_tokens=context_tokens)
    anchor_step = np.float32(np.sqrt(1.0 - anchor_persistence ** 2))
    noise_step = np.float32(np.sqrt(1.0 - noise_persistence ** 2))
    for r in range(num_requests):
        n = context_tokens + num_steps
        base = rng.standard_normal(n, dtype=np.float32)
        anchor = rng.standard_normal(n, dtype=np.float32)
        noise = rng.standard_normal(n, dtype=np.float32)
        burst = np.zeros(n, dtype=np.float32)
        for s in range(num_steps):
            ctx = context_tokens + s
            anchor[:ctx] *= np.float32(anchor_persistence)
            anchor[:ctx] += anchor_step * rng.standard_normal(ctx, dtype=np.float32)
            noise[:ctx] *= np.float32(noise_persistence)
            noise[:ctx] += noise_step * rng.standard_normal(ctx, dtype=np.float32)
            burst[:ctx] *= np.float32(burst_decay)
            if rng.random() < burst_rate and ctx > burst_tokens:
                start = int(rng.integers(0, ctx - burst_tokens))
                burst[start:start + burst_tokens] += np.float32(burst_gain)
            score = base[:ctx] + np.float32(anchor_weight) * anchor[:ctx]
            score += np.float32(noise_weight) * noise[:ctx]
            score += burst[:ctx]
            score[max(0, ctx - recent_tokens):] = np.inf
            k = min(top_k, ctx)
            chosen = np.argpartition(-score, k - 1)[:k] if k < ctx else np.arange(ctx)
            host_backed = np.sort(chosen[chosen < ctx - resident_tail_tokens])
            rec.add(r, s, host_backed)
    return rec.trace()
