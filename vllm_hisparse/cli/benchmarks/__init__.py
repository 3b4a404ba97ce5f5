"""Benchmarks shipped with the package, run by ``vllm-hisparse bench`` and by the scripts in
``benchmarks/``. Each module has ``main(argv) -> int``; none imports vLLM, so they run on a GPU
machine that has only torch."""
