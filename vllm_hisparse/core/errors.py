"""Errors raised by the residency core.

Two families:

* :class:`BackPressure` and its subclasses are *expected* outcomes under load (a pool is
  full). Callers catch them and make the request wait; they never mean lost KV.
* :class:`ProtocolError` means a caller broke a contract (an unknown transfer id, an
  acknowledgement in an order the transaction rules forbid, an event for a request the
  core does not know). It is a bug in the caller, so it is raised loudly.
"""

from __future__ import annotations


class HiSparseCoreError(Exception):
    """Base class of every error raised by ``vllm_hisparse.core``."""


class BackPressure(HiSparseCoreError):
    """A pool cannot satisfy a request right now; retry after capacity returns.

    Attributes:
        num_requested: blocks asked for.
        num_available: blocks that could have been handed out.
    """

    def __init__(self, message: str, num_requested: int = 0, num_available: int = 0):
        super().__init__(message)
        self.num_requested = num_requested
        self.num_available = num_available


class HostPoolExhausted(BackPressure):
    """The pinned host pool has too few free or evictable blocks."""


class DevicePoolExhausted(BackPressure):
    """The device (GPU) block pool has too few free blocks."""


class ProtocolError(HiSparseCoreError):
    """A caller violated the core's API contract (a bug, never load)."""
