"""Looking vLLM's objects up by dotted path, for the shape checks of the object-change table
(``patches.OBJECT_CHANGES``): each record names the vLLM attributes it touches, and
:func:`shape_problems` says whether the installed vLLM still has them, in the form relied on.
Nothing here is used on a serving path."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

__all__ = ["resolve_vllm", "shape_problems"]


def resolve_vllm(path: str) -> Any:
    """The vLLM object at ``path`` (``"vllm.v1.core.kv_cache_manager.KVCacheManager"``,
    ``"vllm.v1.kv_cache_spec_registry._REGISTRY_ROLE_MANAGERS"``): the longest importable
    module prefix, then attributes. Raises ``LookupError`` naming what is missing."""
    if not (path == "vllm" or path.startswith("vllm.")):
        raise LookupError(f"{path!r} is not a vLLM path")
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, name in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, name):
                raise LookupError(f"{'.'.join(parts[:i])} has no attribute {name!r}")
            obj = getattr(obj, name)
        return obj
    raise LookupError(f"no module of {path!r} imports")


def _source(obj: Any) -> str:
    """The source of a class (its whole MRO below ``object``) or of a function."""
    if inspect.isclass(obj):
        return "\n".join(inspect.getsource(c) for c in obj.__mro__
                         if c.__module__.startswith("vllm.") and c is not object)
    return inspect.getsource(obj)


def shape_problems(owner: str, attribute: str, kind: str) -> list[str]:
    """What is wrong with ``owner.attribute`` in the installed vLLM (empty: nothing).

    ``kind``: ``"field"`` (a dataclass field of the class ``owner``), ``"instance"`` (the
    class or one of its vLLM bases assigns ``self.<attribute>``), ``"class"`` (a class
    attribute, default or method), ``"callable"`` (a callable attribute), ``"module"`` (a
    module-level name of the module ``owner``), or ``"source:<text>"`` (the source of
    ``owner`` contains ``<text>``; ``attribute`` only names what that text stands for)."""
    where = f"{owner}.{attribute}"
    try:
        obj = resolve_vllm(owner)
    except LookupError as exc:
        return [f"{where}: {exc}"]
    if kind == "field":
        if not dataclasses.is_dataclass(obj):
            return [f"{where}: {owner} is not a dataclass"]
        if attribute not in {f.name for f in dataclasses.fields(obj)}:
            return [f"{where}: no such dataclass field"]
        return []
    if kind == "instance":
        if f"self.{attribute}" not in _source(obj):
            return [f"{where}: no vLLM class of {owner}'s MRO assigns self.{attribute}"]
        return []
    if kind in ("class", "module"):
        return [] if hasattr(obj, attribute) else [f"{where}: no such attribute"]
    if kind == "callable":
        return [] if callable(getattr(obj, attribute, None)) else [f"{where}: not callable"]
    if kind.startswith("source:"):
        text = kind.removeprefix("source:")
        return [] if text in _source(obj) else [f"{where}: {owner}'s source no longer has {text!r}"]
    raise ValueError(f"unknown shape kind {kind!r}")
