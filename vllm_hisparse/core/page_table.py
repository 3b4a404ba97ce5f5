"""Per-request page tables, stored as one set of ``[rows, pages]`` arrays.

Every request owns one *state row* (docs/design.md, "Layouts"). Its page table is row ``r``
of each array:

==================  ======  ====================================================================
array               dtype   meaning of ``[r, p]``
==================  ======  ====================================================================
``device_block``    int32   device block backing page ``p``; ``-1`` = not on the device
``pinned``          bool    the page holds a lease on ``device_block``; False with a block set
                            means *released*: readable until the pool reuses the block
``host_block``      int32   host block of page ``p``; ``-1`` = none
``host_mask``       uint64  ``[r, p, w]``: bit ``i`` of word ``w`` = row ``64 w + i`` of the page
                            is confirmed on the host (a completed mirror or spill)
``host_valid``      bool    every row of the page is on the host (the page is *clean*)
``pending``         int64   id of the spill or restore in flight for the page; ``-1`` = none
``mirror_inflight`` int16   number of open mirror transactions covering rows of the page
``mirror_failed``   bool    a mirror of this page failed: it needs a whole-page spill
==================  ======  ====================================================================

Per-row counters (kept incrementally so the policy never scans all pages):
``num_tokens`` (positions written or scheduled), ``num_pages``, ``num_pinned`` (pages
holding a device lease), ``num_clean_pinned`` (clean pages holding one), ``serial``
(incarnation of the request in the row; 0 = free row).

Using one array set, rather than one object per request, lets the per-step work of all
running requests run as a few vectorised numpy operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_hisparse.core.units import cdiv

_WORD_BITS = 64
_ALL_ONES = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
# _LOW_BITS[k] = the k lowest bits set (k = 0 .. 64): the word mask of rows [lo, hi) is
# _LOW_BITS[hi] & ~_LOW_BITS[lo], two table lookups instead of shifts and clips.
_LOW_BITS = np.array([(1 << k) - 1 for k in range(_WORD_BITS + 1)], dtype=np.uint64)


class PageTables:
    """The page tables of every state row, plus per-row counters."""

    def __init__(self, num_rows: int, max_pages_per_request: int, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_rows = int(num_rows)
        self.max_pages = int(max_pages_per_request)
        self.block_size = int(block_size)
        self.num_mask_words = cdiv(self.block_size, _WORD_BITS)
        shape = (self.num_rows, self.max_pages)
        self.device_block = np.full(shape, -1, dtype=np.int32)
        self.pinned = np.zeros(shape, dtype=bool)
        self.host_block = np.full(shape, -1, dtype=np.int32)
        self.host_mask = np.zeros(shape + (self.num_mask_words,), dtype=np.uint64)
        self.host_valid = np.zeros(shape, dtype=bool)
        self.pending = np.full(shape, -1, dtype=np.int64)
        self.mirror_inflight = np.zeros(shape, dtype=np.int16)
        self.mirror_failed = np.zeros(shape, dtype=bool)
        self.num_tokens = np.zeros(self.num_rows, dtype=np.int64)
        self.num_pages = np.zeros(self.num_rows, dtype=np.int64)
        self.num_pinned = np.zeros(self.num_rows, dtype=np.int64)
        self.num_clean_pinned = np.zeros(self.num_rows, dtype=np.int64)
        self.serial = np.zeros(self.num_rows, dtype=np.int64)
        # The mask a page has when all its rows are on the host.
        self.full_mask = range_mask(0, self.block_size, self.num_mask_words)
        # Flat views (same memory) indexed by ``row * max_pages + page``: one integer
        # index array is cheaper to gather and scatter through than a (rows, pages) pair.
        self.flat_pinned = self.pinned.reshape(-1)
        self.flat_host_mask = self.host_mask.reshape(-1, self.num_mask_words)
        self.flat_host_valid = self.host_valid.reshape(-1)
        self.flat_mirror_inflight = self.mirror_inflight.reshape(-1)
        self.flat_mirror_failed = self.mirror_failed.reshape(-1)
        # Page arithmetic on arrays: a shift when the block size is a power of two (integer
        # division is several times slower in numpy).
        bs = self.block_size
        self._page_shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else -1

    def page_of(self, positions: np.ndarray) -> np.ndarray:
        """Page index of each (non-negative) position."""
        if self._page_shift >= 0:
            return positions >> self._page_shift
        return positions // self.block_size

    def num_pages_for(self, num_tokens: np.ndarray) -> np.ndarray:
        """Pages needed to hold ``num_tokens`` positions (``cdiv``, arrays)."""
        if self._page_shift >= 0:
            return (num_tokens + (self.block_size - 1)) >> self._page_shift
        return cdiv(num_tokens, self.block_size)

    def flat_index(self, rows: np.ndarray, pages: np.ndarray) -> np.ndarray:
        """Index of ``[rows, pages]`` in the ``flat_*`` views."""
        return rows * self.max_pages + pages

    def reset_row(self, row: int) -> None:
        """Forget everything about ``row`` (its request ended)."""
        n = int(self.num_pages[row])
        self.device_block[row, :n] = -1
        self.pinned[row, :n] = False
        self.host_block[row, :n] = -1
        self.host_mask[row, :n] = 0
        self.host_valid[row, :n] = False
        self.pending[row, :n] = -1
        self.mirror_inflight[row, :n] = 0
        self.mirror_failed[row, :n] = False
        self.num_tokens[row] = 0
        self.num_pages[row] = 0
        self.num_pinned[row] = 0
        self.num_clean_pinned[row] = 0
        self.serial[row] = 0

    def rows_on_host(self, row: int, page: int) -> int:
        """Leading rows of the page confirmed on the host."""
        count = 0
        for word in self.host_mask[row, page]:
            word = int(word)
            if word == (1 << _WORD_BITS) - 1:
                count += _WORD_BITS
                continue
            # Number of trailing ones.
            count += ((word + 1) & ~word).bit_length() - 1
            break
        return min(count, self.block_size)

    def rows_written(self, row: int, page: int) -> int:
        """Rows of ``page`` holding written (or scheduled) KV."""
        return int(max(0, min(self.block_size, int(self.num_tokens[row]) - page * self.block_size)))

    def host_covers_written(self, row: int, page: int) -> bool:
        """True when the host has every written row of the page."""
        if self.host_valid[row, page]:
            return True
        return self.host_block[row, page] >= 0 and self.rows_on_host(row, page) >= self.rows_written(row, page)

    def view(self, row: int) -> "PageTable":
        """A copy of one row's page table (tests, debugging, metrics)."""
        n = int(self.num_pages[row])
        return PageTable(
            row=row,
            num_tokens=int(self.num_tokens[row]),
            device_blocks=self.device_block[row, :n].copy(),
            pinned=self.pinned[row, :n].copy(),
            host_blocks=self.host_block[row, :n].copy(),
            host_valid=self.host_valid[row, :n].copy(),
            pending=self.pending[row, :n].copy(),
        )


@dataclass
class PageTable:
    """A snapshot of one request's page table (length = its number of pages)."""

    row: int
    num_tokens: int
    device_blocks: np.ndarray
    pinned: np.ndarray
    host_blocks: np.ndarray
    host_valid: np.ndarray
    pending: np.ndarray

    @property
    def resident(self) -> np.ndarray:
        """Pages readable on the device (pinned, or released but not yet reused)."""
        return self.device_blocks >= 0

    @property
    def released(self) -> np.ndarray:
        """Pages whose device block was released but not yet reused."""
        return (self.device_blocks >= 0) & ~self.pinned


def releasable_mask(tables: PageTables, row: int, limit: int) -> np.ndarray:
    """Which of ``row``'s first ``limit`` pages may release their device lease now: pinned,
    clean (host-valid), no transfer pending and no mirror in flight. The one rule behind the
    release (``PageLeases.release_all_releasable``) and its prediction
    (``pressure.blocks_freed_by_release``)."""
    return (tables.pinned[row, :limit] & tables.host_valid[row, :limit]
            & (tables.pending[row, :limit] < 0) & (tables.mirror_inflight[row, :limit] == 0))


def range_mask(start: int, end: int, num_words: int) -> np.ndarray:
    """Bit mask (``num_words`` uint64 words) of page rows ``[start, end)``."""
    out = np.zeros(num_words, dtype=np.uint64)
    for w in range(num_words):
        lo = max(start, w * _WORD_BITS) - w * _WORD_BITS
        hi = min(end, (w + 1) * _WORD_BITS) - w * _WORD_BITS
        if hi > lo:
            out[w] = np.uint64(((1 << (hi - lo)) - 1) << lo)
    return out


def range_masks(starts: np.ndarray, ends: np.ndarray, num_words: int) -> np.ndarray:
    """Vectorised :func:`range_mask`: ``[n, num_words]`` masks of rows ``[starts, ends)``."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if num_words == 1:
        # Common case (block_size <= 64): no clipping needed once bounded to [0, 64].
        lo = np.minimum(np.maximum(starts, 0), _WORD_BITS)
        hi = np.minimum(np.maximum(ends, 0), _WORD_BITS)
        return (_LOW_BITS[hi] & ~_LOW_BITS[lo])[:, None]
    out = np.empty((starts.shape[0], num_words), dtype=np.uint64)
    for w in range(num_words):
        base = w * _WORD_BITS
        lo = np.minimum(np.maximum(starts - base, 0), _WORD_BITS)
        hi = np.minimum(np.maximum(ends - base, 0), _WORD_BITS)
        # hi <= lo gives 0: the bits below hi are all below lo.
        out[:, w] = _LOW_BITS[hi] & ~_LOW_BITS[lo]
    return out
