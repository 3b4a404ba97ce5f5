"""The profiled step's split: classes, idle time after the gate and what ended each gap."""

from vllm_hisparse.cli.benchmarks.step_profile import gpu_events, kernel_class, split_timeline


def trace(*events):
    """Chrome-trace events ``(cat, name, ts, dur)`` on stream 7, or ``(..., stream)``."""
    return {"traceEvents": [dict(ph="X", cat=ev[0], name=ev[1], ts=ev[2], dur=ev[3],
                                 args=dict(stream=ev[4] if len(ev) > 4 else 7))
                            for ev in events]}


def test_events_before_the_gate_are_left_out_and_gaps_are_named():
    t = trace(("kernel", "warmup_gemm", 0, 50),
              ("kernel", "spin_kernel", 100, 60_000),           # the gate: ends at 60_100
              ("Memcpy", "Memcpy HtoD (Pageable -> Device)", 60_110, 5),  # cat is not GPU
              ("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 60_110, 5),
              ("kernel", "sm90_gemm_bf16", 60_115, 100),
              ("kernel", "resolve_kernel", 60_245, 10),       # 30 µs gap before it
              ("kernel", "convert_req_index_kernel", 60_250, 20),  # overlaps: no gap
              ("kernel", "resolve_kernel", 60_290, 10))      # 20 µs gap
    split = split_timeline(gpu_events(t), gate_us=60_000)
    assert split["span_ms"] == (60_300 - 60_100) / 1e3
    assert abs(split["idle_ms"] - (10 + 30 + 20) / 1e3) < 1e-12
    first = split["idle_before"][0]
    assert first["name"] == "resolve_kernel" and first["gaps"] == 2
    assert abs(first["ms"] - 0.050) < 1e-12
    assert split["idle_before"][1]["name"].startswith("Memcpy HtoD")
    ms = split["kernel_ms"]
    assert set(ms) == {"copy / memset", "gemm", "resolve", "conversion (vLLM)"}
    assert abs(ms["resolve"] - 0.020) < 1e-12 and "comm stand-in" not in ms
    kernels = {k["name"]: k for k in split["kernels"]}
    assert kernels["resolve_kernel"]["launches"] == 2 and "warmup_gemm" not in kernels
    assert abs(kernels["resolve_kernel"]["ms"] - 0.020) < 1e-12
    assert split["kernels"][0]["name"] == "sm90_gemm_bf16"  # largest first


def test_without_a_gate_the_span_starts_at_the_first_event():
    split = split_timeline(gpu_events(trace(("kernel", "a_kernel", 10, 5),
                                            ("kernel", "b", 25, 5))), gate_us=60_000)
    assert split["span_ms"] == 0.020 and split["idle_ms"] == 0.010
    assert split["kernel_ms"] == {"other": 0.010}
    assert split_timeline([], gate_us=1.0)["span_ms"] == 0.0
    assert split_timeline([], gate_us=1.0)["kernels"] == []


def test_kernel_classes_first_match_wins():
    assert kernel_class("copy_rows_kernel") == "gather"
    assert kernel_class("merge_rows_kernel") == "merge rows"
    assert kernel_class("token_state_rows_kernel") == "merge rows"
    assert kernel_class("_convert_req_index_to_global_index_kernel") == "conversion (vLLM)"
    assert kernel_class("void at::native::vectorized_elementwise_kernel") == "other"
    assert kernel_class("resolve_topk") == "resolve"  # before top-k
    assert kernel_class("radixSortKernel") == "top-k"
    assert kernel_class("elementwise") == "other"
    assert kernel_class("sparse_mla_decode_kernel") == "sparse MLA"
    assert kernel_class("indexer_logits_kernel") == "indexer logits"


def test_side_stream_time_is_split_by_what_the_compute_stream_did_meanwhile():
    t = trace(("kernel", "spin_kernel", 0, 60_000, 7),          # the gate: the compute stream
              ("kernel", "sm90_gemm_bf16", 60_000, 100, 7),     # compute busy 60_000-60_100
              ("kernel", "copy_rows_kernel", 60_050, 110, 9),   # leader: 60 µs of it alone
              ("kernel", "sm90_gemm_bf16", 60_160, 100, 7),     # compute busy 60_160-60_260
              ("kernel", "copy_rows_kernel", 60_170, 80, 11),   # background: under compute
              ("kernel", "resolve_kernel", 60_270, 10, 9))      # alone: exposed
    split = split_timeline(gpu_events(t), gate_us=60_000)
    assert abs(split["kernel_ms"]["gather"] - 0.190) < 1e-12
    assert abs(split["side_ms"]["gather"] - 0.190) < 1e-12
    assert abs(split["side_exposed_ms"]["gather"] - 0.060) < 1e-12
    assert abs(split["side_exposed_ms"]["resolve"] - 0.010) < 1e-12
    assert "gemm" not in split["side_ms"]  # compute-stream classes are not beside it
    # without a gate the first event's stream is the compute stream
    split = split_timeline(gpu_events(trace(("kernel", "a", 0, 10, 3),
                                            ("kernel", "copy_rows_kernel", 5, 10, 4))), 1e6)
    assert split["side_ms"] == {"gather": 0.010} and split["side_exposed_ms"] == {"gather": 0.005}
