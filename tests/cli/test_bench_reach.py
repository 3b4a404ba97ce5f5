"""``bench kernels --only reach``: the planning of the pool sweep (which host rows one layer's
gather reads, the spans, the rows in flight per grid) is exact on CPU; the GPU run skips
without CUDA."""

import numpy as np
import pytest
import torch

from vllm_hisparse.cli.benchmarks import reach

SMALL = reach.ReachGeometry("small", 656, 4, num_requests=3, context_rows=100,
                            misses_per_request=5)


def test_carving_offsets_follow_the_host_pool_layouts():
    layer = reach.carve(SMALL, "layer", 1 << 30)
    pos = reach.carve(SMALL, "position", 1 << 30)
    assert (layer.num_layers, pos.num_layers, layer.host_rows) == (4, 4, 300)
    rows = np.array([0, 7, 299])
    assert layer.byte_offsets(2, rows).tolist() == [(600 + r) * 656 for r in rows]
    assert pos.byte_offsets(2, rows).tolist() == [(r * 4 + 2) * 656 for r in rows]
    # one layer's rows: a slab in layer-major, num_layers times that in position-major
    assert reach.span_bytes(layer, 1, rows) == 300 * 656
    assert reach.span_bytes(pos, 1, rows) == 299 * 4 * 656 + 656


def test_carve_keeps_the_layers_that_fit_and_refuses_fewer_than_two():
    slab = SMALL.slab_bytes
    assert reach.carve(SMALL, "position", 3 * slab + 1).num_layers == 3
    assert reach.carve(SMALL, "layer", 100 * slab).num_layers == 4
    with pytest.raises(ValueError, match="fewer than 2 slabs"):
        reach.carve(SMALL, "layer", 2 * slab - 1)
    with pytest.raises(ValueError, match="layout must be one of"):
        reach.carve(SMALL, "page", 100 * slab)


def test_misses_lie_in_each_requests_own_context_and_hot_region():
    rows = reach.miss_rows(SMALL, seed=3)
    assert rows.shape == (3, 5)
    for r in range(3):
        assert len(set(rows[r].tolist())) == 5
        assert all(r * 100 <= x < (r + 1) * 100 for x in rows[r])
    hot = reach.hot_rows(SMALL, seed=3, slots_per_request=8)
    for r in range(3):
        assert len(set(hot[r].tolist())) == 5
        assert all(r * 8 <= x < (r + 1) * 8 for x in hot[r])
    with pytest.raises(ValueError, match="exceed 4 hot slots"):
        reach.hot_rows(SMALL, seed=3, slots_per_request=4)


def test_item_order_request_major_or_a_permutation():
    assert reach.item_order(6, "request", 1).tolist() == list(range(6))
    shuffled = reach.item_order(600, "shuffled", 1)
    assert sorted(shuffled.tolist()) == list(range(600))
    assert shuffled.tolist() != list(range(600))
    with pytest.raises(ValueError, match="order must be one of"):
        reach.item_order(6, "sorted", 1)


def test_rows_in_flight_follow_the_copy_launch():
    g = reach.GridSetting
    # DeepSeek-V3.2 batch: 80 x 2048 items, G = 4 (656 B), 8 warps: 5120 CTAs wanted
    assert reach.rows_in_flight(656, 132, 80, 2048, g("default")) == 528 * 8 * 4
    assert reach.rows_in_flight(656, 132, 80, 2048, g("c", ctas_per_sm=1)) == 132 * 8 * 4
    assert reach.rows_in_flight(656, 132, 80, 2048, g("m", max_ctas=66)) == 66 * 8 * 4
    assert reach.rows_in_flight(1152, 132, 80, 2048, g("default")) == 528 * 8 * 2
    # a small plan needs fewer CTAs than the cap: ceil(10 * 16 / 4 / 8) = 5
    assert reach.rows_in_flight(656, 132, 10, 16, g("default")) == 5 * 8 * 4


def test_inflight_span_is_the_mean_over_windows():
    layer = reach.carve(SMALL, "layer", 1 << 30)
    items = np.array([0, 9, 100, 150, 299])
    # windows [0, 9], [100, 150], [299]: spans 10, 51, 1 rows
    assert reach.inflight_span_bytes(layer, 0, items, 2) == round((10 + 51 + 1) * 656 / 3)
    assert reach.inflight_span_bytes(layer, 0, items, 5) == 300 * 656


def test_request_major_windows_are_narrower_with_fewer_rows_in_flight():
    g = reach.GEOMETRIES[0]
    layer = reach.carve(g, "layer", 24 << 30)
    items = reach.miss_rows(g, seed=1).reshape(-1)
    wide = reach.inflight_span_bytes(layer, 0, items, 16_896)
    narrow = reach.inflight_span_bytes(layer, 0, items, 2_112)
    assert wide == reach.span_bytes(layer, 0, items) > 7 * narrow


def test_pool_cases_cover_every_point_once():
    cases = reach.pool_cases()
    keys = {(c["geometry"].name, c["layout"], c["order"], c["grid"].name, c["warm"])
            for c in cases}
    assert len(keys) == len(cases) == 2 * 2 * (5 + 1) * 2
    assert all(c["grid"].name == "default" for c in cases if c["order"] == "shuffled")


def test_buffer_size_from_memory_and_mode():
    need = 78 * reach.GEOMETRIES[1].slab_bytes
    assert reach.host_buffer_bytes(True, None) == reach.QUICK_HOST_BYTES
    assert reach.host_buffer_bytes(False, 1 << 50) == reach.FULL_HOST_BYTES < need
    assert reach.host_buffer_bytes(False, 64 << 30) == 48 << 30
    assert reach.host_buffer_bytes(False, 10 << 30) == 8 << 30  # the uniform sweep's floor


def test_best_setting_is_the_fastest_cold_point():
    rows = [dict(geometry="a", warm=True, gbps=50.0), dict(geometry="a", warm=False, gbps=30.0),
            dict(geometry="a", warm=False, gbps=35.0), dict(geometry="b", warm=False, gbps=99.0)]
    assert reach.best_setting(rows, "a")["gbps"] == 35.0


TINY = reach.ReachGeometry("tiny", 656, 3, num_requests=4, context_rows=4096,
                           misses_per_request=205)


def test_pool_sweep_runs_through_the_reference_twin(monkeypatch):
    """The sweep's plumbing on CPU: every case timed once, each carving's gather checked
    row for row (a wrong plan or view would fail check_gather)."""
    from vllm_hisparse.ops import reference

    monkeypatch.setattr(reach, "DEV", torch.device("cpu"))
    monkeypatch.setattr(reach.probe, "gather_rows", lambda s, d, a, b, c, tuning=None,
                        max_ctas=0: reference.gather_rows(s, d, a, b, c))
    monkeypatch.setattr(reach.probe, "check_errors", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    befores = []

    def one_timing(fn, reps, before=None, flush=True):
        befores.append(before is not None)
        if before is not None:
            before(0)
        fn(0)
        return 10.0

    monkeypatch.setattr(reach, "time_events", one_timing)
    buf = torch.randint(0, 256, (4 * TINY.slab_bytes,), dtype=torch.uint8)
    rows = reach.bench_pool_geometry(buf, TINY, quick=True, sms=132)
    assert len(rows) == len(reach.pool_cases((TINY,))) == 24
    assert befores == [not r["warm"] for r in rows]
    assert all(r["gbps"] == pytest.approx(4 * 205 * 656 / 10e-6 / 1e9) for r in rows)
    by = {(r["layout"], r["order"], r["grid"], r["cache"]): r for r in rows}
    assert by["layer", "request", "default", "cold"]["span_bytes"] <= TINY.slab_bytes
    assert by["position", "request", "default", "cold"]["span_bytes"] > 2 * TINY.slab_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_gather_is_exact_on_the_gpu():
    """One geometry on a small buffer: check_gather compares every gathered row."""
    from vllm_hisparse.ops import probe
    if not probe.available():
        pytest.skip("needs the compiled extension")
    buf = torch.randint(0, 256, (4 * TINY.slab_bytes,), dtype=torch.uint8).pin_memory()
    rows = reach.bench_pool_geometry(buf, TINY, quick=True, sms=132)
    assert {r["layout"] for r in rows} == {"layer", "position"}
    assert all(r["gbps"] > 0 for r in rows)
