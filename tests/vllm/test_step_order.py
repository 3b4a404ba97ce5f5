"""The worker applies each step's command before that step's forward, under vLLM's own glue.

vLLM 0.33's Model Runner V2 (``v1/worker/gpu/kv_connector.py``, ``ActiveKVConnector``)
calls the connector's ``start_load_kv`` in ``pre_forward`` only when
``scheduler_output.has_sync_kv_loads`` is set, and otherwise in ``post_forward``, after the
forward. Our worker role must run before the forward (restores, tables, the attention
hook's step), so the scheduler role sets the flag on every step that runs a forward. Under
``MultiConnector`` the flag is on the one ``SchedulerOutput`` all children see: the siblings'
``start_load_kv`` (NixlConnector posting its reads) moves before the forward too.

These tests drive vLLM's real ``Scheduler`` / ``AsyncScheduler`` with the connector (alone
and as a MultiConnector child next to NixlConnector) and feed each step's real
``SchedulerOutput`` to vLLM's real ``ActiveKVConnector.pre_forward`` / ``post_forward``,
recording when ``start_load_kv`` runs relative to the forward.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

from tests.vllm.scheduler_harness import SchedulerHarness
from vllm_hisparse.vllm.simulation.model import CONNECTOR, kv_transfer_config


class _Recorder:
    """Stands in for the worker-side connector behind vLLM's glue; logs the call order."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def handle_preemptions(self, metadata) -> None:
        pass

    def bind_connector_metadata(self, metadata) -> None:
        pass

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.log.append("start_load_kv" if kwargs else "start_load_kv(no forward)")

    def finish_forward(self) -> None:
        pass

    def wait_for_save(self) -> None:
        self.log.append("wait_for_save")

    def get_transfer_results(self, finished):
        return SimpleNamespace(finished_sending=set(), finished_recving=set(), failed_recving=set())

    def get_block_ids_with_load_errors(self):
        return set()

    def get_kv_connector_stats(self):
        return None

    def get_kv_connector_kv_cache_events(self):
        return None

    def build_connector_worker_meta(self):
        return None

    def clear_connector_metadata(self) -> None:
        pass


def _glue(vllm_config, log):
    glue = object.__new__(ActiveKVConnector)  # its __init__ needs a live transfer group
    glue.vllm_config = vllm_config
    glue.kv_connector = _Recorder(log)
    glue._pending_load_kwargs = None
    glue._disabled = False
    return glue


def _nixl_composition() -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector", kv_role="kv_consumer",
        kv_connector_extra_config={"connectors": [
            {"kv_connector": CONNECTOR, "kv_role": "kv_consumer",
             "kv_connector_extra_config": {"host_pool_gib": 1}},
            {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"},
        ]})


def _run_through_glue(harness: SchedulerHarness, steps: int) -> list[list[str]]:
    """Each scheduled step through vLLM's pre_forward → forward → post_forward."""
    per_step = []
    harness.add_requests(3, prompt_len=200, max_tokens=6)
    real_forward = harness.fake_forward

    def forward(scheduler_output):
        log: list[str] = []
        glue = _glue(harness.vllm_config, log)
        if scheduler_output.total_num_scheduled_tokens:
            ids = list(scheduler_output.num_scheduled_tokens)
            batch = SimpleNamespace(idx_mapping=None, req_ids=ids,
                                    num_tokens=scheduler_output.total_num_scheduled_tokens)
            glue.pre_forward(scheduler_output, batch)
            log.append("forward")
            glue.post_forward(set())
        else:
            glue.no_forward(scheduler_output)
        per_step.append(log)
        return real_forward(scheduler_output)

    harness.fake_forward = forward
    for _ in range(steps):
        harness.step()
    harness.drain()
    return per_step


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("compose", ["alone", "nixl"])
def test_start_load_kv_runs_before_every_forward(small_topk_model_dir, async_scheduling, compose):
    kv = kv_transfer_config({"host_pool_gib": 1}) if compose == "alone" else _nixl_composition()
    harness = SchedulerHarness.build(small_topk_model_dir, num_blocks=400, kv_transfer=kv,
                                     max_model_len=2048, async_scheduling=async_scheduling)
    per_step = _run_through_glue(harness, steps=12)
    with_forward = [log for log in per_step if "forward" in log]
    assert len(with_forward) >= 6
    assert all(log == ["start_load_kv", "forward", "wait_for_save"] for log in with_forward), per_step


def test_without_the_flag_vllm_loads_after_the_forward(small_topk_model_dir):
    """The same steps with the flag cleared again after our build_connector_meta: vLLM's glue
    then starts the load after the forward (what the worker role must never see)."""
    harness = SchedulerHarness.build(small_topk_model_dir, num_blocks=400,
                                     kv_transfer=kv_transfer_config({"host_pool_gib": 1}),
                                     max_model_len=2048)
    connector = harness.connector
    real = connector.build_connector_meta

    def cleared(scheduler_output):
        meta = real(scheduler_output)
        scheduler_output.has_sync_kv_loads = False
        return meta

    connector.build_connector_meta = cleared
    per_step = _run_through_glue(harness, steps=4)
    assert ["forward", "start_load_kv", "wait_for_save"] in per_step
