"""Hooks into a simulation run, step by step: what timing benchmarks attach to.

A :class:`StepProbe` given to :class:`~.engine.SimulationEngine` is told when a run starts
(:class:`ProbeRun`: the synthetic model and, with the connector, the attention-hook
bindings of its index groups), right before and right after each step's forward
(:class:`StepInfo`), after every sparse-MLA layer's top-k conversion (the rows
attention would read), and of vLLM's ``SchedulerStats`` after each step. ``vllm-hisparse bench connector`` uses it to add a stand-in for each
layer's attention read and weight pass, to time each decode step between CUDA events, and to
turn the miss copies off on alternate steps (the no-IO oracle of the same run);
``bench throughput`` runs the layers itself (:meth:`StepProbe.attend`), replayed from CUDA
graphs.

The engine calls the probe only; whatever the probe does on the GPU is ordered on the
current stream like the forward's own work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ProbeRun:
    """One run as a probe sees it.

    Attributes:
        label: ``"with connector"`` or ``"without connector"``.
        with_connector: whether the connector's worker role is bound.
        model: the run's :class:`~.synthetic_attention.SyntheticModel` (its ``layers``:
            layer name -> (KV cache group, model layer, flat row view, block stride)).
        bindings: the attention hook's ``IndexGroupResidency`` of every index unit, in
            layer order (empty without the connector).
        worker_role: the connector's ``WorkerRole`` (its ``host_pool``, lanes), or
            None without the connector.
        scheduler: the run's vLLM ``Scheduler`` (its ``running`` requests).
    """

    label: str
    with_connector: bool
    model: Any
    bindings: tuple[Any, ...]
    worker_role: Any = None
    scheduler: Any = None


@dataclass(frozen=True)
class StepInfo:
    """One engine step.

    Attributes:
        step: the engine's step number (1-based).
        num_requests: requests scheduled in the step.
        num_tokens: tokens scheduled in the step.
        decode_only: every scheduled request decodes exactly one token past its prompt.
        running: requests the scheduler holds as running after ``schedule()``.
    """

    step: int
    num_requests: int
    num_tokens: int
    decode_only: bool
    running: int


class StepProbe:
    """Base class: every hook does nothing. Override what you need."""

    def start_run(self, run: ProbeRun) -> None:
        """The run's model (and worker role) are built; no step has run yet."""

    def wants_attention(self, step: StepInfo) -> bool:
        """Whether the step runs the layers' top-k conversions (attention). A timing probe
        may skip untimed steps (a long prompt's prefill); the residency state then sees no
        selection of that step, as if its tracked requests had not attended."""
        return True

    def write_kv(self, step: StepInfo, write) -> None:
        """The step's KV writes (``write()``; in vLLM an op inside the forward, here the
        synthetic model's own): a timing probe may leave their host time out."""
        write()

    def replaces_attention(self, step: StepInfo) -> bool:
        """Whether :meth:`attend` runs the step's layers instead of the model (asked only of
        steps :meth:`wants_attention` accepted). The step's rows are then not checked."""
        return False

    def attend(self, step: StepInfo, metadata: dict[str, Any], topk: torch.Tensor) -> None:
        """The step's layers, run by the probe (``bench throughput``: a CUDA graph replayed
        from fixed buffers): ``metadata`` is layer name -> the step's attention metadata,
        ``topk`` int32 ``[T, K]`` the indexers' selections in token order."""

    def before_forward(self, step: StepInfo) -> None:
        """Right before the step's forward: before the worker role's ``start_load_kv`` (the
        residency command, restores) or, without the connector, before the KV writes."""

    def after_layer(self, step: StepInfo, layer_name: str, rows: torch.Tensor,
                    counts: torch.Tensor) -> None:
        """After layer ``layer_name`` converted its top-k: ``rows`` int32 ``[T, K]`` (valid
        rows first) and ``counts`` int32 ``[T]`` are what its attention would read."""

    def after_forward(self, step: StepInfo) -> None:
        """Right after the forward: after the worker role's ``wait_for_save`` (spills and
        mirrors launched) or, without the connector, after the last layer."""

    def scheduler_stats(self, step: int, stats: Any) -> None:
        """vLLM's ``SchedulerStats`` of the step (what the engine core sends the API server's
        stat loggers): its ``kv_connector_stats`` is the connector's report, the scheduler
        role's and the workers' folded by vLLM's scheduler, as a dict."""

    def end_run(self) -> None:
        """The run finished (or failed); called once."""
