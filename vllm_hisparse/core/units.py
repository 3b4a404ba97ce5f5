"""The few constants and unit helpers every layer shares (one definition each)."""

from __future__ import annotations

GIB = 1 << 30
"""Bytes in a GiB."""

ACTIVE_TAIL_PAGES = 2
"""The last pages of a running request that are never released (new KV is written there,
and an in-flight step may still read them)."""


def cdiv(a, b):
    """Ceiling division for ints and int arrays."""
    return -(-a // b)
