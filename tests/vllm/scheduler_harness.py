"""Drive vLLM 0.33's REAL ``Scheduler`` / ``AsyncScheduler`` on CPU.

Everything is vLLM's own (config, KV planning, ``KVCacheManager``, ``BlockPool``,
``Scheduler``); only the model forward is faked: each step returns a
``ModelRunnerOutput`` that samples one fixed token for every request whose prompt is
fully computed after the step. The KV cache config comes from vLLM's planner (so with
our connector configured it is our split), sized to a chosen number of blocks.

Usage::

    harness = SchedulerHarness.build(model_dir, num_blocks=200)
    harness.add_requests(8, prompt_len=1000, max_tokens=50)
    stats = harness.run_to_completion()
    harness.assert_no_leaks()
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm.config import KVTransferConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.vllm.dsa_specs import dsa_layer_specs
from tests.vllm.fake_worker import FakeWorker
from tests.vllm.vllm_configs import make_vllm_config
from vllm_hisparse.vllm.compat import scheduler_classes

#: Token every fake forward samples; far from any EOS id (requests end on max_tokens).
SAMPLED_TOKEN = 7


def planned_worker_kv_cache_config(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], num_blocks: int
) -> KVCacheConfig:
    """vLLM's own planning (grouping through the platform's builder) for ``num_blocks``:
    the per-layer form a worker gets (the simulator's ``plan_kv_cache``)."""
    from vllm_hisparse.vllm.simulation.engine import plan_kv_cache

    config = plan_kv_cache(vllm_config, specs, num_blocks)
    assert config.num_blocks == num_blocks
    return config


def planned_kv_cache_config(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], num_blocks: int
) -> KVCacheConfig:
    """The same plan in the form the engine core hands the scheduler (each group's spec
    collapsed to its first layer's spec), as EngineCore._initialize_kv_caches does."""
    return generate_scheduler_kv_cache_config(
        [planned_worker_kv_cache_config(vllm_config, specs, num_blocks)])


@dataclass
class RunStats:
    steps: int = 0
    peak_running: int = 0
    preemptions: int = 0
    finished: list[str] = field(default_factory=list)
    running_per_step: list[int] = field(default_factory=list)


class SchedulerHarness:
    """A real scheduler with a fake forward; counts running, preemptions, finishes."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, worker: FakeWorker | None = None
    ) -> None:
        scheduler_cls, async_scheduler_cls = scheduler_classes()
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        cls = async_scheduler_cls if async_scheduling else scheduler_cls
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.block_size = vllm_config.cache_config.block_size
        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(self.block_size, sha256)
        self.scheduler = cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            block_size=self.block_size,
            log_stats=True,
        )
        # The engine core keeps one batch in flight with async scheduling: step N+1 is
        # scheduled before step N's output is applied.
        self.in_flight_depth = 2 if async_scheduling else 1
        self._in_flight: deque[SchedulerOutput] = deque()
        self._ids = itertools.count()
        self.requests: dict[str, Request] = {}
        self.stats = RunStats()
        # Fake worker acks for our connector (None: no connector, or nobody acks).
        self.worker = worker
        # Speculative decoding: drafts proposed per decoding request after each step, and
        # how many of a request's scheduled drafts the fake forward accepts
        # (``accept(request, num_drafts) -> accepted``; default: all).
        spec = vllm_config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.accept: Callable[[Request, int], int] | None = None
        self.num_drafts = self.num_accepted = 0
        if worker is None and self.residency is not None:
            self.worker = FakeWorker()
        if self.worker is not None and self.worker.multi_index is None and self._multi_index() is not None:
            self.worker.multi_index = self._multi_index()

    @classmethod
    def build(
        cls,
        model_dir: Path,
        *,
        num_blocks: int,
        num_layers: int = 4,
        kv_transfer: KVTransferConfig | None = None,
        construct_connector: bool = True,
        worker: FakeWorker | None = None,
        num_draft_layers: int = 0,
        **config_kwargs,
    ) -> SchedulerHarness:
        """A harness over a ``num_layers`` DSA model with a ``num_blocks`` device pool.

        ``kv_transfer`` is seen by planning; with ``construct_connector=False`` the
        scheduler then runs without it, i.e. vLLM's stock managers over the same plan
        (the baseline for with/without-connector comparisons).
        """
        vllm_config = make_vllm_config(model_dir, kv_transfer=kv_transfer, **config_kwargs)
        specs = dsa_layer_specs(num_layers, block_size=vllm_config.cache_config.block_size,
                                num_draft_layers=num_draft_layers)
        kv_cache_config = planned_kv_cache_config(vllm_config, specs, num_blocks)
        if not construct_connector:
            vllm_config.kv_transfer_config = None
        return cls(vllm_config, kv_cache_config, worker=worker)

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

    def fake_forward(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One sampled token per request whose prompt is complete after this step."""
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for req_id in req_ids:
            request = self.requests[req_id]
            # num_computed_tokens already includes this step's tokens (the scheduler
            # advances it in schedule()); a partial prefill chunk samples nothing.
            done_prefill = request.num_computed_tokens >= request.num_prompt_tokens
            tokens = [SAMPLED_TOKEN] if done_prefill else []
            num_drafts = len(drafts.get(req_id, ()))
            if num_drafts and done_prefill:
                accepted = self.accept(request, num_drafts) if self.accept else num_drafts
                assert 0 <= accepted <= num_drafts
                self.num_drafts += num_drafts
                self.num_accepted += accepted
                tokens = [SAMPLED_TOKEN] * (accepted + 1)  # accepted drafts + the bonus token
            sampled.append(tokens)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=self.worker.on_forward(scheduler_output) if self.worker else None,
        )

    def _apply(self, scheduler_output: SchedulerOutput) -> None:
        outputs = self.scheduler.update_from_output(
            scheduler_output, self.fake_forward(scheduler_output)
        )
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.finish_reason is not None:
                    self.stats.finished.append(output.request_id)
        if self.num_spec_tokens:
            # The fake drafter: k drafts for every request that just sampled, as the engine
            # core hands the drafter's output to update_draft_token_ids (synchronous).
            ids = [r for r in scheduler_output.num_scheduled_tokens
                   if r in self.scheduler.requests and not self.scheduler.requests[r].is_finished()]
            self.scheduler.update_draft_token_ids(
                DraftTokenIds(ids, [[SAMPLED_TOKEN] * self.num_spec_tokens for _ in ids]))

    def step(self) -> SchedulerOutput:
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

    def _multi_index(self) -> int | None:
        """Our connector's position among MultiConnector children, if composed."""
        connector = self.scheduler.connector
        children = getattr(connector, "_connectors", None)
        if children is None:
            return None
        from vllm_hisparse.vllm.connector import HiSparseResidencyConnector

        for i, child in enumerate(children):
            if isinstance(child, HiSparseResidencyConnector):
                return i
        return None

    @property
    def connector(self):
        """Our connector (alone or inside MultiConnector); None without it."""
        connector = self.scheduler.connector
        if connector is None:
            return None
        index = self._multi_index()
        return connector._connectors[index] if index is not None else connector

    @property
    def residency(self):
        """Our connector's scheduler role; None without the connector."""
        connector = self.connector
        return getattr(connector, "scheduler_role", None)

    # ------------------------------------------------------------------ checks

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def assert_no_leaks(self) -> None:
        """No requests left; every device block except the null block is free."""
        assert not self.scheduler.requests, sorted(self.scheduler.requests)
        assert not self.scheduler.running and not self.scheduler.waiting
        pool = self.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == self.kv_cache_config.num_blocks - 1
        assert all(block.ref_cnt == 0 for block in pool.blocks if not block.is_null)
        residency = self.residency
        if residency is not None:
            # Host pool back to its initial state, no transfer or lease left open.
            assert residency.is_idle(), (residency.policy.num_requests, residency.policy.num_open_transfers)
            host = residency.host_pool
            assert (host.ref_counts == 0).all()
            assert host.num_free_blocks + host.num_cached_blocks == host.num_blocks
            assert residency._host_outstanding == 0
            assert not residency._hot_rows and not residency._non_full and not residency._freeing
