"""The package's benchmarks, every one run by ``vllm-hisparse bench TARGET`` (``cli/bench.py``
lists them); their measured results are under ``benchmarks/results/`` of the repository. Each
target module has ``main(argv) -> int``; those that need vLLM import it themselves (connector,
throughput and the scheduler benchmarks), so the GPU ones run on a machine that has only
torch."""
