"""The step view's token rows: one launch per forward, shared by the forward's index groups,
and recomputed whenever the forward may have changed (each case here fails if its rule goes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.vllm.test_attention_hook import BS, S, setup
from vllm_hisparse import ops
from vllm_hisparse.ops import reference
from vllm_hisparse.vllm.worker_side.read_path import convert_with_residency
from vllm_hisparse.vllm.worker_side.step_view import StepView

OPS = ops.select("reference")


@pytest.fixture
def launches(monkeypatch):
    """The number of token_state_rows launches (the reference twin, counted)."""
    count = [0]
    original = reference.token_state_rows

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(reference, "token_state_rows", counted)
    return count


def groups(n):
    return [SimpleNamespace(name=f"group {i}") for i in range(n)]


def rows_of(step, req, group, num_actual_tokens=None):
    return step.token_state_rows(req, num_actual_tokens, OPS, consumer=group).tolist()


def test_one_launch_serves_every_index_group_of_a_forward(launches):
    step = StepView(4, "cpu")
    step.begin(0, [2, -1, 0])
    req = torch.tensor([0, 1, 2, 2], dtype=torch.int32)
    got = [rows_of(step, req, g) for g in groups(5)]
    assert launches[0] == 1
    assert got == [[2, -1, 0, 0]] * 5


def test_an_index_group_asking_again_starts_the_next_forward(launches):
    """Same buffer, new contents, no step boundary (a capture's warm-up, a dummy run)."""
    step = StepView(4, "cpu")
    step.begin(0, [2, -1, 0])
    req = torch.tensor([0, 1, 2], dtype=torch.int32)
    a, b = groups(2)
    assert rows_of(step, req, a) == [2, -1, 0]
    req.copy_(torch.tensor([2, 2, 1], dtype=torch.int32))  # the next forward's batch rows
    assert rows_of(step, req, a) == [0, 0, -1]
    assert rows_of(step, req, b) == [0, 0, -1]
    assert launches[0] == 2


def test_a_new_step_drops_the_last_forwards_rows(launches):
    step = StepView(4, "cpu")
    req = torch.tensor([0, 1], dtype=torch.int32)
    a, b = groups(2)
    step.begin(0, [3, -1])
    assert rows_of(step, req, a) == [3, -1]
    step.begin(1, [-1, 1])  # group b is the first to convert in this step
    assert rows_of(step, req, b) == [-1, 1]
    step.end()
    assert rows_of(step, req, a) == [-1, -1]  # inert after the step
    assert launches[0] == 3


def test_a_new_forward_context_drops_the_last_forwards_rows(launches):
    """A draft model's forward inside the step: another forward context, same buffers."""
    contexts = iter([object(), object()])
    current = [next(contexts)]
    step = StepView(4, "cpu", current_forward=lambda: current[0])
    step.begin(0, [2, 1, 0])
    req = torch.tensor([0, 0, 1], dtype=torch.int32)
    target, draft = groups(2)
    assert rows_of(step, req, target) == [2, 2, 1]
    current[0] = next(contexts)
    req.copy_(torch.tensor([2, 1, 0], dtype=torch.int32))
    assert rows_of(step, req, draft) == [0, 1, 2]
    assert launches[0] == 2


def test_different_inputs_and_limits_are_not_shared(launches):
    step = StepView(4, "cpu")
    step.begin(0, [1, 2, 3])
    req = torch.tensor([0, 1, 2], dtype=torch.int32)
    a, b, c, d = groups(4)
    assert rows_of(step, req, a) == [1, 2, 3]
    assert rows_of(step, req[1:], b) == [2, 3]  # another slice of the same buffer
    assert rows_of(step, req, c, num_actual_tokens=2) == [1, 2, -1]
    assert rows_of(step, req.long(), d) == [1, 2, 3]
    assert step.token_state_rows(req, None, OPS).tolist() == [1, 2, 3]  # no consumer
    assert launches[0] == 5


def test_convert_with_residency_launches_token_rows_once_per_forward(launches):
    """Two index groups (one per layer, as in DeepSeek-V3.2) over one step view: the second
    group's rows equal those it gets alone, with no launch of its own."""
    state, first, step, _ = setup()
    _, second, _, _ = setup()
    second.step = step
    step.begin(0, [-1, 1])
    topk = torch.tensor([[1, 2, 3, 0], [6, 1, 2, -1]], dtype=torch.int32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    table = (torch.tensor([[9, 9], [0, 0]], dtype=torch.int32), BS)
    kw = dict(block_stride_rows=S, return_valid_counts=False, vllm_table=table)
    shared = [convert_with_residency(b, 0, topk, req, 2, None, **kw) for b in (first, second)]
    assert launches[0] == 1
    _, alone, alone_step, _ = setup()
    alone_step.begin(0, [-1, 1])
    assert shared[1].tolist() == convert_with_residency(alone, 0, topk, req, 2, None,
                                                        **kw).tolist()
    assert first.leader_rows(2)[1] is second.leader_rows(2)[1]


def test_a_capture_holds_its_own_launch(launches, monkeypatch):
    """A graph captured after an eager forward: its first converting group must launch inside
    the capture (its replays serve later steps), even a group the eager forward did not see."""
    from vllm_hisparse.vllm.worker_side import step_view

    step = StepView(4, "cpu")
    req = torch.tensor([0, 1], dtype=torch.int32)
    a, b = groups(2)
    rows_of(step, req, a)
    monkeypatch.setattr(step_view, "capturing", lambda: True)
    rows_of(step, req, b)
    rows_of(step, req, a)  # the same capture: shared
    assert launches[0] == 2
    monkeypatch.setattr(step_view, "capturing", lambda: False)
    rows_of(step, req, b)  # eager again after the capture
    assert launches[0] == 3
