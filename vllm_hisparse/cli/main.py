"""``vllm-hisparse``: the command line.

Subcommands live in their own modules and register themselves here; each gets a parser and a
``run(args) -> int``. Bad arguments end with a one-line message naming the flag or file and
exit status 2 (argparse's convention); a failed check or a file that could not be written ends
with status 1; Ctrl-C with one line and status 130 (``simulate`` writes its partial report
first). vLLM's and torch's logging and warnings stay out of the output unless
``--verbose`` (before or after the subcommand).
"""

from __future__ import annotations

import argparse
import sys

from vllm_hisparse import __version__
from vllm_hisparse.cli import bench, plan, replay, simulate
from vllm_hisparse.cli.args import EXIT_INTERRUPTED, CliParser
from vllm_hisparse.cli.quiet import quiet

SUBCOMMANDS = {"simulate": simulate, "bench": bench, "plan": plan, "replay": replay}
VERBOSE_HELP = "keep vLLM's and torch's logging and warnings (INFO lines, deprecations)"


class CliError(Exception):
    """A user error detected after parsing (bad file, inconsistent options)."""


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(
        prog="vllm-hisparse",
        description="Hierarchical KV residency for sparse-attention models in vLLM: tools.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        module.add_parser(sub)
        # Also after the subcommand; SUPPRESS keeps the top-level value when it is absent.
        sub.choices[name].add_argument("--verbose", action="store_true",
                                       default=argparse.SUPPRESS, help=VERBOSE_HELP)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with quiet(args.verbose):
        try:
            return SUBCOMMANDS[args.command].run(args)
        except (CliError, ValueError, OSError) as exc:
            message = " ".join(_message(exc).split())  # one line, whatever raised it
            parser.exit(2, f"vllm-hisparse {args.command}: error: {message}\n")
        except KeyboardInterrupt:  # a subcommand that writes a partial report catches it first
            parser.exit(EXIT_INTERRUPTED, f"vllm-hisparse {args.command}: interrupted (Ctrl-C)\n")


def _message(exc: BaseException) -> str:
    """What went wrong: a pydantic ``ValidationError`` (vLLM's config classes wrap the
    errors their checks raise, ours included) gives its errors' own messages, not its
    report of the model's whole input."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        try:
            return "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in errors())
        except (TypeError, AttributeError):
            pass
    return str(exc)


if __name__ == "__main__":
    sys.exit(main())
