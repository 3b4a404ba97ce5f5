"""Errors raised by the data-plane ops.

The reference twins raise :class:`ResolveError` at once. The CUDA kernels cannot raise,
so they record the first error of a launch as four int32 words
``(code, state_row, detail_a, detail_b)`` in a device buffer; the wrapper turns that record
into the same exception later, without a per-step host sync (see ``ops/cuda.py``).
The codes are shared by both so that a message reads the same whichever backend ran.

:class:`OpInputError` and its subclasses name every other bad input of any op (the argument,
the offending index and value); they are raised on the host before anything is launched.
"""

from __future__ import annotations

import enum


class ResolveErrorCode(enum.IntEnum):
    """Error codes of ``resolve`` (docs/design.md, "resolve": its error table, plus the preconditions it relies on).

    ``detail_a``/``detail_b`` of a device record carry the values named in brackets.
    """

    OK = 0
    POSITION_OUT_OF_RANGE = 1  # [position, num_positions = P * block_size]
    NO_HOST_BLOCK = 2  # a host-backed page has host block -1 [position, page]
    HOT_OVERFLOW = 3  # more distinct host-backed positions than leased hot slots
    #                   [num_host_backed, leased slots: D less bs per hot block of -1]
    NOT_CONTIGUOUS = 4  # tokens of one request are not contiguous [token, first token]
    HOT_BLOCK_MISSING = 5  # a position hits a slot whose hot block is -1 [slot, position]
    DUPLICATE_SLOT = 6  # one host-backed position is held by two hot slots [position, slot]
    STATE_ROW_OUT_OF_RANGE = 7  # token_rows value outside [-1, R) [state_row, R]
    # Raised by the CUDA kernel only (limits and state checks the reference cannot hit):
    UNION_CAPACITY = 8  # a request's selections overflow the kernel's shared-memory hash
    #                     [selections of the request, hash capacity]; see ops/cuda.py
    CORRUPT_LRU = 9  # lru holds a value outside [0, D) [value, D]
    # Raised by the reference, and by the CUDA backend's debug checks (HISPARSE_CHECK_INPUTS=1):
    DUPLICATE_LRU_SLOT = 10  # lru holds a slot twice, so it is no permutation [slot, D]


_TEMPLATES = {
    ResolveErrorCode.POSITION_OUT_OF_RANGE:
        "top-k position {a} is outside [0, {b}) (P * block_size) for state row {row}",
    ResolveErrorCode.NO_HOST_BLOCK:
        "position {a} of state row {row} is on page {b}, which is neither resident nor "
        "backed by a host block (host_blocks == -1)",
    ResolveErrorCode.HOT_OVERFLOW:
        "state row {row} selects {a} distinct host-backed positions, more than its hot "
        "region holds ({b} leased slots)",
    ResolveErrorCode.NOT_CONTIGUOUS:
        "tokens of state row {row} are not contiguous: token {a} follows another request "
        "after token {b}",
    ResolveErrorCode.HOT_BLOCK_MISSING:
        "state row {row} hits hot slot {a} (position {b}) but its hot block is -1: a slot "
        "outside the leased hot blocks must be empty (hot state is corrupt)",
    ResolveErrorCode.DUPLICATE_SLOT:
        "slot_pos of state row {row} holds position {a} in more than one slot (slot {b} "
        "is one): hot state is corrupt",
    ResolveErrorCode.STATE_ROW_OUT_OF_RANGE:
        "token_rows holds state row {a}, outside [-1, {b})",
    ResolveErrorCode.UNION_CAPACITY:
        "state row {row} has {a} selections whose distinct positions overflow the CUDA "
        "kernel's hash of {b} entries; raise max_tokens_per_request of the ops backend "
        "(vllm_hisparse.ops.select(..., max_tokens_per_request=N)) to the largest number of "
        "query tokens per request",
    ResolveErrorCode.CORRUPT_LRU:
        "lru of state row {row} holds {a}, outside [0, {b}): hot state is corrupt",
    ResolveErrorCode.DUPLICATE_LRU_SLOT:
        "lru of state row {row} holds slot {a} more than once, so it is not a permutation "
        "of its {b} hot slots: hot state is corrupt",
}


class ResolveError(ValueError):
    """``resolve`` was given inputs that break its contract.

    Attributes: ``code`` (:class:`ResolveErrorCode`), ``state_row`` (-1 when unknown) and the
    two detail values of the record.
    """

    def __init__(self, code: int, state_row: int, detail_a: int, detail_b: int):
        self.code = ResolveErrorCode(code)
        self.state_row = int(state_row)
        self.detail_a = int(detail_a)
        self.detail_b = int(detail_b)
        text = _TEMPLATES[self.code].format(a=detail_a, b=detail_b, row=state_row)
        super().__init__(f"resolve: {text} [{self.code.name}]")


class OpInputError(ValueError):
    """An op argument breaks its contract in a way the metadata checks name precisely.

    Attributes: ``argument`` (the parameter's name, e.g. ``"residency"`` or
    ``"dst_layers[2]"``), ``index`` (a tuple into that argument, empty when the whole tensor is
    meant) and ``value`` (the offending value, or None).
    """

    def __init__(self, argument: str, message: str, index: tuple[int, ...] = (),
                 value: int | None = None):
        self.argument = argument
        self.index = tuple(int(i) for i in index)
        self.value = None if value is None else int(value)
        super().__init__(message)


class NegativeIdError(OpInputError):
    """An id tensor holds a negative value other than the ``-1`` sentinel."""


class RowOverflowError(OpInputError):
    """A block id whose rows (``block * block_size + offset``) do not fit int32."""


class DuplicateDestinationError(OpInputError):
    """Two entries of one copy write the same destination row or block."""


class AliasedOutputError(OpInputError):
    """An output (or IN/OUT) tensor shares memory with another argument."""


class MetaTensorError(OpInputError):
    """A tensor on the ``meta`` device, which holds no data to read or write."""
