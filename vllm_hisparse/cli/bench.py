"""``vllm-hisparse bench``: the package's benchmarks.

``kernels`` (GPU: resolve, gathers, page copies, host-pool layouts and page sizes against the
link ceilings measured in the same run), ``capacity`` (GPU: decode batch and step time with full
vs hybrid residency under one HBM budget; a CPU smoke run otherwise), ``connector`` (the same
through vLLM's scheduler, the connector's two roles and the attention hook, next to the no-IO
oracle of the same run; needs vLLM), ``throughput`` (decode tokens/s against concurrency of
full, hybrid and the no-IO oracle on a model-shaped step replayed from CUDA graphs through
vLLM's scheduler and the connector: the headline figure; needs vLLM), ``graphs`` (GPU: a decode step through the attention hook,
eager vs replayed as one CUDA graph), ``clustering`` (CPU: how a hot region's misses fall into
4 KiB host pages per host-pool layout), ``reference`` (the pure-torch resolve on the CPU) and
``tp-gather`` (tensor-parallel ranks, one process and GPU each, gathering from one shared
pinned host pool alone and all at once; CPU reference otherwise).

The scheduler side on the CPU: ``core-step`` (one residency-policy step with many long
requests), ``scheduler-overhead`` (vLLM's real scheduler with our connector against stock
vLLM, the in-tree connector and our plan alone; needs vLLM), ``shared-prefix`` (the same
systems on requests sharing a long prefix; needs vLLM), ``admission-sweep`` (``simulate``
with and without the connector over 64 configurations; needs vLLM) and ``pd-import`` (P/D
host landing over NIXL; needs nixl). Tools for the GPU figures: ``profile-resolve`` (a few
resolve launches for Nsight Compute), ``ncu-phases`` (an ncu source export per
barrier-delimited phase), ``profile-diff`` (two systems' profiled kernels of one ``throughput``
case side by side) and ``throughput-table`` (the headline table from ``throughput`` JSONs).

Without a target:
``kernels`` and ``capacity`` on a GPU, ``reference`` on a CPU-only machine. Arguments after the target go to that benchmark
(``vllm-hisparse bench kernels --quick --json k.json``; ``--help`` lists them).
"""

from __future__ import annotations

import argparse
import importlib
import sys

TARGETS = ("kernels", "capacity", "connector", "throughput", "graphs", "clustering", "reference",
           "tp-gather", "core-step", "scheduler-overhead", "shared-prefix", "admission-sweep",
           "pd-import", "profile-resolve", "ncu-phases", "profile-diff", "throughput-table")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="kernel, decode-capacity, connector, CUDA-graph step, "
                       "clustering, reference, tensor-parallel gather and scheduler benchmarks",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", choices=TARGETS,
                   help="which benchmark (default: kernels + capacity on a GPU, else reference)")
    p.add_argument("args", nargs=argparse.REMAINDER,
                   help="arguments for the benchmark (see `vllm-hisparse bench TARGET --help`)")


def default_targets() -> tuple[list[str], str]:
    """The benchmarks ``bench`` runs without a target, and why."""
    import torch

    if torch.cuda.is_available():
        return ["kernels", "capacity"], (f"a CUDA device is visible "
                                         f"({torch.cuda.get_device_name()})")
    return ["reference"], ("no CUDA device is visible (kernels and capacity time CUDA "
                           "kernels; reference times the CPU ops)")


def run(args) -> int:
    if args.target is None:
        if args.args:
            raise ValueError("benchmark arguments need a target: vllm-hisparse bench TARGET ...")
        targets, why = default_targets()
        print(f"vllm-hisparse bench: no target given, running {' and '.join(targets)}: {why}",
              file=sys.stderr, flush=True)
    else:
        targets = [args.target]
    status = 0
    for name in targets:
        module = importlib.import_module(
            f"vllm_hisparse.cli.benchmarks.{name.replace('-', '_')}")
        status = max(status, module.main(list(args.args)))
    return status
