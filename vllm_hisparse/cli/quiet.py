"""Keep the CLI's output to its own lines: vLLM's and torch's import-time logging (deprecation
notices, "Failed to import from vllm._C", connector banners, INFO lines) and Python warnings
are silenced unless ``--verbose``. Everything is restored when the command returns, so an
in-process caller (a test) keeps its logging as it was."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

# Loggers and the level they keep: our own warnings stay visible.
_LEVELS = {"vllm": logging.ERROR, "torch": logging.ERROR, "transformers": logging.ERROR,
           "vllm_hisparse": logging.WARNING}
# Read when torch / vLLM configure their logging at first import (torch resets its logger's
# level then; TORCH_LOGS=-all makes that ERROR).
_ENV = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_LOGS": "-all"}


@contextlib.contextmanager
def quiet(verbose: bool):
    if verbose:
        yield
        return
    saved_env = {name: os.environ.get(name) for name in _ENV}
    saved_levels = {name: logging.getLogger(name).level for name in _LEVELS}
    for name, value in _ENV.items():
        os.environ.setdefault(name, value)
    for name, level in _LEVELS.items():
        logging.getLogger(name).setLevel(level)
    try:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
                warnings.simplefilter("ignore", category)
            warnings.filterwarnings("ignore", module=r"(torch|vllm|transformers)(\.|$)")
            yield
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for name, level in saved_levels.items():
            logging.getLogger(name).setLevel(level)

