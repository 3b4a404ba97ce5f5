"""``vllm-hisparse``: the command line.

Subcommands live in their own modules and register themselves here; each gets a parser and a
``run(args) -> int``. Bad arguments end with a message and exit status 2 (argparse's
convention); a failed check ends with status 1.
"""

from __future__ import annotations

import argparse
import sys

from vllm_hisparse import __version__
from vllm_hisparse.cli import bench, plan, replay, simulate

SUBCOMMANDS = {"simulate": simulate, "bench": bench, "plan": plan, "replay": replay}


class CliError(Exception):
    """A user error detected after parsing (bad file, inconsistent options)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-hisparse",
        description="Hierarchical KV residency for sparse-attention models in vLLM: tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args)
    except (CliError, ValueError, OSError) as exc:
        parser.exit(2, f"vllm-hisparse {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
