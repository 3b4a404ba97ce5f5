"""Every connector entry of a ``kv_transfer_config``, MultiConnector children included.

vLLM takes ``kv_connector_extra_config`` as an untyped dict: a MultiConnector entry holds
``{"connectors": [{"kv_connector": NAME, "kv_connector_extra_config": {...}, ...}, ...]}``,
and a child may itself be a MultiConnector. :func:`connector_entries` is the one walk over
that shape; its callers decide what to look for: ``config`` (our entry, strict: a malformed
shape is a named error), ``offloading_scope`` (is OffloadingConnector composed) and
``pd/landings.py`` (the order of the top MultiConnector's children).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

MULTI_CONNECTOR = "MultiConnector"

#: ``on_malformed(where, problem, accepted)``: told about each malformed part of the shape,
#: with its path; it raises, or returns and the walk skips that part.
OnMalformed = Callable[[str, str, str], None]


@dataclass(frozen=True)
class ConnectorEntry:
    """One ``kv_connector`` of the config, where it sits and what it was given."""

    name: Any
    """``kv_connector`` (not checked to be a string unless the walk is strict)."""
    extra: Any
    """``kv_connector_extra_config``: as given at the top level, ``{}`` for a child without one."""
    where: str
    """Path of ``extra`` from the top, e.g. ``kv_connector_extra_config.connectors[0]
    .kv_connector_extra_config``."""
    depth: int
    """0 at the top level, 1 for a child of the top MultiConnector, and so on."""
    index: int | None = None
    """Position in the parent MultiConnector's ``connectors`` (None at the top level)."""
    child: Mapping | None = None
    """The child object itself (its ``kv_role`` and other keys); None at the top level."""


def _skip(where: str, problem: str, accepted: str) -> None:
    return None


def connector_entries(kv_connector: Any, extra: Any, *, on_malformed: OnMalformed = _skip,
                      max_depth: int | None = None) -> Iterator[ConnectorEntry]:
    """Every entry, parents before their children, in list order (depth first).

    ``on_malformed`` hears, with a path, of a MultiConnector whose extra config is not an
    object or whose ``connectors`` is not a list, a child that is not an object, a child
    whose ``kv_connector`` is not a non-empty string or whose extra config is neither an
    object nor null, and a MultiConnector at ``max_depth`` or deeper (None: no limit). The
    default skips each such part (lenient: for a config ``config`` already checked)."""
    yield from _walk(ConnectorEntry(kv_connector, extra, "kv_connector_extra_config", 0),
                     on_malformed, max_depth)


def _walk(entry: ConnectorEntry, on_malformed: OnMalformed,
          max_depth: int | None) -> Iterator[ConnectorEntry]:
    yield entry
    if entry.name != MULTI_CONNECTOR:
        return
    where, extra = entry.where, entry.extra
    if max_depth is not None and entry.depth >= max_depth:
        on_malformed(where, f"nests MultiConnector more than {max_depth} levels deep",
                     f"at most {max_depth} levels")
        return
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        on_malformed(where, f"of MultiConnector is a {type(extra).__name__}",
                     'an object {"connectors": [...]}')
        return
    children = extra.get("connectors", [])
    if children is None:
        children = []
    if not isinstance(children, list):
        on_malformed(f"{where}.connectors", f"is a {type(children).__name__}",
                     "a list of connector objects")
        return
    for index, child in enumerate(children):
        child_where = f"{where}.connectors[{index}]"
        if not isinstance(child, Mapping):
            on_malformed(child_where, f"is {child!r} ({type(child).__name__})",
                         'an object {"kv_connector": NAME, "kv_connector_extra_config": {...}}')
            continue
        name = child.get("kv_connector")
        if not isinstance(name, str) or not name:
            on_malformed(f"{child_where}.kv_connector", f"is {name!r}", "a connector name (string)")
        child_extra = child.get("kv_connector_extra_config")
        if child_extra is not None and not isinstance(child_extra, Mapping):
            on_malformed(f"{child_where}.kv_connector_extra_config",
                         f"is a {type(child_extra).__name__}", "an object or null")
        yield from _walk(ConnectorEntry(name, child_extra or {},
                                        f"{child_where}.kv_connector_extra_config",
                                        entry.depth + 1, index, child), on_malformed, max_depth)
