"""The stream a leader layer's residency conversion runs on: its vLLM index group's side
stream, where vLLM runs its own conversion.

vLLM 0.33 converts an index group's top-k on the group's side stream
(``SparseMLAIndexGroup._convert_once``, ``index_group.py:140-163``). The side stream starts at
the group's ``logical_topk_ready`` event, which the model records right after the indexer
(``mla.py:235``, ``deepseek_v32/attention.py:520``), and the compute stream waits for the
result at the conversion call, in ``forward_mqa``. In between, the compute stream writes the
layer's new KV and runs the absorbed query projection, so vLLM's conversion runs alongside
that work and costs the layer nothing of its own. When the group has no indexer, or under
piecewise graphs (where the event is graph-local), the side stream waits on the compute
stream instead, with nothing to overlap.

The residency path replaces that conversion, so it runs where vLLM's ran. The leader's token
rows, resolve, leader-layer gather and merge go on the same side stream, from the same start
point. The compute stream waits on one event at the end. The followers' gathers fork from
this stream: ``GroupGather`` forks from the current stream, which this makes the side stream.

The switch to the side stream goes through ``torch.cuda.stream``, which calls
``torch.cuda.set_stream`` on entry and exit. vLLM wraps that function to track the current
stream (``vllm.utils.torch_utils.current_stream``, on which its model records the next
indexer's ``logical_topk_ready``). A stream's own context (``with stream:``) switches in C++,
which vLLM does not see. ``GroupGather`` opens a ``torch.cuda.stream`` of its own inside the
body (under a capture), and its exit would leave vLLM's tracker on this side stream. The next
index group's ready event would then be recorded there, and that group's conversion would not
wait for its indexer. That happened to GLM-5.2 IndexShare: its second group resolved the
previous step's top-k in every replay (docs/benchmarks.md, "The stale top-k").
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator

import torch


class ConversionStream:
    """vLLM's side stream of one index group, with the point it starts from.

    Args:
        stream: the group's side stream (``SparseMLAIndexGroup.side_stream``, a CUDA
            ``torch.Stream``).
        topk_ready: returns the event to start from (the group's ``logical_topk_ready``,
            recorded after the indexer), or None to start after the compute stream's work so
            far. It is called at every conversion, because the answer changes with the
            forward's graph mode (``compat.index_group_conversion_stream``).
        device: the CUDA device of the stream.
        compute_stream: returns the current (compute) stream; default
            ``torch.cuda.current_stream(device)`` (tests without a GPU pass their own).
        done: the event the compute stream waits on; default a new ``torch.Event``.
        stream_context: makes a stream current for a ``with`` block; default
            ``torch.cuda.stream``, which keeps vLLM's tracked current stream right (module
            docstring). Tests without a GPU pass their own.
    """

    def __init__(self, stream: Any, topk_ready: Callable[[], Any | None],
                 device: torch.device | str, *,
                 compute_stream: Callable[[], Any] | None = None, done: Any = None,
                 stream_context: Callable[[Any], ContextManager] | None = None):
        self.stream = stream
        self._topk_ready = topk_ready
        self.device = torch.device(device)
        self._compute_stream = compute_stream or (
            lambda: torch.cuda.current_stream(self.device))
        self._done = torch.Event(device=self.device) if done is None else done
        self._stream_context = stream_context or (lambda s: torch.cuda.stream(s))
        #: Conversions run here so far (tests and benchmarks).
        self.conversions = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Run the body on the side stream, after the group's top-k is ready. On exit, even
        after an error, the compute stream (current on entry) waits for everything the body
        queued. It waits on an event, so the host never syncs and a CUDA graph capture
        joins the side stream back."""
        compute = self._compute_stream()
        ready = self._topk_ready()
        if ready is not None:
            self.stream.wait_event(ready)
        else:
            self.stream.wait_stream(compute)
        try:
            with self._stream_context(self.stream):
                yield
        finally:
            self._done.record(self.stream)
            compute.wait_event(self._done)
            self.conversions += 1
