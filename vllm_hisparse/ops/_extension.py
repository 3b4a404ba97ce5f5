"""Loads the optional CUDA extension ``vllm_hisparse._C`` once, and says once if it is missing."""

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


@functools.cache
def cuda_ops() -> ModuleType | None:
    """``vllm_hisparse.ops.cuda`` when the extension provides the kernels, else None.

    The first call that finds no kernels logs one warning; later calls are silent.
    """
    module, why = load()
    if module is not None:
        try:
            from vllm_hisparse.ops import cuda
        except ImportError as exc:
            why = f"vllm_hisparse.ops.cuda could not be imported ({exc})"
        else:
            available = getattr(cuda, "available", None)
            if available is None or available():
                return cuda
            why = "vllm_hisparse._C was built without the data-plane kernels"
    logger.warning("%s; CUDA tensors are handled by the pure-torch reference ops "
                   "(correct but slow)", why)
    return None
