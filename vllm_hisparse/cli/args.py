"""Argument checking shared by every subcommand: the parser class and the value types.

Each ``type=`` below rejects a bad value while the command line is parsed, before any work
starts, so the error names the flag (argparse prefixes ``argument --flag:``). The parser prints
that one line and exits with status 2, without the usage block.
"""

from __future__ import annotations

import argparse
import math
import os


#: Exit status after Ctrl-C (128 + SIGINT, what a shell reports for it).
EXIT_INTERRUPTED = 130


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``PROG: error: MESSAGE``."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def _number(text: str, kind, accepted: str, ok) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}") from None
    if (kind is float and not math.isfinite(value)) or not ok(value):
        raise argparse.ArgumentTypeError(f"expected {accepted}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, "an integer > 0", lambda v: v > 0)


def nonneg_int(text: str) -> int:
    return _number(text, int, "an integer >= 0", lambda v: v >= 0)


def positive_float(text: str) -> float:
    return _number(text, float, "a finite number > 0", lambda v: v > 0)


def nonneg_float(text: str) -> float:
    return _number(text, float, "a finite number >= 0", lambda v: v >= 0)


def fraction(text: str) -> float:
    return _number(text, float, "a number in [0, 1]", lambda v: 0 <= v <= 1)


def output_path(text: str) -> str:
    """A file the command will write: not a directory, in an existing writable directory."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; expected a file path")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return text
