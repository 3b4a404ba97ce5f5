"""The worker's per-step view for the attention hook: what a captured CUDA graph reads each
step (the step's real token count, the state row of every batch row), and the token rows of
the forward that is running (one launch per forward, shared by its index groups).

The view is written by the worker role's ``start_load_kv`` (:meth:`StepView.begin`) and
closed by ``wait_for_save`` (:meth:`StepView.end`); :mod:`.read_path` reads it in every
conversion of a bound index group.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


class StepView:
    """What the attention hook needs to know about the current step (one per worker).

    The per-step values the resolver reads live in one fixed int32 device buffer, so a
    CUDA graph captured once reads each step's values: ``[0]`` is the number of real tokens of
    the step (tokens at or past it are padding), ``[1 + b]`` the state row of batch row ``b``
    when its request is tracked (not FULL), else -1. Outside a step the buffer is all -1
    (**inert**: every token is padding).

    Args:
        max_batch_rows: size of the batch-row table (vLLM ``max_num_seqs``).
        device: where the table lives (the KV device).
        max_num_tokens: tokens of the largest batch (vLLM ``max_num_batched_tokens``); sizes
            the token-index buffer (it grows outside a capture if a batch is larger).
        current_forward: returns an object that identifies the forward running now, a new one
            per forward, or None outside one (the worker role passes
            ``compat.current_forward_context``: vLLM's ``ForwardContext``); None = no such
            source (benchmarks and tests without vLLM: the other rules of
            :class:`_ForwardTokenRows` still end a forward).
    """

    def __init__(self, max_batch_rows: int, device: torch.device | str,
                 max_num_tokens: int = 1,
                 current_forward: Callable[[], object | None] | None = None):
        self.max_batch_rows = max_batch_rows
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self._table = torch.full((1 + max_batch_rows,), -1, **i32)
        #: int32 [1]: the step's real token count; -1 while inert.
        self.num_real_tokens = self._table[:1]
        #: int32 [max_batch_rows]: state row of each batch row whose request is not FULL,
        #: -1 for FULL requests, padding and unused rows.
        self.batch_state_rows = self._table[1:]
        self._token_index = torch.arange(max(1, max_num_tokens), **i32)
        self._token_rows = _ForwardTokenRows(current_forward)
        self._inert = True
        self.step_id = -1
        #: start_load_kv ran and wait_for_save did not yet.
        self.ready = False
        #: vLLM bound a step's connector metadata (its forward is next) and did not clear it.
        self.bound = False
        self.uses_residency = False

    def begin(self, step_id: int, batch_state_rows: Sequence[int] | None,
              num_real_tokens: int | None = None) -> None:
        """Start a step. ``batch_state_rows[i]`` is the state row of batch row ``i`` when its
        request is not FULL, else -1; ``None`` = every request of the batch is FULL.
        ``num_real_tokens``: the batch's tokens before padding (None: not known, only
        ``num_actual_tokens`` of the attention metadata bounds them)."""
        self.step_id = step_id
        self.ready = True
        self.uses_residency = batch_state_rows is not None
        self._token_rows.clear()
        if batch_state_rows is None:
            self._make_inert()
            return
        n = len(batch_state_rows)
        if n > self.max_batch_rows:
            raise ValueError(f"StepView: batch of {n} requests exceeds max_num_seqs = "
                             f"{self.max_batch_rows}")
        # pinned on CUDA: a pageable source may make the driver wait for the stream
        host = torch.full((1 + self.max_batch_rows,), -1, dtype=torch.int32,
                          pin_memory=self.device.type == "cuda")
        host[0] = torch.iinfo(torch.int32).max if num_real_tokens is None else num_real_tokens
        host[1:n + 1] = torch.as_tensor(list(batch_state_rows), dtype=torch.int32)
        self._table.copy_(host, non_blocking=True)  # one copy, before the forward (or replay)
        self._inert = False

    def end(self) -> None:
        """Close the step: the buffer goes back to inert, in stream order after the forward."""
        self.ready = False
        self._token_rows.clear()
        self._make_inert()

    def _make_inert(self) -> None:
        if not self._inert:
            self._table.fill_(-1)
            self._inert = True

    def token_index(self, num_tokens: int) -> torch.Tensor:
        """int32 ``[num_tokens]`` = 0, 1, ... (a fixed buffer; grown outside a capture)."""
        if num_tokens > self._token_index.shape[0]:
            if capturing():
                raise RuntimeError(f"residency hook: a CUDA graph captures {num_tokens} tokens, "
                                   f"more than max_num_batched_tokens = "
                                   f"{self._token_index.shape[0]}")
            self._token_index = torch.arange(num_tokens, dtype=torch.int32, device=self.device)
        return self._token_index[:num_tokens]

    def token_state_rows(self, req_id_per_token: torch.Tensor, num_actual_tokens: int | None,
                         ops: Any, consumer: object | None = None) -> torch.Tensor:
        """int32 ``[T]``: state row of each token of a non-FULL request; -1 for tokens of FULL
        requests and padding tokens (index at or past the step's real token count, or past
        ``num_actual_tokens`` when given, outside a capture). One ``ops.token_state_rows``
        launch of the backend ``ops``: capturable, and a replay reads the values
        :meth:`begin` wrote for its step (a capture would freeze ``num_actual_tokens``; the
        table does not).

        ``consumer`` (an index group's binding) shares the launch: every index group of a
        forward converts the same ``req_id_per_token`` against the same table, so the first
        leader's launch serves the others (DeepSeek-V3.2 and GLM-5.1 have an index group per
        layer: one launch per forward instead of one per layer). :class:`_ForwardTokenRows`
        says when a forward ends. The result is read, never written, by its consumers."""
        now_capturing = capturing()
        limit = None if num_actual_tokens is None or now_capturing else int(num_actual_tokens)
        key = (req_id_per_token.data_ptr(), tuple(req_id_per_token.shape),
               req_id_per_token.stride(), req_id_per_token.dtype, req_id_per_token.device,
               limit, getattr(ops, "name", id(ops)))
        cached = self._token_rows.take(key, consumer, now_capturing)
        if cached is not None:
            return cached
        batch_rows = req_id_per_token.contiguous()
        if batch_rows.dtype not in (torch.int32, torch.int64):
            batch_rows = batch_rows.to(torch.int32)
        out = torch.empty(batch_rows.shape[0], dtype=torch.int32, device=batch_rows.device)
        ops.token_state_rows(batch_rows, self._table[:1 + self.max_batch_rows], out, limit)
        self._token_rows.put(key, consumer, out, req_id_per_token)
        return out


class _ForwardTokenRows:
    """The token rows computed in the current forward, by input, with the index groups that
    took each (see :meth:`StepView.token_state_rows`).

    Every entry is dropped when a forward may have ended: a step begins or ends; a CUDA graph
    capture begins or ends (a capture must hold its own launch: its replays serve later
    steps); the forward identity changes (a draft model's forward inside a step, whose
    metadata may reuse the same buffers with other contents); or an index group asks again
    for the same input (its next forward: each group converts once per forward, at its
    leader layer). Outside a step the view is inert, so any entry there is all -1 whatever
    the input."""

    def __init__(self, current_forward: Callable[[], object | None] | None = None) -> None:
        self._current_forward = current_forward
        # key -> (rows, ids of the groups that took them, the input: held, so that its
        # memory, named by the key, is not reused meanwhile)
        self._entries: dict[tuple, tuple[torch.Tensor, set[int], torch.Tensor]] = {}
        self._capturing = False
        self._forward: object | None = None  # held, so that its id is not reused meanwhile

    def clear(self) -> None:
        self._entries.clear()
        self._forward = None

    def take(self, key: tuple, consumer: object | None,
             now_capturing: bool) -> torch.Tensor | None:
        """The rows computed for ``key`` in this forward, or None (then :meth:`put` them);
        ``now_capturing``: whether a CUDA graph capture is running."""
        forward = None if self._current_forward is None else self._current_forward()
        if now_capturing != self._capturing or forward is not self._forward:
            self.clear()
            self._capturing, self._forward = now_capturing, forward
        entry = self._entries.get(key)
        if consumer is None or entry is None:
            return None
        rows, consumers, _ = entry
        if id(consumer) in consumers:  # this group's next forward
            self._entries.clear()
            return None
        consumers.add(id(consumer))
        return rows

    def put(self, key: tuple, consumer: object | None, rows: torch.Tensor,
            source: torch.Tensor) -> None:
        if consumer is not None:
            self._entries[key] = (rows, {id(consumer)}, source)


def capturing() -> bool:
    """True while the current CUDA stream is being captured into a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
