"""Speculative decoding (MTP, EAGLE, n-gram drafts) in the scheduler role: rejected drafts.

With ``num_speculative_tokens = k`` vLLM schedules ``1 + k`` tokens of a decoding request
per step (``num_scheduled_tokens`` counts the drafts), and the forward writes the KV of
all of them. When the step's output comes back, ``Scheduler.update_from_output`` moves
``request.num_computed_tokens`` back by the rejected drafts before it hands the connector
its output. The residency policy had counted every scheduled position as written, and
that step's MIRROR copies the rejected rows to the host like any other.

:class:`DraftRollback` tells the policy (``ResidencyPolicy.roll_back``) which positions
were kept, once per step and before that step's acks are applied (``update_connector_output``),
or at the next ``build_connector_meta`` when the step's output carried no acks. Rolled
back positions lose their host validity and the open copies are clipped, so a page holding
a rejected row can never turn clean, be released and be read back from the host
(``core/rollback.py``); the next step writes those positions again and mirrors them.

Only synchronous scheduling: under async scheduling vLLM plans step N+1 before step N is
verified and the worker shifts its positions on the GPU, so the positions a step writes are
not known when its command is built (``engine_checks.check_runner_and_scheduling`` refuses the
combination). Cost: nothing without speculative tokens; otherwise one pass over the
step's scheduled requests (reading ``num_computed_tokens``) and a vectorised rollback.

The role tells :class:`DraftRollback` each step it built (:meth:`~DraftRollback.remember`)
and asks it to roll back before the next step's acks (:meth:`~DraftRollback.roll_back_rejected`).
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.core.policy import ResidencyPolicy
from vllm_hisparse.vllm.scheduler_side.request_book import RequestBook


class DraftRollback:
    """Rejected draft positions → ``ResidencyPolicy.roll_back`` (module docstring)."""

    def __init__(self, book: RequestBook, max_decode_query_len: int) -> None:
        self.book = book
        self.max_decode_query_len = max_decode_query_len
        self._policy: ResidencyPolicy | None = None
        # The last built step: its requests, state rows and their incarnations.
        self._step: tuple[tuple, np.ndarray, np.ndarray] | None = None

    def bind(self, policy: ResidencyPolicy) -> None:
        self._policy = policy

    def remember(self, keys: tuple, rows: np.ndarray) -> None:
        """The step just built (nothing to remember without speculative tokens)."""
        if self.max_decode_query_len > 1 and keys:
            self._step = (keys, rows.copy(), self._policy.serials_at(rows))

    def roll_back_rejected(self) -> None:
        """Roll the last built step's requests back to vLLM's ``num_computed_tokens``
        (once per step; requests that ended or restarted since are skipped)."""
        step, self._step = self._step, None
        if step is None:
            return
        keys, rows, serials = step
        requests = self.book.requests
        computed = np.fromiter(
            (requests[k].num_computed_tokens if k in requests else -1 for k in keys),
            dtype=np.int64, count=len(keys))
        policy = self._policy
        cut = (policy.serials_at(rows) == serials) & (computed >= 0) & (computed < policy.num_tokens_at(rows))
        if np.count_nonzero(cut):
            policy.roll_back(rows[cut], computed[cut])
