"""``simulate --topk-drift scored``: decode top-k from a synthetic indexer's scores, selected by
vLLM's own ``SparseIndexerTopk``.

Each request holds a score per position built with the mechanisms of the calibrated replay
trace (``core.trace.ScoreProcess`` with its default profile: a fixed base relevance N(0, 1), a
slowly drifting AR(1) anchor term, a fast AR(1) noise term and decaying bursts on random
spans); every decode token advances the processes by one step over its context (which grows by
one position per decode step). The newest positions get a finite
recency bonus (:data:`RECENT_BONUS`), not the trace's infinity: a score tap reads these logits
and needs finite selected scores. The randoms are numpy's, drawn on the host from a seed per
request and run, so CPU and CUDA runs see bit-identical float32 logits.

A step's decode tokens are the first rows of the batch (:func:`decodes_first`, as vLLM's MLA
backends reorder a batch); their logits ``[num_decode_tokens, W]`` (-inf past each row's
context) go to the model's device once, and :meth:`ScoredIndexer.select` runs vLLM's
``SparseIndexerTopk`` (backend ``"torch"``, any device) into an index unit's top-k buffer:
logits row i is batch row i (``next_n`` = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_hisparse.core.trace import ScoreProcess
from vllm_hisparse.vllm import compat

#: Added to the scores of the newest positions (about 1.7 standard deviations of a score).
RECENT_BONUS = 3.0
#: The newest positions with the bonus: at most this many, and at most a quarter of top-k.
RECENT_TOKENS = 128


def is_decode(state: Any, start: int, num_tokens: int) -> bool:
    """A decode token: one scheduled token past the request's prompt."""
    return num_tokens == 1 and start >= state.plan.prompt_len


def decodes_first(batch: Sequence[tuple]) -> list[tuple]:
    """The batch ``(request id, state, first position, tokens)`` with its decode requests first,
    each part in its scheduled order (vLLM's MLA backends reorder decodes to the front)."""
    return sorted(batch, key=lambda entry: not is_decode(entry[1], entry[2], entry[3]))


class RequestScores:
    """One request's indexer scores over positions ``[0, max_positions)``: the trace's
    :class:`~vllm_hisparse.core.trace.ScoreProcess` plus the recency bonus.

    Args:
        max_positions: the request's prompt + output tokens.
        seed: numpy seed material (the run's seed and the request's serial).
        recent_tokens: the newest positions that get :data:`RECENT_BONUS`.
    """

    def __init__(self, max_positions: int, seed: Sequence[int], recent_tokens: int):
        self.recent_tokens = recent_tokens
        self.process = ScoreProcess(
            max_positions, np.random.default_rng(np.random.SeedSequence(list(seed))))

    def step(self, context_len: int, out: np.ndarray) -> None:
        """Advance one step over ``[0, context_len)`` and write the scores there into ``out``
        (float32, at least ``context_len`` long)."""
        score = self.process.step(context_len, out)
        score[max(0, context_len - self.recent_tokens):] += np.float32(RECENT_BONUS)


@dataclass
class DecodeLogits:
    """A step's decode logits on the model's device: float32 ``logits [R, W]`` (-inf past each
    row's context), int32 ``seq_lens [R, 1]`` (each row's context) and their maximum."""

    logits: torch.Tensor
    seq_lens: torch.Tensor
    max_seq_len: int

    @property
    def num_rows(self) -> int:
        return int(self.logits.shape[0])


class ScoredIndexer:
    """The decode top-k of the simulator's scored workload (one per model).

    Args:
        top_k: selections per decode token (the model's ``index_topk``).
        seed: the run's seed (with each request's serial, the seed of its scores).
        device: the model's device (where the logits and the top-k go).
    """

    def __init__(self, top_k: int, seed: int, device: torch.device):
        self.top_k = top_k
        self.seed = seed
        self.device = device
        self.recent_tokens = min(RECENT_TOKENS, max(1, top_k // 4))
        # vLLM's decode top-k module; "torch" is its reference backend, on CPU and CUDA.
        self.topk_module = compat.indexer_topk_class()("torch")

    def request_scores(self, serial: int, max_positions: int) -> RequestScores:
        return RequestScores(max_positions, (self.seed & 0xFFFF_FFFF, serial, 0x5C0BE),
                             self.recent_tokens)

    def logits(self, decodes: Sequence[tuple[RequestScores, int]]) -> DecodeLogits:
        """One row per decode token ``(its request's scores, its context length)``, each
        request's processes advanced one step. The width is the longest context, at least
        ``top_k`` (the top-k needs that many columns), rounded up to 64 columns."""
        contexts = [ctx for _, ctx in decodes]
        width = -(-max(max(contexts), self.top_k) // 64) * 64
        host = np.full((len(decodes), width), -np.inf, dtype=np.float32)
        for row, (scores, ctx) in enumerate(decodes):
            scores.step(ctx, host[row])
        seq_lens = torch.tensor(contexts, dtype=torch.int32).reshape(-1, 1)
        return DecodeLogits(torch.from_numpy(host).to(self.device),
                            seq_lens.to(self.device), max(contexts))

    def select(self, step: DecodeLogits, topk_indices: torch.Tensor) -> None:
        """vLLM's ``SparseIndexerTopk`` of ``step`` into ``topk_indices`` (int32 ``[R, K]``, the
        first rows of an index unit's top-k buffer): K positions per row, -1 past a context
        shorter than K."""
        self.topk_module(step.logits, step.seq_lens, 1, topk_indices, self.top_k,
                         step.max_seq_len)
