"""Which host pool layout a model geometry wants (issue [16]; docs/worker.md "Host pool layouts").

A layer that runs its own indexer learns its misses only after that indexer ran, so its gather
is on the decode step's critical path and reads one layer's rows. Those rows read fastest when
they lie in as little host memory as possible (the translation reach: ``bench kernels --only
reach``, docs/benchmarks.md): a **layer-major** pool keeps them in one slab. With IndexShare a
leader's top-k serves its followers too, so one gather reads a position's rows of several
layers, which a **position-major** pool keeps adjacent (one translation page per position).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

#: Accepted values of the ``host_layout`` key; ``"auto"`` decides with :func:`choose_host_layout`.
HOST_LAYOUT_CHOICES = ("auto", "position", "layer")
#: Largest index group (leader + followers) for which ``auto`` picks layer-major: a gather of
#: 2 layers still reads one layer's rows per slab, and no geometry we serve has groups of 2
#: (DeepSeek-V3.2, GLM-5.1: 1; GLM-5.2/5.3 IndexShare: 3-4).
LAYER_MAJOR_MAX_GROUP_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class HostLayoutChoice:
    """The pool layout (``"position"`` | ``"layer"``) and why, for the startup log."""

    layout: str
    reason: str


def choose_host_layout(requested: str, group_layers: Sequence[int], slab_bytes: int
                       ) -> HostLayoutChoice:
    """The host pool layout for a model whose index groups have ``group_layers`` layers each.

    Args:
        requested: the ``host_layout`` key, one of :data:`HOST_LAYOUT_CHOICES`.
        group_layers: layers per index group (a leader and its IndexShare followers), every
            group of every sparse KV cache group; non-empty, each >= 1.
        slab_bytes: one layer's host rows (``host_rows * row_bytes``): the span a layer-major
            gather of one layer touches at most.

    Returns ``auto``'s pick (layer-major when the largest group has at most
    :data:`LAYER_MAJOR_MAX_GROUP_LAYERS` layers, else position-major) or the requested layout,
    with the reason.
    """
    if requested not in HOST_LAYOUT_CHOICES:
        raise ValueError(f"host_layout={requested!r} is invalid; accepted: "
                         f"{' | '.join(HOST_LAYOUT_CHOICES)}")
    sizes = list(group_layers)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"group_layers must be non-empty positive layer counts, got {sizes}")
    largest = max(sizes)
    slab = f"{slab_bytes / 2**30:.2f} GiB"
    if requested != "auto":
        return HostLayoutChoice(requested, f"{requested}-major: host_layout={requested!r} "
                                           f"requested (index groups of up to {largest} layers)")
    if largest <= LAYER_MAJOR_MAX_GROUP_LAYERS:
        what = ("an indexer in every layer" if largest == 1 else
                f"index groups of at most {largest} layers")
        return HostLayoutChoice("layer", f"layer-major: {what}, so one gather reads one "
                                         f"layer's rows, which lie in one slab of {slab}")
    return HostLayoutChoice("position", f"position-major: IndexShare groups of up to {largest} "
                                        f"layers gather a position's rows of several layers "
                                        f"together, which lie adjacent")
