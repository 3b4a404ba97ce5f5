"""vLLM 0.33's real ``Scheduler`` / ``AsyncScheduler`` driven on CPU with a fake forward.

Everything scheduler-side is vLLM's own (config, ``KVCacheManager``, ``BlockPool``,
``Scheduler``) over a KV cache config the caller planned; only the model forward is faked:
each step returns a ``ModelRunnerOutput`` that samples one fixed token for every request whose
prompt is fully computed after the step. A worker stand-in (``on_forward(scheduler_output) ->
KVConnectorOutput | None``) answers our connector's commands; :class:`InStepAcks` acks every
transfer in the step that issued it. The scheduler benchmarks time this driver; the tests
extend it (fault-injecting workers, speculative decoding, leak checks). :func:`plan_kv_cache`
and :func:`make_scheduler` set up vLLM's planning and scheduler as the engine core does; the
simulator's engine builds on them too.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm_hisparse.core.commands import WorkerAcks
from vllm_hisparse.vllm.compat import (KVConnectorOutput, ModelRunnerOutput, Request, SamplingParams,
                                       StructuredOutputManager, get_global_kv_cache_groups,
                                       get_kv_cache_configs, get_request_block_hasher, init_none_hash,
                                       scheduler_classes, sha256)
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata
from vllm_hisparse.vllm.simulation.spec import SAMPLED_TOKEN


class InStepAcks:
    """A single worker whose copies all finish within the forward: every transfer of our
    connector's command is acked completed in the output of the step that issued it, and a
    host-prefix load (``load_requests``) is reported received then."""

    def on_forward(self, scheduler_output: Any) -> KVConnectorOutput | None:
        meta = scheduler_output.kv_connector_metadata
        if meta is None:
            return None
        assert isinstance(meta, HiSparseConnectorMetadata), type(meta)
        ids = [spec.transfer_id for spec in meta.command.transfers]
        if not ids:
            return None
        loaded = {meta.load_requests[i] for i in ids if i in meta.load_requests}
        worker_meta = HiSparseWorkerMetadata(acks=WorkerAcks(enqueued=[], completed=ids, failed=[]),
                                             worker_rank=0)
        return KVConnectorOutput(kv_connector_worker_meta=worker_meta, finished_recving=loaded or None,
                                 failed_recving=set())


@dataclass
class RunStats:
    steps: int = 0
    peak_running: int = 0
    preemptions: int = 0
    finished: list[str] = field(default_factory=list)
    running_per_step: list[int] = field(default_factory=list)


def plan_kv_cache(vllm_config, specs, num_blocks: int):
    """vLLM's KV planning of ``specs`` (layer name -> spec) into a pool of exactly
    ``num_blocks`` blocks, as the engine core plans (our planner when the connector is
    configured); ``vllm_config.cache_config.num_gpu_blocks`` is set to it."""
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    try:
        # With the override vLLM sizes the pool to exactly num_blocks whatever memory we
        # claim; claim plenty so its max_model_len check passes.
        (full,) = get_kv_cache_configs(vllm_config, [specs], [1 << 40], groups)
    finally:
        vllm_config.cache_config.num_gpu_blocks_override = None
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return full


def make_scheduler(scheduler_cls: type, vllm_config: Any, kv_cache_config: Any,
                   block_size: int) -> tuple[Any, Any]:
    """vLLM's ``scheduler_cls`` over ``kv_cache_config`` (the scheduler's form of the plan),
    built as the engine core builds it, and the block hasher its requests need."""
    init_none_hash(sha256)
    scheduler = scheduler_cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                              structured_output_manager=StructuredOutputManager(vllm_config),
                              block_size=block_size, log_stats=True)
    return scheduler, get_request_block_hasher(block_size, sha256)


class SchedulerDriver:
    """A real scheduler with a fake forward; counts running, preemptions, finishes.

    Args:
        vllm_config: the engine's config (its ``kv_transfer_config`` decides the connector).
        kv_cache_config: the plan in the scheduler's form (each group collapsed to its first
            layer's spec), as the engine core hands it over.
        worker: answers our connector's commands (default with our connector:
            :class:`InStepAcks`; None without it).
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, worker: Any = None) -> None:
        scheduler_cls, async_scheduler_cls = scheduler_classes()
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        cls = async_scheduler_cls if async_scheduling else scheduler_cls
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        self.scheduler, self._block_hasher = make_scheduler(cls, vllm_config, kv_cache_config,
                                                            self.block_size)
        # The engine core keeps one batch in flight with async scheduling: step N+1 is
        # scheduled before step N's output is applied.
        self.in_flight_depth = 2 if async_scheduling else 1
        self._in_flight: deque[Any] = deque()
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self.stats = RunStats()
        self.worker = worker
        if worker is None and self.residency is not None:
            self.worker = self.default_worker()

    def default_worker(self) -> Any:
        """The worker stand-in used when our connector is configured and none was given."""
        return InStepAcks()

    # ------------------------------------------------------------------ workload

    def add_request(
        self, prompt_len: int, max_tokens: int, *, prompt_token_ids: list[int] | None = None
    ) -> Request:
        request_id = f"req-{next(self._ids)}"
        tokens = prompt_token_ids or [
            (hash((request_id, i)) % 900) + 10 for i in range(prompt_len)
        ]
        request = Request(
            request_id=request_id,
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.requests[request_id] = request
        self.scheduler.add_request(request)
        return request

    def add_requests(self, count: int, *, prompt_len: int, max_tokens: int) -> list[Request]:
        return [self.add_request(prompt_len, max_tokens) for _ in range(count)]

    # ------------------------------------------------------------------ stepping

    def sampled_tokens(self, request: Request, num_drafts: int) -> list[int]:
        """The tokens the fake forward samples for ``request`` (its prompt is complete)."""
        return [SAMPLED_TOKEN]

    def fake_forward(self, scheduler_output: Any) -> ModelRunnerOutput:
        """Sampled tokens for every request whose prompt is complete after this step."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        sampled = []
        for req_id in req_ids:
            request = self.requests[req_id]
            # num_computed_tokens already includes this step's tokens (the scheduler
            # advances it in schedule()); a partial prefill chunk samples nothing.
            done_prefill = request.num_computed_tokens >= request.num_prompt_tokens
            sampled.append(self.sampled_tokens(request, len(drafts.get(req_id, ()))) if done_prefill else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self.worker.on_forward(scheduler_output) if self.worker else None,
        )

    def after_update(self, scheduler_output: Any) -> None:
        """Called once a step's output was applied (what the engine core does next)."""

    def _apply(self, scheduler_output: Any) -> None:
        outputs = self.scheduler.update_from_output(
            scheduler_output, self.fake_forward(scheduler_output)
        )
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.finish_reason is not None:
                    self.stats.finished.append(output.request_id)
        self.after_update(scheduler_output)

    def step(self) -> Any:
        """``schedule()``, then apply the oldest in-flight step's fake output."""
        scheduler_output = self.scheduler.schedule()
        self._in_flight.append(scheduler_output)
        running = len(self.scheduler.running)
        self.stats.steps += 1
        self.stats.running_per_step.append(running)
        self.stats.peak_running = max(self.stats.peak_running, running)
        self.stats.preemptions += len(scheduler_output.preempted_req_ids or ())
        if len(self._in_flight) >= self.in_flight_depth:
            self._apply(self._in_flight.popleft())
        return scheduler_output

    def drain(self) -> None:
        while self._in_flight:
            self._apply(self._in_flight.popleft())

    def run_to_completion(self, max_steps: int = 10_000) -> RunStats:
        while self.scheduler.has_requests():
            if self.stats.steps >= max_steps:
                raise AssertionError(
                    f"workload not finished after {max_steps} steps: "
                    f"{len(self.scheduler.running)} running, "
                    f"{len(self.scheduler.waiting)} waiting"
                )
            self.step()
            if not self.scheduler.has_requests():
                break
        self.drain()
        return self.stats

    # ------------------------------------------------------------------ connector

    @property
    def connector(self) -> Any:
        """Our connector; None without it."""
        from vllm_hisparse.vllm.connector import HiSparseResidencyConnector

        connector = self.scheduler.connector
        return connector if isinstance(connector, HiSparseResidencyConnector) else None

    @property
    def residency(self) -> Any:
        """Our connector's scheduler role; None without the connector."""
        return getattr(self.connector, "scheduler_role", None)

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
