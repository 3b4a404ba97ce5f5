"""The real model's decode step from the simulated one (``bench throughput``).

A simulated step runs ``N`` of the model's layers. Its two times grow differently with the
layer count:

* **GPU time** is ``per_step + L × per_layer``: the layers' work, and what runs once per step
  whatever the layer count (the model runner's input copies, ``start_load_kv``'s page-table
  writes, the launches of the mirror and the spills). One run scales it by ``num_layers /
  N``, which also counts the per-step part ``num_layers / N`` times; two runs (``--sim-layers
  N M``) separate the parts, and the line through them gives the GPU time at ``num_layers``.
* **Host time** (the connector's issue time around the replayed graph) has no per-layer part
  under full CUDA graphs: the forward's Python does not run in a replay, and
  ``start_load_kv`` / ``wait_for_save`` work per KV cache group (lane) and per page. It is
  scaled by the lanes, ``host_scale`` = the real plan's sparse groups over the simulated
  plan's (vLLM's planner gives GLM-5.1 5 at 78 layers, 4 at 8 or 16); with two runs the line
  through their host times is taken first (its slope says whether the assumption held).

The step is the larger of the two, as a step of the simulated run is (the host issues the
next step while the GPU runs this one). Figures are of the medians; a range bounds every
line through the runs' own ranges: at ``L`` past both counts the line's weights are ``w_N =
(M - L) / (M - N)`` (negative) and ``w_M = (L - N) / (M - N)``, so the slowest line pairs the
fastest ``N`` time with the slowest ``M`` time, and the reverse for the fastest (a bound,
wider than either run's range).

Summaries written before the GPU and host ranges were kept (no ``gpu_ms_min``) are read as
they were computed then: the step's own median and range, scaled.
"""

from __future__ import annotations


def _line(first: float, second: float, layers: tuple[int, int], num_layers: int) -> float:
    n, m = layers
    return ((m - num_layers) * first + (num_layers - n) * second) / (m - n)


def _fitted(first: dict, second: dict, name: str, layers: tuple[int, int],
            num_layers: int) -> tuple[float, float, float, float]:
    """(time at num_layers, per layer, fastest, slowest) of the ``name`` times (``gpu`` or
    ``host``: ``{name}_ms_median / _min / _max``) through the two runs."""
    median = _line(first[f"{name}_ms_median"], second[f"{name}_ms_median"], layers, num_layers)
    per_layer = ((second[f"{name}_ms_median"] - first[f"{name}_ms_median"])
                 / (layers[1] - layers[0]))
    lo, hi = f"{name}_ms_min", f"{name}_ms_max"
    if num_layers <= layers[1]:  # between the counts (or at M): both weights >= 0
        fastest = _line(first[lo], second[lo], layers, num_layers)
        slowest = _line(first[hi], second[hi], layers, num_layers)
    else:
        fastest = _line(first[hi], second[lo], layers, num_layers)
        slowest = _line(first[lo], second[hi], layers, num_layers)
    return median, per_layer, fastest, slowest


def real_step(first: dict, batch: int, *, scale: float, host_scale: float = 1.0,
              second: dict | None = None, layers: tuple[int, int] | None = None,
              num_layers: int | None = None) -> dict:
    """The step of the ``num_layers``-layer model at ``batch`` requests (one token each).

    Args:
        first: ``throughput_probe.summarize`` of one system at one batch, ``layers[0]``
            simulated layers (ms per simulated step: ``gpu_ms_median / _min / _max``,
            ``host_ms_*``, and ``step_ms_*`` for summaries without the former).
        batch: requests of the step.
        scale: ``num_layers / layers[0]``, the GPU time's scale without a second run.
        host_scale: the host time's scale (lanes of the real plan over the simulated one's).
        second, layers, num_layers: the same system and batch at ``layers[1]`` simulated
            layers, for the fit (all three, or none).

    Returns:
        ``step_ms``, ``gpu_ms``, ``host_ms`` (the real model's), ``tokens_per_s``,
        ``tokens_per_s_range`` ([slowest, fastest]); with a fit also ``per_step_ms`` and
        ``per_layer_ms`` (the GPU time's parts) and ``host_per_layer_ms``.

    Raises:
        ValueError: bad layer counts, or a fitted time at or below zero (noise larger than
            the layers' time).
    """
    if "gpu_ms_min" not in first:  # an older summary: the step as it was scaled then
        step = first["step_ms_median"] * scale
        return dict(step_ms=step, gpu_ms=step, host_ms=first["host_ms_median"],
                    tokens_per_s=batch / (step / 1e3),
                    tokens_per_s_range=[batch / (first["step_ms_max"] * scale / 1e3),
                                        batch / (first["step_ms_min"] * scale / 1e3)])
    out = {}
    if second is None:
        gpu = [first[f"gpu_ms_{k}"] * scale for k in ("median", "min", "max")]
        host = [first[f"host_ms_{k}"] * host_scale for k in ("median", "min", "max")]
    else:
        n, m = layers
        if not 0 < n < m:
            raise ValueError(f"real_step: layer counts must be 0 < N < M, got {layers}")
        g, g_layer, g_fast, g_slow = _fitted(first, second, "gpu", layers, num_layers)
        h, h_layer, h_fast, h_slow = _fitted(first, second, "host", layers, num_layers)
        if min(g, g_fast) <= 0:
            raise ValueError(
                f"real_step: the line through {n} layers ({first['gpu_ms_median']:.3f} ms) and "
                f"{m} layers ({second['gpu_ms_median']:.3f} ms) gives a GPU time of "
                f"{min(g, g_fast):.3f} ms at {num_layers} layers")
        gpu = [g, g_fast, g_slow]
        host = [max(0.0, t) * host_scale for t in (h, h_fast, h_slow)]
        out.update(per_step_ms=first["gpu_ms_median"] - n * g_layer, per_layer_ms=g_layer,
                   host_per_layer_ms=h_layer)
    step, fastest, slowest = (max(a, b) for a, b in zip(gpu, host))
    out.update(step_ms=step, gpu_ms=gpu[0], host_ms=host[0], tokens_per_s=batch / (step / 1e3),
               tokens_per_s_range=[batch / (slowest / 1e3), batch / (fastest / 1e3)])
    return out
