"""Drive vLLM 0.33's REAL ``Scheduler`` / ``AsyncScheduler`` on CPU, for the tests.

The package's :class:`~vllm_hisparse.vllm.simulation.scheduler_driver.SchedulerDriver` (real
scheduler, fake forward) with what only the tests need: a DSA model planned by vLLM's own
planner (:meth:`SchedulerHarness.build`), the configurable :class:`FakeWorker`, our connector
found inside ``MultiConnector``, speculative decoding with a fake drafter, and the leak check.

Usage::

    harness = SchedulerHarness.build(model_dir, num_blocks=200)
    harness.add_requests(8, prompt_len=1000, max_tokens=50)
    stats = harness.run_to_completion()
    harness.assert_no_leaks()
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vllm.config import KVTransferConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.request import Request

from tests.vllm.fake_worker import FakeWorker
from vllm_hisparse.vllm.simulation.model import dsa_layer_specs, make_vllm_config
from vllm_hisparse.vllm.simulation.scheduler_driver import SchedulerDriver
from vllm_hisparse.vllm.simulation.spec import SAMPLED_TOKEN


def planned_worker_kv_cache_config(
    vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], num_blocks: int
) -> KVCacheConfig:
    """vLLM's own planning (grouping through the platform's builder) for ``num_blocks``:
    the per-layer form a worker gets (the simulator's ``plan_kv_cache``)."""
    from vllm_hisparse.vllm.simulation.scheduler_driver import plan_kv_cache

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


class SchedulerHarness(SchedulerDriver):
    """A real scheduler with a fake forward; counts running, preemptions, finishes."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, worker: FakeWorker | None = None
    ) -> None:
        # Speculative decoding: drafts proposed per decoding request after each step, and
        # how many of a request's scheduled drafts the fake forward accepts
        # (``accept(request, num_drafts) -> accepted``; default: all).
        spec = vllm_config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.accept: Callable[[Request, int], int] | None = None
        self.num_drafts = self.num_accepted = 0
        super().__init__(vllm_config, kv_cache_config, worker=worker)
        if self.worker is not None and self.worker.multi_index is None and self._multi_index() is not None:
            self.worker.multi_index = self._multi_index()

    def default_worker(self) -> FakeWorker:
        return FakeWorker()

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

    # ------------------------------------------------------------------ stepping

    def sampled_tokens(self, request: Request, num_drafts: int) -> list[int]:
        """One token, or the accepted drafts and the bonus token."""
        if not num_drafts:
            return [SAMPLED_TOKEN]
        accepted = self.accept(request, num_drafts) if self.accept else num_drafts
        assert 0 <= accepted <= num_drafts
        self.num_drafts += num_drafts
        self.num_accepted += accepted
        return [SAMPLED_TOKEN] * (accepted + 1)

    def after_update(self, scheduler_output: SchedulerOutput) -> None:
        if self.num_spec_tokens:
            # The fake drafter: k drafts for every request that just sampled, as the engine
            # core hands the drafter's output to update_draft_token_ids (synchronous).
            ids = [r for r in scheduler_output.num_scheduled_tokens
                   if r in self.scheduler.requests and not self.scheduler.requests[r].is_finished()]
            self.scheduler.update_draft_token_ids(
                DraftTokenIds(ids, [[SAMPLED_TOKEN] * self.num_spec_tokens for _ in ids]))

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

    # ------------------------------------------------------------------ checks

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
            assert residency.book.host_outstanding == 0
            assert not residency.book.hot_rows and not residency.book.non_full and not residency.book.freeing
