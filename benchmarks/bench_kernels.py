"""Runs `vllm_hisparse.cli.benchmarks.kernels` (also `vllm-hisparse bench kernels`); see its docstring."""

from vllm_hisparse.cli.benchmarks.kernels import main

if __name__ == "__main__":
    raise SystemExit(main())
