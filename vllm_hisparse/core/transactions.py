"""Two-phase transfer transactions and their lease bookkeeping.

Life of a transaction::

    PLANNED --enqueued--> ENQUEUED --completed--> (done: host copy valid / page resident)
       |                     |
       +------completed------+  (completed without enqueued implies both)
       +------failed---------+--> (done: nothing marked valid, leases returned)

A transaction *holds leases* on what it reads and writes so that neither side is
reused under it, even if the request that planned it ends:

* ``held_device_until_enqueued``: a spill's source blocks. Once the copy is on the
  worker's stream, later stream work may reuse them (stream order protects the read).
* ``held_device_until_done`` / ``held_host_until_done``: a spill's destination host
  blocks, a restore's source host and destination device blocks, and the pages of a
  mirror whose request ended while the mirror was in flight.

Completion handlers live in the policy; this module only stores and validates phases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Hashable

import numpy as np

from vllm_hisparse.core.commands import TransferKind
from vllm_hisparse.core.errors import ProtocolError


class TransferPhase(IntEnum):
    """Where a transaction is in its life."""

    PLANNED = 0
    ENQUEUED = 1


_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class Transaction:
    """A planned transfer and everything the policy needs when it finishes.

    Page transactions (SPILL, RESTORE) fill ``rows``/``pages``/``serials`` with one entry
    per page plus the block ids; MIRROR fills ``rows``/``pages``/``serials``/``starts``/
    ``ends`` with one entry per page a scheduled request wrote (rows ``[starts, ends)`` of
    that page), and ``flat`` with the index of ``[row, page]`` in the page tables' flat
    views. ``serials`` identify the request incarnation owning the row when the transfer
    was planned: a row reused by a later request never receives an older request's
    completion.
    """

    transfer_id: int
    kind: TransferKind
    step_id: int
    rows: np.ndarray = field(default_factory=lambda: _EMPTY)
    serials: np.ndarray = field(default_factory=lambda: _EMPTY)
    pages: np.ndarray = field(default_factory=lambda: _EMPTY)
    device_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)
    host_blocks: np.ndarray = field(default_factory=lambda: _EMPTY)
    num_rows_copied: np.ndarray = field(default_factory=lambda: _EMPTY)
    starts: np.ndarray = field(default_factory=lambda: _EMPTY)
    ends: np.ndarray = field(default_factory=lambda: _EMPTY)
    flat: np.ndarray = field(default_factory=lambda: _EMPTY)
    # MIRROR: no (row, page) appears twice, so plain fancy-index updates are exact
    # (otherwise the slower unbuffered ``np.ufunc.at`` is needed).
    unique_pages: bool = False
    phase: TransferPhase = TransferPhase.PLANNED
    held_device_until_enqueued: list[int] = field(default_factory=list)
    held_device_until_done: list[int] = field(default_factory=list)
    held_host_until_done: list[int] = field(default_factory=list)
    # Pages of ended requests to publish on completion: host block -> block hash.
    publish_on_completion: dict[int, Hashable] = field(default_factory=dict)
    # RESTORE into pages the engine already allocated and pinned (a host-prefix load):
    # completion only clears ``pending``; the page owns its device block throughout.
    into_pinned: bool = False


class TransactionTable:
    """Open transactions by id, with phase validation.

    Ids are issued in increasing order and never reused.
    """

    def __init__(self) -> None:
        self._open: dict[int, Transaction] = {}
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._open)

    def __contains__(self, transfer_id: int) -> bool:
        return transfer_id in self._open

    def open(self, kind: TransferKind, step_id: int, **fields) -> Transaction:
        """Create a PLANNED transaction with a fresh id."""
        txn = Transaction(transfer_id=self._next_id, kind=kind, step_id=step_id, **fields)
        self._next_id += 1
        self._open[txn.transfer_id] = txn
        return txn

    def get(self, transfer_id: int) -> Transaction:
        """The open transaction ``transfer_id``; ``ProtocolError`` if unknown or finished."""
        txn = self._open.get(transfer_id)
        if txn is None:
            raise ProtocolError(f"transfer {transfer_id} is unknown or already finished")
        return txn

    def mark_enqueued(self, transfer_id: int) -> Transaction | None:
        """PLANNED → ENQUEUED. Returns the transaction, or None if it already was enqueued."""
        txn = self.get(transfer_id)
        if txn.phase == TransferPhase.ENQUEUED:
            raise ProtocolError(f"transfer {transfer_id} reported enqueued twice")
        txn.phase = TransferPhase.ENQUEUED
        return txn

    def close(self, transfer_id: int) -> Transaction:
        """Remove a transaction that completed or failed."""
        txn = self.get(transfer_id)
        del self._open[transfer_id]
        return txn

    def values(self):
        """Open transactions in id order."""
        return self._open.values()
