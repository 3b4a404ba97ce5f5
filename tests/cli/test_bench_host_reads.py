"""``bench kernels``' host-pool layout section: the gather it times and its rows-in-flight
sweep build their launches through one helper (the sweep used to call the timed closure with
keyword arguments it did not take: ``TypeError: fn() got an unexpected keyword argument
'rpw'``)."""

from vllm_hisparse.cli.benchmarks import host_reads
from vllm_hisparse.ops.tuning import KernelTuning


def test_layout_gather_passes_the_sweep_tuning(monkeypatch):
    calls = []
    monkeypatch.setattr(host_reads.probe, "gather_rows",
                        lambda views, dst, s, d, count, tuning: calls.append((s, d, tuning)))
    plans = [("src0", "dst0"), ("src1", "dst1")]
    fn = host_reads.layout_gather(["view"], ["dst"], plans, "count", pair_major=False)
    fn(0)
    fn(3, rpw=8, cps=2)  # what the sweep calls
    assert calls[0] == ("src0", "dst0", KernelTuning(copy_pair_major=False))
    assert calls[1] == ("src1", "dst1", KernelTuning(copy_pair_major=False, copy_rows_per_warp=8,
                                                     copy_ctas_per_sm=2))
