"""Loads the optional CUDA extension ``vllm_hisparse._C`` once, and says once if it is missing.

This module imports nothing of the package: :mod:`vllm_hisparse.ops.cuda` and the op dispatch
in :mod:`vllm_hisparse.ops` depend on it, never the other way round.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

logger = logging.getLogger("vllm_hisparse.ops")


@functools.cache
def load() -> tuple[ModuleType | None, str]:
    """(the ``_C`` module or None, why it is unavailable or "")."""
    try:
        from vllm_hisparse import _C  # type: ignore[attr-defined]
    except ImportError as exc:  # built without a CUDA toolkit, or a broken build
        return None, f"vllm_hisparse._C could not be imported ({exc})"
    return _C, ""


def data_plane_error() -> str:
    """Why the data-plane kernels cannot run ("" when they can)."""
    module, why = load()
    if module is None:
        return why
    if not getattr(module, "has_data_plane", False):
        return "vllm_hisparse._C was built without the data-plane kernels"
    return ""


@functools.cache
def warn_if_unavailable() -> bool:
    """True when the data-plane kernels can run. The first call that finds them missing logs
    one warning; later calls are silent."""
    why = data_plane_error()
    if why:
        logger.warning("%s; CUDA tensors are handled by the pure-torch reference ops "
                       "(correct but slow)", why)
        return False
    return True
