"""P/D imports: host blocks handed to an external writer, then activation.

An import fills an empty request from outside (a prefill instance's KV, read over the
network): :meth:`ImportLedger.begin` hands out host blocks for every page, the writer fills
them, and :meth:`ImportLedger.finish` makes them host-valid and activates the request (NONE),
or gives everything back when the transfer failed.

With the engine's tail blocks (``tail_device_blocks``: the engine allocated the last
``min(ACTIVE_TAIL_PAGES, pages)`` pages on the device and the writer fills them too), the
tail pages are pinned from the start and the hot region is leased at ``begin``, so that
``finish`` activates the request at once: no restore, nothing left to wait for.
"""

from __future__ import annotations

from typing import Sequence

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.errors import DevicePoolExhausted, HostPoolExhausted, ProtocolError
from vllm_hisparse.core.outcome import Outcome
from vllm_hisparse.core.page_leases import PageLeases
from vllm_hisparse.core.page_table import range_mask
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.request_table import Request, RequestStatus
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, cdiv


class ImportLedger:
    """``begin_import`` / ``finish_import`` of :class:`~vllm_hisparse.core.policy.ResidencyPolicy`."""

    def __init__(self, state: PolicyState, leases: PageLeases) -> None:
        self.state = state
        self.leases = leases

    def begin(self, req: Request, num_tokens: int, tail_device_blocks: Sequence[int] | None) -> list[int]:
        """See :meth:`ResidencyPolicy.begin_import`; returns the host block of every page."""
        t = self.state.tables
        request_id = req.request_id
        if req.status != RequestStatus.ACTIVE or t.num_tokens[req.row] != 0:
            raise ProtocolError(f"request {request_id!r}: import must start on an empty request")
        num_pages = cdiv(num_tokens, self.state.block_size)
        if num_pages > self.state.config.max_pages_per_request:
            raise ProtocolError(f"import of {num_tokens} tokens exceeds max_pages_per_request")
        tail = None
        if tail_device_blocks is not None:
            tail = [int(b) for b in tail_device_blocks]
            expected = min(ACTIVE_TAIL_PAGES, num_pages)
            if len(tail) != expected:
                raise ProtocolError(f"request {request_id!r}: {len(tail)} tail device blocks for an "
                                    f"import of {num_pages} pages (expected {expected})")
            free = self.state.device_pool.get_num_free_blocks()
            if req.hot_blocks > free:
                self.state.stats.num_device_backpressure += 1
                raise DevicePoolExhausted(f"request {request_id!r}: no room for a hot region of "
                                          f"{req.hot_blocks} blocks", req.hot_blocks, free)
        try:
            host = self.state.host_pool.allocate(num_pages)
        except HostPoolExhausted:
            self.state.stats.num_host_backpressure += 1
            raise
        row = req.row
        t.host_block[row, :num_pages] = host
        t.num_pages[row] = num_pages
        t.num_tokens[row] = num_tokens
        if tail is not None:
            first = num_pages - len(tail)
            t.device_block[row, first:num_pages] = tail
            t.pinned[row, first:num_pages] = True
            t.num_pinned[row] = len(tail)
            self.leases.lease_hot(req)
            self.state.requests.set_residency(req, Residency.NONE)
        self.state.requests.set_status(req, RequestStatus.IMPORTING)
        return list(host)

    def finish(self, req: Request, success: bool) -> Outcome | None:
        """See :meth:`ResidencyPolicy.finish_import`. ``None``: the pages are valid and the
        request is PARKED, NONE: the caller resumes it (an import without tail blocks)."""
        if req.status != RequestStatus.IMPORTING:
            raise ProtocolError(f"request {req.request_id!r} is not importing")
        row = req.row
        t = self.state.tables
        num_pages = int(t.num_pages[row])
        if not success:
            self.state.host_pool.free(int(b) for b in t.host_block[row, :num_pages])
            t.host_block[row, :num_pages] = -1
            t.device_block[row, :num_pages] = -1  # the engine's tail blocks stay the engine's
            t.pinned[row, :num_pages] = False
            t.num_pinned[row] = 0
            t.num_pages[row] = 0
            t.num_tokens[row] = 0
            self.leases.drop_hot_lease(req)
            self.state.requests.set_residency(req, Residency.FULL, emit=False)
            self.state.requests.set_status(req, RequestStatus.ACTIVE)
            return Outcome.RECOMPUTE
        engine_tail = int(t.num_pinned[row]) > 0
        for page in range(num_pages):
            written = t.rows_written(row, page)
            t.host_mask[row, page] = range_mask(0, written, t.num_mask_words)
            if written == self.state.block_size:
                self.leases.mark_clean(req, page)
            self.state.steps.emit_page(row, page, int(t.device_block[row, page]), int(t.host_block[row, page]))
        if engine_tail:
            self.state.requests.set_status(req, RequestStatus.ACTIVE)
            return Outcome.OK
        self.state.requests.set_status(req, RequestStatus.PARKED)
        self.state.requests.set_residency(req, Residency.NONE)
        return None
