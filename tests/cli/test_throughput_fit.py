"""``bench throughput --sim-layers N M``: the real step as the line through two layer counts."""

import json

import pytest

from vllm_hisparse.cli.benchmarks import throughput
from vllm_hisparse.cli.benchmarks.throughput_fit import fit_step


def summary(median, low=None, high=None, batch=10):
    low = median if low is None else low
    high = median if high is None else high
    return dict(step_ms_median=median, step_ms_min=low, step_ms_max=high,
                gpu_ms_median=median, host_ms_median=median / 10,
                tokens_per_s=batch / (median / 1e3),
                tokens_per_s_range=[batch / (high / 1e3), batch / (low / 1e3)])


def test_the_fit_separates_the_per_step_part_from_the_layers():
    # 1 ms per step + 0.5 ms per layer: 5 ms at 8 layers, 9 at 16, 40 at 78
    f = fit_step(summary(5.0), summary(9.0), (8, 16), 78, batch=20)
    assert f["per_step_ms"] == pytest.approx(1.0) and f["per_layer_ms"] == pytest.approx(0.5)
    assert f["step_ms"] == pytest.approx(40.0)
    assert f["tokens_per_s"] == pytest.approx(20 / 0.040)
    # scaling the 8-layer step would have said 48.75 ms: the per-step ms counted 78 / 8 times
    assert 5.0 * 78 / 8 == pytest.approx(48.75)


def test_the_fits_range_bounds_every_line_through_the_two_ranges():
    first, second = summary(5.0, 4.9, 5.2), summary(9.0, 8.8, 9.1)
    f = fit_step(first, second, (8, 16), 78, batch=20)
    slowest, fastest = (20e3 / t for t in f["tokens_per_s_range"])
    lines = [fit_step(summary(a), summary(b), (8, 16), 78, 20)["step_ms"]
             for a in (4.9, 5.0, 5.2) for b in (8.8, 9.0, 9.1)]
    assert fastest == pytest.approx(min(lines)) and slowest == pytest.approx(max(lines))
    assert fastest < f["step_ms"] < slowest
    # between the two counts both weights are positive: the bound pairs like with like
    mid = fit_step(first, second, (8, 16), 12, batch=20)
    slowest, fastest = (20e3 / t for t in mid["tokens_per_s_range"])
    assert fastest == pytest.approx((4.9 + 8.8) / 2) and slowest == pytest.approx((5.2 + 9.1) / 2)


def test_the_fit_refuses_bad_counts_and_a_line_below_zero():
    with pytest.raises(ValueError, match="0 < N < M"):
        fit_step(summary(5.0), summary(9.0), (16, 8), 78, 20)
    with pytest.raises(ValueError, match="gives a step of"):
        fit_step(summary(9.0), summary(5.0), (8, 16), 78, 20)  # shorter with more layers


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
                scale=78 / 8, sim_layers=8, runs=runs, fit=dict(sim_layers=16, runs=fit_runs))


def test_curve_uses_the_fit_where_both_counts_have_the_point():
    rows = {r["concurrency"]: r for r in throughput.curve(case_with_fit())}
    top = rows[8]
    full = fit_step(summary(5.0, batch=4), summary(9.0, batch=4), (8, 16), 78, 4)
    hybrid = fit_step(summary(6.0, batch=8), summary(11.0, batch=8), (8, 16), 78, 8)
    assert top["full"]["real_step_ms"] == pytest.approx(full["step_ms"])
    assert top["hybrid"]["per_layer_ms"] == pytest.approx(hybrid["per_layer_ms"])
    assert top["hybrid_over_full"] == pytest.approx(hybrid["tokens_per_s"] / full["tokens_per_s"])
    # a point only the first count has: the scaled step, no parts
    assert rows[4]["hybrid"]["real_step_ms"] == pytest.approx(5.5 * 78 / 8)
    assert "per_layer_ms" not in rows[4]["hybrid"]
    # a line that falls below zero at the real count is said, and the step scaled
    broken = case_with_fit()
    broken["fit"]["runs"]["hybrid"]["points"]["8"]["hybrid"] = summary(1.0, batch=8)
    top = throughput.curve(broken)[0]
    assert "gives a step of" in top["hybrid"]["fit_error"]
    assert top["hybrid"]["real_step_ms"] == pytest.approx(6.0 * 78 / 8)
    # without the second count: every figure scaled, as before
    plain = case_with_fit()
    del plain["fit"]
    top = throughput.curve(plain)[0]
    assert top["hybrid"]["tokens_per_s"] == pytest.approx(8 / (6.0 * 78 / 8 / 1e3))


@pytest.mark.parametrize("counts", [["4", "2"], ["2", "4", "8"], ["4", "4"]])
def test_sim_layers_takes_one_or_two_increasing_counts(counts, capsys):
    with pytest.raises(SystemExit):
        throughput.main(["--geometries", "dsv32", "--sim-layers", *counts])
    assert "one count or two increasing ones" in capsys.readouterr().err


@pytest.mark.slow  # ~40 s: the CPU smoke run at two layer counts
def test_cpu_smoke_run_at_two_layer_counts(tmp_path, capsys):
    out = tmp_path / "t.json"
    rc = throughput.main(["--geometries", "dsv32", "--sim-layers", "2", "4", "--max-requests",
                          "6", "--timed-steps", "2", "--json", str(out)])
    assert rc == 0
    (case,) = json.loads(out.read_text())["cases"]
    assert case["sim_layers"] == 2 and case["fit"]["sim_layers"] == 4
    top = throughput.curve(case)[0]
    c = top["concurrency"]
    first = case["runs"]["hybrid"]["points"][str(c)]["hybrid"]
    second = case["fit"]["runs"]["hybrid"]["points"][str(c)]["hybrid"]
    want = fit_step(first, second, (2, 4), case["shape"]["num_layers"], c)
    assert top["hybrid"]["real_step_ms"] == pytest.approx(want["step_ms"])
    assert "fit through 2 and 4 simulated layers" in capsys.readouterr().out
