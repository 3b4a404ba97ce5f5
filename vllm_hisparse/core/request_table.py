"""The requests the policy knows: one record per request, indexed by id and by state row.

A :class:`Request` carries its scheduling status, residency and prefill flag; the
:class:`RequestTable` mirrors those into per-row numpy vectors so that pressure selection
and the batched schedule run as array passes. The table is the only writer of both (the
record's mirrored fields are read-only properties), so the two can never disagree.

Per-row vectors (``[max_num_rows]``; free rows hold the values in brackets):

==================  =====  ==============================================================
vector              dtype  meaning of ``[r]``
==================  =====  ==============================================================
``status``          int8   :class:`RequestStatus` of the row's request (-1)
``residency``       int8   :class:`Residency` (-1)
``hot_blocks``      int64  hot region size in device blocks (0)
``last_transition`` int64  step of the last residency change or promotion start (-10**9)
``watch``           bool   PARKED or MIXED/NONE: mirror acks may release pages (False)
``prefilling``      bool   prompt not fully computed, requirement R1 (False)
``gate``            bool   ``schedule_rows`` sends the row through the per-request path:
                           not ACTIVE, or prefilling and not FULL (True)
==================  =====  ==============================================================
"""

from __future__ import annotations

from collections.abc import Set
from enum import IntEnum
from typing import AbstractSet, Hashable, Iterator, Sequence

import numpy as np

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.errors import ProtocolError
from vllm_hisparse.core.step_builder import StepBuilder

_NEVER = -(10**9)
"""``last_transition`` of a request that never changed residency."""


class RequestStatus(IntEnum):
    """Scheduling status of a request known to the policy."""

    ACTIVE = 0
    ACTIVATING = 1
    PARKED = 2
    IMPORTING = 3


class Request:
    """One request known to the policy.

    ``status``, ``residency``, ``prefilling``, ``hot_blocks`` and ``last_transition_step``
    are mirrored in the :class:`RequestTable`'s row vectors and change only through it.
    The other fields belong to whoever drives the request's pages and transfers.
    """

    __slots__ = (
        "request_id", "row", "serial", "_status", "_residency", "_hot_blocks", "_prefilling",
        "_last_transition_step", "block_hashes", "hot_block_ids", "promoting",
        "num_restores_inflight", "needs_tail_restore_retry",
    )

    def __init__(self, request_id: str, row: int, serial: int, hot_blocks: int,
                 block_hashes: list, prefilling: bool) -> None:
        self.request_id = request_id
        self.row = row
        self.serial = serial
        self._status = RequestStatus.ACTIVE
        self._residency = Residency.FULL
        self._hot_blocks = hot_blocks
        self._prefilling = prefilling
        self._last_transition_step = _NEVER
        self.block_hashes: list[Hashable | None] = block_hashes
        """Prefix identity of each page (``None`` = unknown); may be shorter than the pages."""
        self.hot_block_ids: list[int] = []
        """Device blocks of the hot region lease (empty when none is held)."""
        self.promoting = False
        """A MIXED/NONE → FULL promotion is under way."""
        self.num_restores_inflight = 0
        """Pages of this request whose RESTORE into a new device block is in flight."""
        self.needs_tail_restore_retry = False
        """An activation's tail restore failed and must be planned again."""

    @property
    def status(self) -> RequestStatus:
        return self._status

    @property
    def residency(self) -> Residency:
        return self._residency

    @property
    def hot_blocks(self) -> int:
        """Device blocks of this request's hot region lease when it holds one."""
        return self._hot_blocks

    @property
    def prefilling(self) -> bool:
        """What the engine last said with ``set_prefilling`` (requirement R1)."""
        return self._prefilling

    @property
    def last_transition_step(self) -> int:
        return self._last_transition_step

    def hash_of(self, page: int) -> Hashable | None:
        """Prefix identity of ``page`` (``None`` when unknown)."""
        return self.block_hashes[page] if page < len(self.block_hashes) else None


class _SetView(Set):
    """A live, read-only view of a set (no copy; it follows the set's changes)."""

    __slots__ = ("_items",)

    def __init__(self, items: set) -> None:
        self._items = items

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._items!r})"


class RequestTable:
    """Requests by id and by state row, their row vectors, and the free rows.

    Residency changes are reported to the step (``ResidencyChange``) through ``steps``.
    """

    def __init__(self, num_rows: int, steps: StepBuilder) -> None:
        self.num_rows = int(num_rows)
        self._steps = steps
        self._by_id: dict[str, Request] = {}
        self._by_row: list[Request | None] = [None] * self.num_rows
        self._free_rows: list[int] = list(range(self.num_rows - 1, -1, -1))
        self._next_serial = 1
        n = self.num_rows
        self.status = np.full(n, -1, dtype=np.int8)
        self.residency = np.full(n, -1, dtype=np.int8)
        self.hot_blocks = np.zeros(n, dtype=np.int64)
        self.last_transition = np.full(n, _NEVER, dtype=np.int64)
        self.watch = np.zeros(n, dtype=bool)
        self.prefilling = np.zeros(n, dtype=bool)
        self.gate = np.ones(n, dtype=bool)
        self._non_full: set[int] = set()
        self.non_full_rows: AbstractSet[int] = _SetView(self._non_full)
        """Rows whose request is MIXED or NONE (any status): a live read-only view."""

    # -- lookup -----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def get(self, request_id: str) -> Request:
        """The request ``request_id``; ``ProtocolError`` when unknown."""
        req = self._by_id.get(request_id)
        if req is None:
            raise ProtocolError(f"unknown request {request_id!r}")
        return req

    def find(self, request_id: str) -> Request | None:
        """The request ``request_id``, or None."""
        return self._by_id.get(request_id)

    def at(self, row: int) -> Request | None:
        """The request in state row ``row`` (None for a free row)."""
        return self._by_row[row]

    def values(self):
        """Every request, in insertion order."""
        return self._by_id.values()

    def ids(self) -> list[str]:
        """Ids of every request."""
        return list(self._by_id)

    # -- life -------------------------------------------------------------------------
    def add(self, request_id: str, *, state_row: int | None, hot_blocks: int,
            block_hashes: Sequence[Hashable], prefilling: bool) -> Request:
        """Register an ACTIVE FULL request in ``state_row`` (None = any free row)."""
        if request_id in self._by_id:
            raise ProtocolError(f"request {request_id!r} added twice")
        row = self._take_row(state_row)
        req = Request(request_id, row, self._next_serial, hot_blocks, list(block_hashes), bool(prefilling))
        self._next_serial += 1
        self._by_id[request_id] = req
        self._by_row[row] = req
        self.status[row] = RequestStatus.ACTIVE
        self.residency[row] = Residency.FULL
        self.hot_blocks[row] = hot_blocks
        self.prefilling[row] = req.prefilling
        self.watch[row] = False
        self.gate[row] = False
        return req

    def set_hot_blocks(self, req: Request, num_blocks: int) -> None:
        """The request's hot region is resized to ``num_blocks`` device blocks."""
        req._hot_blocks = int(num_blocks)
        self.hot_blocks[req.row] = int(num_blocks)

    def remove(self, req: Request) -> None:
        """Forget an ended request and free its row."""
        row = req.row
        self.status[row] = -1
        self.residency[row] = -1
        self.watch[row] = False
        self.hot_blocks[row] = 0
        self.last_transition[row] = _NEVER
        self.prefilling[row] = False
        self.gate[row] = True
        self._non_full.discard(row)
        self._by_row[row] = None
        self._free_rows.append(row)
        del self._by_id[req.request_id]

    def _take_row(self, state_row: int | None) -> int:
        if state_row is None:
            if not self._free_rows:
                raise ProtocolError("no free state row")
            return self._free_rows.pop()
        if not 0 <= state_row < self.num_rows or self._by_row[state_row] is not None:
            raise ProtocolError(f"state row {state_row} is out of range or in use")
        self._free_rows.remove(state_row)
        return state_row

    # -- state changes ----------------------------------------------------------------
    def set_status(self, req: Request, status: RequestStatus) -> None:
        req._status = status
        self.status[req.row] = status
        self._update_flags(req)

    def set_residency(self, req: Request, residency: Residency, emit: bool = True) -> None:
        """Change residency; ``emit`` reports it in this step's command (even unchanged)."""
        if req.residency != residency:
            self.mark_transition(req)
        req._residency = residency
        self.residency[req.row] = residency
        self._update_flags(req)
        if residency == Residency.FULL:
            self._non_full.discard(req.row)
        else:
            self._non_full.add(req.row)
        if emit:
            self._steps.emit_residency(req.request_id, req.row, residency)

    def set_prefilling(self, req: Request, prefilling: bool) -> None:
        req._prefilling = prefilling
        self.prefilling[req.row] = prefilling
        self._update_flags(req)

    def mark_transition(self, req: Request) -> None:
        """The request changed state this step (starts its cooldown)."""
        req._last_transition_step = self._steps.step_id
        self.last_transition[req.row] = self._steps.step_id

    def _update_flags(self, req: Request) -> None:
        row = req.row
        self.watch[row] = req.status == RequestStatus.PARKED or req.residency != Residency.FULL
        self.gate[row] = req.status != RequestStatus.ACTIVE or (
            req.prefilling and req.residency != Residency.FULL
        )
