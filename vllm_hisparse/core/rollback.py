"""Rolling back positions a step wrote and the engine then discarded (rejected drafts).

Speculative decoding schedules ``1 + k`` tokens of a request per step: its last sampled
token and ``k`` draft tokens. The forward writes the KV of all of them; verification keeps
the first ``a`` drafts and the engine moves the request's length back to ``start + 1 + a``.
The rows of the ``k - a`` rejected positions hold KV of tokens the request never had, and
the next step writes the same positions again with the right tokens.

The policy counted the rejected positions as written (``num_tokens``) and the step's
MIRROR copies them to the host. If nothing else happened, that MIRROR's completion would
mark those host rows valid: the page could turn clean, be released while outside the tail
(``k + 1`` larger than a page, B7 in the reference map) and later be read from the host
with the rejected KV in it. :func:`roll_back_rows` therefore, before the acks of that
step are applied:

* moves ``num_tokens`` back (pages already adopted past the new length stay with the
  request: the engine keeps their blocks, and the next steps write into them);
* clears the host bits of every rolled-back position, so a page holding one is not clean;
* clips every open MIRROR and SPILL of those rows to the positions kept, so a copy
  completing later never marks a rolled-back position valid. The rewrite's own MIRROR is
  planned later and lands later on the worker's ordered stream, so the host row ends
  with the right KV and only that MIRROR marks it valid.

A page whose prefix identity is known never holds a rolled-back position (the engine
hashes only finalized tokens); a rollback into one is a protocol error.
"""

from __future__ import annotations

import numpy as np

from vllm_hisparse.core.commands import TransferKind
from vllm_hisparse.core.errors import ProtocolError
from vllm_hisparse.core.page_table import PageTables, range_masks
from vllm_hisparse.core.request_table import RequestStatus, RequestTable
from vllm_hisparse.core.transactions import TransactionTable


def roll_back_rows(tables: PageTables, requests: RequestTable, txns: TransactionTable,
                   rows: np.ndarray, num_tokens: np.ndarray) -> int:
    """Cut the written length of ``rows`` back to ``num_tokens`` (module docstring).

    Args:
        rows: int64 ``[n]`` distinct state rows of ACTIVE requests.
        num_tokens: int64 ``[n]`` new lengths, each at most the row's current length.

    Returns:
        The number of positions rolled back (0 when every length was already right).

    Raises:
        ProtocolError: a row that is free, not ACTIVE, a length above the current one or
            negative, or a rolled-back position on a page whose identity is known. Nothing
            is changed then.
    """
    t = tables
    rows = np.asarray(rows, dtype=np.int64)
    ends = np.asarray(num_tokens, dtype=np.int64)
    if rows.shape != ends.shape:
        raise ProtocolError(f"roll back: {rows.shape[0]} rows but {ends.shape[0]} lengths")
    if rows.shape[0] == 0:
        return 0
    if np.unique(rows).shape[0] != rows.shape[0]:
        raise ProtocolError("roll back: a state row is listed twice")
    old = t.num_tokens[rows]
    cut = ends < old
    if np.count_nonzero(cut) == 0:
        if np.any(ends > old) or np.any(ends < 0):
            raise ProtocolError("roll back: a length above the written one")
        return 0
    bad = (ends > old) | (ends < 0) | (requests.status[rows] != RequestStatus.ACTIVE)
    if np.any(bad):
        i = int(np.nonzero(bad)[0][0])
        raise ProtocolError(
            f"roll back of row {int(rows[i])} to {int(ends[i])} tokens (written: {int(old[i])}, "
            f"status {int(requests.status[rows[i]])}): needs an ACTIVE request and a length "
            "between 0 and the written one")
    rows, ends, old = rows[cut], ends[cut], old[cut]
    bs = t.block_size
    # Every (row, page) holding a rolled-back position: pages page_of(end) .. page_of(old - 1).
    first = t.page_of(ends)
    span = t.page_of(old - 1) - first + 1
    pr = np.repeat(rows, span)
    pp = np.repeat(first, span) + (np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span))
    keep = np.maximum(np.repeat(ends, span) - pp * bs, 0)  # rows of the page that stay valid
    _check_no_identity(requests, pr, pp)
    flat = t.flat_index(pr, pp)
    t.flat_host_mask[flat] &= range_masks(np.zeros_like(keep), keep, t.num_mask_words)
    was_clean = t.flat_host_valid[flat]
    if np.count_nonzero(was_clean):
        t.flat_host_valid[flat] = False
        np.subtract.at(t.num_clean_pinned, pr, (was_clean & t.flat_pinned[flat]).astype(np.int64))
    t.num_tokens[rows] = ends
    _clip_open_copies(t, txns, rows, ends)
    return int((old - ends).sum())


def _check_no_identity(requests: RequestTable, rows: np.ndarray, pages: np.ndarray) -> None:
    for row, page in zip(rows.tolist(), pages.tolist()):
        req = requests.at(row)
        if req is not None and req.hash_of(page) is not None:
            raise ProtocolError(
                f"roll back into page {page} of request {req.request_id!r}, whose prefix "
                "identity is known (only finalized tokens are hashed)")


def _clip_open_copies(t: PageTables, txns: TransactionTable, rows: np.ndarray, ends: np.ndarray) -> None:
    """Open MIRRORs and SPILLs of ``rows`` copy at most the kept positions on completion."""
    limit = np.full(t.num_rows, np.iinfo(np.int64).max, dtype=np.int64)
    limit[rows] = ends
    bs = t.block_size
    for txn in txns.values():
        if txn.kind not in (TransferKind.MIRROR, TransferKind.SPILL) or txn.rows.shape[0] == 0:
            continue
        hit = (limit[txn.rows] < np.iinfo(np.int64).max) & (t.serial[txn.rows] == txn.serials)
        if np.count_nonzero(hit) == 0:
            continue
        kept = np.maximum(limit[txn.rows] - txn.pages * bs, 0)
        if txn.kind == TransferKind.MIRROR:
            # Arrays may be shared with the step record: write a clipped copy.
            txn.ends = np.where(hit, np.maximum(np.minimum(txn.ends, kept), txn.starts), txn.ends)
        else:
            txn.num_rows_copied = np.where(hit, np.minimum(txn.num_rows_copied, kept),
                                           txn.num_rows_copied)
