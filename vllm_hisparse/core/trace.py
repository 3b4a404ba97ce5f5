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


def synthetic_trace(num_requests: int = 8, num_steps: int = 200, top_k: int = 2048,
                    context_tokens: int = 32768, seed: int = 0, *, recent_tokens: int = 128,
                    drift_tokens: float = 16.0, random_fraction: float = 0.05,
                    resident_tail_tokens: int = 128) -> SelectionTrace:
    """The embedded default trace: per request, K selections per step drawn from the newest
    tokens, a window around a slowly drifting focus, and scattered older positions (most of
    them from a per-request pool of recurring "important" positions, the rest anywhere); the
    context grows by one token a step. The newest ``resident_tail_tokens`` are resident (the
    tail pages) and left out, as a recorded trace would."""
    rng = np.random.default_rng(seed)
    rec = TraceRecorder(top_k=top_k, block_size=64, source="synthetic", seed=seed,
                        context_tokens=context_tokens)
    for r in range(num_requests):
        focus = float(rng.integers(0, context_tokens))
        important = rng.integers(0, context_tokens, 2 * top_k)
        for s in range(num_steps):
            ctx = context_tokens + s
            focus = min(max(0.0, focus + rng.normal() * drift_tokens), ctx - 1.0)
            num_random = int(top_k * random_fraction)
            recent = np.arange(max(0, ctx - recent_tokens), ctx)
            num_recurring = (2 * num_random) // 3
            scattered = np.concatenate([rng.choice(important, num_recurring),
                                        rng.integers(0, ctx, num_random - num_recurring)])
            lo = int(min(max(0, focus - top_k // 2), max(0, ctx - top_k)))
            window = np.arange(lo, min(ctx, lo + top_k))
            cand = np.concatenate([recent, scattered, window])
            _, first = np.unique(cand, return_index=True)
            chosen = cand[np.sort(first)][:top_k]
            host_backed = chosen[chosen < ctx - resident_tail_tokens]
            rec.add(r, s, host_backed)
    return rec.trace()
