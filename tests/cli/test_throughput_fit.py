"""``bench throughput``'s real step: GPU time scaled by the layers (or fitted through two
layer counts), host time by the lanes, the step the larger of the two."""

import json

import pytest

from vllm_hisparse.cli.benchmarks import throughput, throughput_report
from vllm_hisparse.cli.benchmarks.throughput_fit import real_step


def summary(gpu, host=0.5, spread=0.0, batch=10):
    """A summarize() record: GPU and host medians, each with +- ``spread`` ms around it."""
    out = dict(timed_steps=3, host_waited=0)
    for name, t in (("gpu", gpu), ("host", host)):
        out.update({f"{name}_ms_median": t, f"{name}_ms_min": t - spread,
                    f"{name}_ms_max": t + spread})
    step = max(gpu, host)
    out.update(step_ms_median=step, step_ms_min=step - spread, step_ms_max=step + spread,
               tokens_per_s=batch / (step / 1e3),
               tokens_per_s_range=[batch / ((step + spread) / 1e3),
                                   batch / ((step - spread) / 1e3)])
    return out


def fitted(first, second, num_layers=78, batch=20, host_scale=1.0):
    return real_step(first, batch, scale=num_layers / 8, host_scale=host_scale, second=second,
                     layers=(8, 16), num_layers=num_layers)


def test_the_fit_separates_the_per_step_part_from_the_layers():
    # 1 ms per step + 0.5 ms per layer: 5 ms at 8 layers, 9 at 16, 40 at 78
    f = fitted(summary(5.0), summary(9.0))
    assert f["per_step_ms"] == pytest.approx(1.0) and f["per_layer_ms"] == pytest.approx(0.5)
    assert f["step_ms"] == pytest.approx(40.0) and f["gpu_ms"] == pytest.approx(40.0)
    assert f["tokens_per_s"] == pytest.approx(20 / 0.040)
    # scaling the 8-layer step says 48.75 ms: the per-step ms counted 78 / 8 times
    scaled = real_step(summary(5.0), 20, scale=78 / 8)
    assert scaled["step_ms"] == pytest.approx(48.75)


def test_host_time_follows_the_lanes_not_the_layers():
    """A host-bound simulated step (host 6 ms against GPU 5) is GPU-bound at 78 layers: its
    host time grows with the lanes (5 / 4), not 78 / 8 times."""
    s = summary(5.0, host=6.0)
    real = real_step(s, 20, scale=78 / 8, host_scale=5 / 4)
    assert real["host_ms"] == pytest.approx(7.5) and real["step_ms"] == pytest.approx(48.75)
    # a host slower than the scaled GPU decides the step
    slow = real_step(summary(1.0, host=20.0), 20, scale=78 / 8, host_scale=5 / 4)
    assert slow["step_ms"] == pytest.approx(25.0)
    # with a fit the host line is taken too, then the lanes
    f = fitted(summary(1.0, host=20.0), summary(1.5, host=20.0), host_scale=5 / 4)
    assert f["host_per_layer_ms"] == pytest.approx(0.0) and f["step_ms"] == pytest.approx(25.0)


def test_the_range_bounds_every_line_through_the_two_ranges():
    first, second = summary(5.0, spread=0.1), summary(9.0, spread=0.2)
    f = fitted(first, second)
    slowest, fastest = (20e3 / t for t in f["tokens_per_s_range"])
    lines = [fitted(summary(a), summary(b))["step_ms"]
             for a in (4.9, 5.0, 5.1) for b in (8.8, 9.0, 9.2)]
    assert fastest == pytest.approx(min(lines)) and slowest == pytest.approx(max(lines))
    assert fastest < f["step_ms"] < slowest
    # between the two counts both weights are positive: the bound pairs like with like
    mid = fitted(first, second, num_layers=12)
    slowest, fastest = (20e3 / t for t in mid["tokens_per_s_range"])
    assert fastest == pytest.approx((4.9 + 8.8) / 2) and slowest == pytest.approx((5.1 + 9.2) / 2)


def test_the_fit_refuses_bad_counts_and_a_line_below_zero():
    with pytest.raises(ValueError, match="0 < N < M"):
        real_step(summary(5.0), 20, scale=1, second=summary(9.0), layers=(16, 8), num_layers=78)
    with pytest.raises(ValueError, match="gives a GPU time of"):
        fitted(summary(9.0), summary(5.0))  # shorter with more layers


def test_a_summary_without_gpu_and_host_ranges_is_read_as_it_was_scaled():
    """Results written before the ranges were kept: the step's own median, scaled."""
    old = {k: v for k, v in summary(5.0, host=6.0, spread=0.1).items()
           if not k.startswith(("gpu_ms_", "host_ms_m"))}
    old.update(gpu_ms_median=5.0, host_ms_median=6.0)
    real = real_step(old, 20, scale=78 / 8, host_scale=5 / 4)
    assert real["step_ms"] == pytest.approx(6.0 * 78 / 8)
    assert real["tokens_per_s_range"][0] == pytest.approx(20 / (6.1 * 78 / 8 / 1e3))


def case_with_fit():
    """A case as run_case stores it, 8 and 16 layers: full at 4 requests, hybrid at 8 and 4."""
    def points(full_ms, hybrid_ms):
        return dict(full={"points": {"4": {"full": summary(full_ms, batch=4)}}},
                    hybrid={"points": {str(c): dict(hybrid=summary(ms, batch=c),
                                                    oracle=summary(0.9 * ms, batch=c))
                                       for c, ms in hybrid_ms.items()}})

    runs = points(5.0, {8: 6.0, 4: 5.5})
    fit_runs = points(9.0, {8: 11.0})  # the second run never reached 4 hybrid requests
    return dict(shape=dict(num_layers=78, name="m"), full_requests=4, hybrid_requests=8,
                scale=78 / 8, host_scale=1.25, sim_layers=8, runs=runs,
                fit=dict(sim_layers=16, runs=fit_runs))


def test_curve_uses_the_fit_where_both_counts_have_the_point():
    rows = {r["concurrency"]: r for r in throughput_report.curve(case_with_fit())}
    top = rows[8]
    full = fitted(summary(5.0, batch=4), summary(9.0, batch=4), batch=4, host_scale=1.25)
    hybrid = fitted(summary(6.0, batch=8), summary(11.0, batch=8), batch=8, host_scale=1.25)
    assert top["full"]["real_step_ms"] == pytest.approx(full["step_ms"])
    assert top["hybrid"]["per_layer_ms"] == pytest.approx(hybrid["per_layer_ms"])
    assert top["hybrid_over_full"] == pytest.approx(hybrid["tokens_per_s"] / full["tokens_per_s"])
    # a point only the first count has: scaled, no parts
    assert rows[4]["hybrid"]["real_step_ms"] == pytest.approx(5.5 * 78 / 8)
    assert "per_layer_ms" not in rows[4]["hybrid"]
    # a line that falls below zero at the real count is said, and the step scaled
    broken = case_with_fit()
    broken["fit"]["runs"]["hybrid"]["points"]["8"]["hybrid"] = summary(1.0, batch=8)
    top = throughput_report.curve(broken)[0]
    assert "gives a GPU time of" in top["hybrid"]["fit_error"]
    assert top["hybrid"]["real_step_ms"] == pytest.approx(6.0 * 78 / 8)
    # without the second count: every figure scaled
    plain = case_with_fit()
    del plain["fit"]
    top = throughput_report.curve(plain)[0]
    assert top["hybrid"]["tokens_per_s"] == pytest.approx(8 / (6.0 * 78 / 8 / 1e3))


@pytest.mark.parametrize("counts", [["4", "2"], ["2", "4", "8"], ["4", "4"]])
def test_sim_layers_takes_one_or_two_increasing_counts(counts, capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--geometries", "dsv32", "--sim-layers", *counts])
    assert "one count or two increasing ones" in capsys.readouterr().err


@pytest.mark.slow  # ~20 s: the CPU smoke run at two layer counts
def test_cpu_smoke_run_at_two_layer_counts(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = throughput.main(["--geometries", "dsv32", "--sim-layers", "2", "4", "--max-requests",
                          "6", "--timed-steps", "2", "--json", str(out)])
    assert rc == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["sim_layers"] == 2 and case["fit"]["sim_layers"] == 4
    assert case["host_scale"] > 0
    top = throughput_report.curve(case)[0]
    c = top["concurrency"]
    first = case["runs"]["hybrid"]["points"][str(c)]["hybrid"]
    second = case["fit"]["runs"]["hybrid"]["points"][str(c)]["hybrid"]
    scaled = dict(scale=case["scale"], host_scale=case["host_scale"])
    try:  # eager CPU steps are noisy: the 4-layer one may be the faster, and the fit refused
        want = real_step(first, c, **scaled, second=second, layers=(2, 4),
                         num_layers=case["shape"]["num_layers"])
    except ValueError as exc:
        assert top["hybrid"]["fit_error"] == str(exc)
        want = real_step(first, c, **scaled)
    else:
        assert "fit_error" not in top["hybrid"]
    assert top["hybrid"]["real_step_ms"] == pytest.approx(want["step_ms"])
    assert "fit through 2 and 4 simulated layers" in capsys.readouterr().out


def test_summarize_keeps_each_timed_step():
    """The medians come with each step's GPU time and misses in the order they ran (a median
    that moves between starts can be traced to the steps that moved it)."""
    from vllm_hisparse.cli.benchmarks.throughput_probe import TimedStep, summarize

    steps = [TimedStep("hybrid", 4, 6.0, 6.0, 1.0, misses=30, selections=100,
                       misses_per_unit=(20, 10)),
             TimedStep("oracle", 4, 5.0, 5.0, 1.0, misses=9, selections=100),
             TimedStep("hybrid", 4, 5.5, 5.5, 1.0, misses=10, selections=100,
                       misses_per_unit=(10, 0)),
             TimedStep("hybrid", 2, 9.0, 9.0, 1.0, misses=99, selections=100)]
    out = summarize(steps, "hybrid", 4)
    assert out["gpu_ms_per_step"] == [6.0, 5.5] and out["misses_per_step"] == [30, 10]
    assert out["miss_rate"] == pytest.approx(40 / 200)
    assert out["misses_per_unit_per_step"] == [[20, 10], [10, 0]]
    full = summarize([TimedStep("full", 4, 3.0, 3.0, 0.2)], "full", 4)
    assert full["gpu_ms_per_step"] == [3.0] and "misses_per_step" not in full


def test_disagreeing_steps_names_index_groups_that_counted_apart():
    """Every index group of the probe converts the same top-k: a step whose groups counted
    different misses is named (the stale top-k of 2026-12-07 showed as [5406, 0])."""
    from vllm_hisparse.cli.benchmarks.throughput_probe import TimedStep, disagreeing_steps

    same = TimedStep("hybrid", 4, 6.0, 6.0, 1.0, misses=20, misses_per_unit=(10, 10))
    apart = TimedStep("hybrid", 4, 6.0, 6.0, 1.0, misses=10, misses_per_unit=(10, 0))
    one = TimedStep("oracle", 4, 6.0, 6.0, 1.0, misses=7, misses_per_unit=(7,))
    full = TimedStep("full", 4, 3.0, 3.0, 0.2)
    assert disagreeing_steps([same, apart, one, full]) == [apart]


def test_all_full_overhead_compares_the_same_batch():
    """Every request FULL (no hybrid step counted a selection): the connector's real step
    against full's at the largest batch both ran, not full saturated at a smaller one; no
    figure once a request was tracked."""
    idle = case_with_fit()
    idle["full_requests"] = 7
    for runs in (idle["runs"], idle["fit"]["runs"]):
        for point in runs["hybrid"]["points"].values():
            for s in point.values():
                s.pop("miss_rate", None)
    del idle["fit"]["runs"]["full"]["points"]["4"]  # neither system fitted at 4
    got = throughput_report.all_full_overhead(idle)
    assert got["concurrency"] == 4 and not got["fitted"]  # 8: full saturated at 4
    assert got["overhead"] == pytest.approx(5.5 / 5.0 - 1)
    # full fitted at 4 but hybrid not (the second run never reached 4): no mixed ratio
    idle["fit"]["runs"]["full"]["points"]["4"] = {"full": summary(8.0, batch=4)}
    assert throughput_report.all_full_overhead(idle) == {}
    # both fitted at 4: the lines' ratio
    idle["fit"]["runs"]["hybrid"]["points"]["4"] = {"hybrid": summary(9.5, batch=4)}
    got = throughput_report.all_full_overhead(idle)
    full = fitted(summary(5.0, batch=4), summary(8.0, batch=4), batch=4, host_scale=1.25)
    hyb = fitted(summary(5.5, batch=4), summary(9.5, batch=4), batch=4, host_scale=1.25)
    assert got["fitted"] and got["overhead"] == pytest.approx(hyb["gpu_ms"] / full["gpu_ms"] - 1)
    tracked = case_with_fit()
    tracked["runs"]["hybrid"]["points"]["4"]["hybrid"]["miss_rate"] = 0.01
    assert throughput_report.all_full_overhead(tracked) == {}
