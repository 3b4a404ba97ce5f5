"""Runtime patch: check our extra config when vLLM builds a ``VllmConfig``.

vLLM 0.33 offers a general plugin no hook between parsing the CLI and starting the
engine processes: ``kv_connector_extra_config`` is an untyped dict that only the
connector reads, and the connector is constructed in the engine core. A bad key then
kills ``vllm serve`` far from its cause. So we wrap ``VllmConfig.__post_init__`` (vLLM's
pydantic dataclass calls it through the class on every construction, including
``dataclasses.replace`` copies): the wrapper runs ``check(vllm_config)`` first, then
vLLM's own ``__post_init__``. ``check`` must be a no-op for configs that do not name our
connector (``config.check_extra_config`` is).

Why before vLLM's body: it inspects MultiConnector children itself
(``KVTransferConfig.has_connector``) and fails with an ``AttributeError`` on the
malformed shapes our check names.

install / installed / remove, like every patch of this package (the coordinator moves
this triple into the central table of ``vllm/patches.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from vllm_hisparse.vllm.compat import VllmConfig

#: Attribute set on our wrapper (idempotence) and the one holding vLLM's original.
_MARKER = "__vllm_hisparse_config_check__"
_ORIGINAL = "__vllm_hisparse_original__"


def installed() -> bool:
    """Whether ``VllmConfig.__post_init__`` is our wrapper."""
    return getattr(VllmConfig.__dict__["__post_init__"], _MARKER, False)


def install(check: Callable[[VllmConfig], None]) -> bool:
    """Run ``check(vllm_config)`` at the start of every ``VllmConfig.__post_init__``.

    Idempotent: returns False (and changes nothing) if already installed."""
    original = VllmConfig.__dict__["__post_init__"]
    if getattr(original, _MARKER, False):
        return False

    @functools.wraps(original)
    def __post_init__(self: VllmConfig) -> None:
        check(self)
        original(self)

    setattr(__post_init__, _MARKER, True)
    setattr(__post_init__, _ORIGINAL, original)
    VllmConfig.__post_init__ = __post_init__  # type: ignore[method-assign]
    return True


def remove() -> bool:
    """Undo ``install`` (tests only); returns False if not installed."""
    wrapper = VllmConfig.__dict__["__post_init__"]
    if not getattr(wrapper, _MARKER, False):
        return False
    VllmConfig.__post_init__ = getattr(wrapper, _ORIGINAL)  # type: ignore[method-assign]
    return True
