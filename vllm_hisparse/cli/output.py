"""Writing the files a command was asked for (``--json``, ``--plot``): announced, or one line
naming the flag when the write fails. Commands print their table before writing, so a failed
write never loses it."""

from __future__ import annotations

import json
import sys
from typing import Callable


def write_file(flag: str, path: str, write: Callable[[str], None], *, command: str) -> bool:
    """Run ``write(path)``; print ``wrote PATH`` (stderr) or the error naming ``flag``.
    Returns whether the file was written."""
    try:
        write(path)
    except OSError as exc:
        print(f"vllm-hisparse {command}: error: {flag} {path}: could not write: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return False
    print(f"wrote {path}", file=sys.stderr)
    return True


def write_json(flag: str, path: str, data, *, command: str) -> bool:
    def dump(p: str) -> None:
        with open(p, "w") as f:
            json.dump(data, f, indent=2)

    return write_file(flag, path, dump, command=command)
