"""What an event that may meet back-pressure answers."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Outcome(IntEnum):
    """Result of an event that may meet back-pressure."""

    OK = 0
    WAIT_DEVICE = 1
    """Not enough free device blocks; nothing changed. Retry later (or preempt someone)."""
    WAIT_HOST = 2
    """Not enough free or evictable host blocks; nothing changed. The request waits."""
    WAIT_TRANSFER = 3
    """The request is not schedulable until restores in flight complete."""
    RECOMPUTE = 4
    """An import failed; the request starts from zero tokens and must be computed."""


@dataclass
class AddResult:
    """What ``add_request`` decided."""

    row: int
    num_host_hit_tokens: int
    outcome: Outcome
