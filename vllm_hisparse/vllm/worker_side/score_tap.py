"""The indexer's decode scores, carried from vLLM's top-k to our resolve (score-aware eviction).

With ``hot_region_eviction: score`` a miss evicts the hot slot whose position the indexer
scored lowest this step (least recent among equals) instead of the least recent one
(docs/core.md, "Beyond LRU: score-aware eviction"). The scores exist only inside vLLM's
``sparse_attn_indexer`` op: its decode path computes logits ``[B * next_n, max_model_len]``
and hands them, with the output buffer, to ``SparseIndexerTopk.forward``; only the top-k
indices leave the op. The ``indexer_scores`` patch (``patches.INDEXER_SCORES``) wraps that
method with :meth:`ScoreTap.record_decode_topk`: after vLLM's top-k it keeps the logits and
each row's threshold and class width (``ops.score_threshold``, one launch; it must run there:
the output buffer may be rewritten after the call, in the padded speculative-decoding layout).

The leader layer of each bound index group runs its indexer, then its attention, whose top-k
conversion calls :meth:`ScoreTap.take` (``read_path``): the record is handed over once,
and only to a conversion whose top-k tensor starts where the recorded top-k was written (the
model's shared ``topk_indices_buffer``); anything else (a prefill-only step, another model's
indexer) leaves the conversion without scores and its slots in plain LRU order for that
step. The record holds the logits until then: one layer's decode logits (at most
``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``) live through that layer's attention, and the worker
role drops a record nobody took at the end of the step (:meth:`ScoreTap.drop`).

CUDA graphs: the indexer op is one of vLLM's splitting ops, so in piecewise graphs it runs
eagerly like the attention, and in a full graph both are captured together; either way the
record made while capturing is the one the captured conversion consumes, and replays read
the same buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from vllm_hisparse import ops


@dataclasses.dataclass
class ScoreRecord:
    """One decode top-k's scores.

    Attributes:
        logits: float ``[B * next_n, W]`` the indexer's decode logits (vLLM's tensor).
        threshold: float32 ``[B * next_n]`` lowest selected score per row.
        width: float32 ``[B * next_n]`` class width per row.
        next_n: logits rows per decode request.
        topk_address: ``data_ptr()`` of the top-k output the scores belong to.
    """

    logits: torch.Tensor
    threshold: torch.Tensor
    width: torch.Tensor
    next_n: int
    topk_address: int


class ScoreTap:
    """Hands the latest decode top-k's scores to the next conversion of the same top-k.

    One per process (:data:`TAP`): the patch is on vLLM's class, so it sees every top-k the
    process runs. Records nothing until :meth:`enable`."""

    def __init__(self) -> None:
        self.enabled = False
        self._ops: ops.Backend = ops.select("auto")
        self._record: ScoreRecord | None = None

    def enable(self, ops_backend: str | ops.Backend = "auto") -> None:
        """Start recording (the worker role, when it binds groups with score eviction), with
        the thresholds computed by ``ops_backend`` (the connector's ``ops_backend``)."""
        self._ops = ops_backend if isinstance(ops_backend, ops.Backend) \
            else ops.select(ops_backend)
        self.enabled = True

    def record_decode_topk(self, original: Callable[..., Any], logits: torch.Tensor,
                           seq_lens: torch.Tensor, next_n: int, topk_indices: torch.Tensor,
                           topk_tokens: int, max_seq_len: int) -> Any:
        """Body of the ``indexer_scores`` patch: vLLM's top-k, then the record."""
        out = original(logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)
        if self.enabled:
            bounds = torch.empty((2, logits.shape[0]), dtype=torch.float32,
                                 device=logits.device)
            threshold, width = bounds[0], bounds[1]
            self._ops.score_threshold(logits, topk_indices, threshold, width)
            self._record = ScoreRecord(logits, threshold, width, int(next_n),
                                       topk_indices.data_ptr())
        return out

    def drop(self) -> None:
        """Forget the pending record (the worker role, at the end of each step: a step whose
        conversions took none, e.g. every request FULL, would otherwise keep the last layer's
        logits alive until the next step's first top-k)."""
        self._record = None

    def take(self, logical_topk: torch.Tensor) -> ScoreRecord | None:
        """The pending record when it belongs to ``logical_topk`` (same start address), else
        None; the pending record is dropped either way."""
        record, self._record = self._record, None
        if record is None or record.topk_address != logical_topk.data_ptr():
            return None
        return record


#: The process's tap.
TAP = ScoreTap()
