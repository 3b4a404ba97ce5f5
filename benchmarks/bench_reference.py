"""Runs `vllm_hisparse.cli.benchmarks.reference` (also `vllm-hisparse bench reference`); see its docstring."""

from vllm_hisparse.cli.benchmarks.reference import main

if __name__ == "__main__":
    raise SystemExit(main())
