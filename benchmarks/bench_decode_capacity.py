"""Runs `vllm_hisparse.cli.benchmarks.capacity` (also `vllm-hisparse bench capacity`); see its docstring."""

from vllm_hisparse.cli.benchmarks.capacity import main

if __name__ == "__main__":
    raise SystemExit(main())
