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

A mixin of :class:`~vllm_hisparse.vllm.scheduler_side.role.SchedulerRole`.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class DraftRollback:
    """Rejected draft positions → ``ResidencyPolicy.roll_back`` (module docstring)."""

    _spec_step: tuple[tuple, np.ndarray, np.ndarray] | None = None

    def _remember_spec_step(self, keys: tuple, rows: np.ndarray) -> None:
        """The step just built: its requests, state rows and their incarnations."""
        if self.max_decode_query_len > 1 and keys:
            self._spec_step = (keys, rows.copy(), self.policy.tables.serial[rows].copy())

    def _roll_back_rejected(self) -> None:
        """Roll the last built step's requests back to vLLM's ``num_computed_tokens``
        (once per step; requests that ended or restarted since are skipped)."""
        step, self._spec_step = self._spec_step, None
        if step is None:
            return
        keys, rows, serials = step
        requests: dict[str, Any] = self._requests
        computed = np.fromiter(
            (requests[k].num_computed_tokens if k in requests else -1 for k in keys),
            dtype=np.int64, count=len(keys))
        policy = self._require_policy()
        t = policy.tables
        cut = (t.serial[rows] == serials) & (computed >= 0) & (computed < t.num_tokens[rows])
        if np.count_nonzero(cut):
            policy.roll_back(rows[cut], computed[cut])
