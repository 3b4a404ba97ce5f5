"""The simulator's step probe (what ``bench connector`` times through) and its unchecked mode:
hooks called per run, step and layer; KV written without a ground-truth store lands in the
slots vLLM assigns, so every row read through the conversion path (and the connector's host
tier) is still the row of its position; a probe can skip a step's attention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm_hisparse.vllm.simulation.engine import SimulationEngine, SimulationSpec  # noqa: E402
from vllm_hisparse.vllm.simulation.probe import StepProbe  # noqa: E402
from vllm_hisparse.worker.synthetic import kv_rows  # noqa: E402

# Enough pressure on 120 blocks that the connector demotes and reads host-backed rows.
SPEC = SimulationSpec(num_layers=2, layers_per_indexer=1, top_k=64, num_requests=6,
                      prompt_len=384, output_len=24, device_blocks=100,
                      max_num_batched_tokens=1024, check=False)


class Recorder(StepProbe):
    """Checks every row read against the unchecked writes (request 0's bytes of the
    selected position) and records the calls."""

    def __init__(self, skip_prefill: bool = False):
        self.skip_prefill = skip_prefill
        self.calls: list[str] = []
        self.rows_checked = 0
        self.decode_steps = 0
        self.busy_steps = 0

    def start_run(self, run):
        self.run = run
        self.calls.append(f"start {run.label} {len(run.bindings)}")

    def wants_attention(self, step):
        return step.decode_only or not self.skip_prefill

    def before_forward(self, step):
        self.calls.append("before")
        self.decode_steps += step.decode_only
        self.busy_steps += step.num_requests > 0
        self.topk = {name: impl.topk_indices_buffer
                     for name, impl in self.run.model.impls.items()}

    def after_layer(self, step, layer_name, rows, counts):
        self.calls.append("layer")
        _, layer, view, _ = self.run.model.layers[layer_name]
        topk = self.topk[layer_name][:step.num_tokens].to(torch.int64)
        valid = topk >= 0
        counts = counts[:step.num_tokens].to(torch.int64)
        assert torch.equal(counts, valid.sum(dim=1))
        # valid selections are at the front of each top-k row; the conversion keeps their order
        keep = torch.arange(topk.shape[1])[None, :] < counts[:, None]
        got = view.index_select(0, rows[:step.num_tokens].to(torch.int64)[keep])
        assert torch.equal(got, kv_rows(0, topk[keep], layer, view.shape[1])), step.step
        self.rows_checked += int(counts.sum())

    def after_forward(self, step):
        self.calls.append("after")

    def end_run(self):
        self.calls.append("end")


@pytest.mark.parametrize("with_connector,skip_prefill", [(False, False), (True, True)])
def test_unchecked_run_reads_the_rows_it_wrote_and_calls_every_hook(with_connector,
                                                                    skip_prefill):
    probe = Recorder(skip_prefill)
    engine = SimulationEngine(SPEC, probe=probe)
    try:
        result = engine.run(with_connector)
    finally:
        engine.close()
    assert result.rows_checked == 0  # no ground truth in this mode
    assert probe.rows_checked > 0
    expected_bindings = 2 if with_connector else 0
    assert probe.calls[0] == f"start {'with' if with_connector else 'without'} connector " \
                             f"{expected_bindings}"
    assert probe.calls[-1] == "end" and probe.calls.count("end") == 1
    assert probe.calls.count("before") == probe.calls.count("after") == result.steps
    attended = probe.decode_steps if skip_prefill else probe.busy_steps
    assert 0 < probe.decode_steps < probe.busy_steps
    assert probe.calls.count("layer") == 2 * attended
    if with_connector:
        assert result.misses > 0 and result.hot_hits > 0  # host-backed rows were read


class HotCountsProbe(StepProbe):
    """Notes whether the worker role counts per-request misses."""

    def start_run(self, run):
        self.counting = run.worker_role.hot_counts is not None


@pytest.mark.parametrize("count", [True, False])
def test_timing_runs_leave_the_per_request_miss_counters_off(count):
    """``count_request_misses=False`` (``bench throughput``'s runs) leaves the counters the
    connector itself runs only with ``adaptive_hot_region`` off: they would put a dozen small
    kernels into every timed step that an operator's step does not have."""
    import dataclasses

    probe = HotCountsProbe()
    spec = dataclasses.replace(SPEC, num_requests=2, output_len=4, count_request_misses=count)
    engine = SimulationEngine(spec, probe=probe)
    try:
        engine.run(True)
    finally:
        engine.close()
    assert probe.counting == count
