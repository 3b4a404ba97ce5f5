"""The record every runtime patch of vLLM is (:class:`Patch`) and the marks a replacement
carries, so that installing twice is a no-op and removal finds vLLM's original."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Attribute every replacement carries (value: the patch name), so a second install is a no-op.
MARKER = "__vllm_hisparse_patch__"
#: Attribute holding what the replacement replaced.
ORIGINAL = "__vllm_hisparse_original__"
#: Stands for "the object had no instance attribute" in a per-object patch's saved original.
ABSENT = object()


@dataclass(frozen=True)
class Patch:
    """One runtime patch of vLLM.

    Attributes:
        name: the table key.
        target: what is replaced (a dotted path; ``<...>`` names a per-object attribute).
        why: what would not work without it.
        installed_by: who installs it, and when.
        install_args: what ``install`` takes (the object first for a per-object patch).
        install: ``install(*args) -> bool``.
        installed: ``installed(*objects) -> bool``.
        remove: ``remove(*objects) -> bool``; restores vLLM's original.
        extension_point: the public vLLM extension point that would make the patch
            unnecessary (docs/vllm-integration.md, "Upstream proposal").
    """

    name: str
    target: str
    why: str
    installed_by: str
    install_args: str
    install: Callable[..., bool]
    installed: Callable[..., bool]
    remove: Callable[..., bool]
    extension_point: str = ""


def marked(fn: Callable[..., Any], name: str, original: Any) -> Callable[..., Any]:
    """``fn`` marked as patch ``name``'s replacement of ``original``."""
    setattr(fn, MARKER, name)
    setattr(fn, ORIGINAL, original)
    return fn


def is_ours(obj: Any, name: str) -> bool:
    """Whether ``obj`` is patch ``name``'s replacement."""
    return getattr(obj, MARKER, None) == name
