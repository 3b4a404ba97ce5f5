"""vLLM's scheduler classes, and what the package reads or sets on its requests and outputs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler

__all__ = ["is_waiting_for_remote_kvs", "request_load_before_forward", "scheduled_token_counts",
           "scheduler_classes", "set_request_max_tokens"]


def scheduler_classes() -> tuple[type[Scheduler], type[Scheduler]]:
    """``(Scheduler, AsyncScheduler)`` from ``vllm.v1.core.sched``.

    Imported lazily: the scheduler pulls in the structured-output stack, which the
    planner and the plugin never need.
    """
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler, AsyncScheduler


def is_waiting_for_remote_kvs(request: Any) -> bool:
    """Whether vLLM parked the request for a connector load (``WAITING_FOR_REMOTE_KVS``)."""
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def set_request_max_tokens(request: Any, max_tokens: int) -> None:
    """Make a running vLLM ``Request`` stop after ``max_tokens`` output tokens (the length
    ``check_stop`` compares ``num_output_tokens`` with; ``bench throughput`` sets when each
    cohort of its batch leaves)."""
    request.max_tokens = max_tokens


def scheduled_token_counts(scheduler_output: Any) -> dict[str, int]:
    """``SchedulerOutput.num_scheduled_tokens`` (request id → tokens this step)."""
    return dict(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})


def request_load_before_forward(scheduler_output: Any) -> None:
    """Set ``SchedulerOutput.has_sync_kv_loads``: the model runner then calls the connector's
    ``start_load_kv`` before the step's forward (vLLM's V2 model runner otherwise calls it
    after, for steps without synchronous loads)."""
    scheduler_output.has_sync_kv_loads = True
