"""The real model's decode step from runs at two simulated layer counts (``bench throughput
--sim-layers N M``).

A step is ``per_step + L × per_layer``: the layers' work, and what runs once per step whatever
the layer count (the model runner's input copies, ``start_load_kv``'s page-table writes, the
launches of the mirror and of the spills). Scaling one run by ``num_layers / N`` multiplies
the per-step part too, which overstates it ``num_layers / N`` times; two runs separate the
two parts, and the line through them gives the step at ``num_layers``.

The fit is of the medians. Its range is the interval the line can take with each run
anywhere in its own range: at ``L`` past both counts the line's weights are ``w_N = (M - L) /
(M - N)`` (negative) and ``w_M = (L - N) / (M - N)``, so the slowest fitted step pairs the
fastest ``N`` step with the slowest ``M`` step, and the reverse for the fastest (a bound,
wider than either run's range).
"""

from __future__ import annotations


def fit_step(first: dict, second: dict, layers: tuple[int, int], num_layers: int,
             batch: int) -> dict:
    """The fitted step of the ``num_layers``-layer model at ``batch`` requests.

    Args:
        first, second: ``throughput_probe.summarize`` of one system at one batch, at the
            simulated layer counts ``layers[0] < layers[1]`` (``step_ms_median``,
            ``step_ms_min``, ``step_ms_max``: ms per simulated step).
        layers: the two simulated layer counts.
        num_layers: the real model's layers.
        batch: requests (one token each) of the step.

    Returns:
        ``step_ms`` (the fitted step), ``per_step_ms`` and ``per_layer_ms`` (its parts),
        ``tokens_per_s`` and ``tokens_per_s_range`` ([slowest, fastest]).
    """
    n, m = layers
    if not 0 < n < m:
        raise ValueError(f"fit_step: layer counts must be 0 < N < M, got {layers}")
    w_n, w_m = (m - num_layers) / (m - n), (num_layers - n) / (m - n)

    def line(a: float, b: float) -> float:
        return w_n * a + w_m * b

    step = line(first["step_ms_median"], second["step_ms_median"])
    per_layer = (second["step_ms_median"] - first["step_ms_median"]) / (m - n)
    low, high = (first["step_ms_max"], second["step_ms_min"]), (first["step_ms_min"],
                                                                 second["step_ms_max"])
    if w_n > 0:  # num_layers between the counts: both weights positive
        low, high = (first["step_ms_min"], second["step_ms_min"]), (first["step_ms_max"],
                                                                    second["step_ms_max"])
    fastest, slowest = line(*low), line(*high)
    if step <= 0 or fastest <= 0:
        raise ValueError(f"fit_step: the line through {n} layers ({first['step_ms_median']:.3f} "
                         f"ms) and {m} layers ({second['step_ms_median']:.3f} ms) gives a step "
                         f"of {min(step, fastest):.3f} ms at {num_layers} layers")
    return dict(step_ms=step, per_step_ms=first["step_ms_median"] - n * per_layer,
                per_layer_ms=per_layer, tokens_per_s=batch / (step / 1e3),
                tokens_per_s_range=[batch / (slowest / 1e3), batch / (fastest / 1e3)])
