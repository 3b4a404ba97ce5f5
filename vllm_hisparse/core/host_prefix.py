"""Prefix sharing through the host pool: hits on published pages, adoption, identities.

A page is *published* (given its prefix identity in the host pool) once it has an identity
and is clean, so a later request with the same prefix may take its host block over instead
of computing it. Two ways in:

* a **host hit** (``add_request`` with block hashes): the request takes the published blocks
  over and starts host-backed (NONE), like a resume;
* an **adoption** (``acquire`` then ``adopt``): the engine allocated device blocks for the
  prefix and the policy loads the pages into them with one RESTORE; the request is FULL.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.errors import ProtocolError
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.request_table import Request, RequestStatus
from vllm_hisparse.core.transfer_planner import TransferPlanner


class HostPrefixes:
    """Host prefix hits, leases on them, their adoption and the pages' identities."""

    def __init__(self, state: PolicyState, planner: TransferPlanner) -> None:
        self.state = state
        self.planner = planner

    def lookup(self, block_hashes: Sequence[Hashable], max_pages: int | None = None) -> list[int]:
        """Host blocks of the longest published prefix (at most ``max_pages``; no lease)."""
        limit = self.state.config.max_pages_per_request
        if max_pages is not None:
            limit = min(limit, max(0, int(max_pages)))
        return self.state.host_pool.lookup(block_hashes[:limit])

    def acquire(self, block_hashes: Sequence[Hashable], max_pages: int | None) -> list[int]:
        """:meth:`lookup`, taking one lease on each block."""
        hits = self.lookup(block_hashes, max_pages)
        if hits:
            self.state.host_pool.touch(hits)
        return hits

    def take_over_hits(self, req: Request) -> int:
        """A new request takes over the published prefix of its block hashes: its pages
        are host-backed, the request is PARKED and NONE. Returns the number of pages."""
        hits = self.acquire(req.block_hashes, None)
        if not hits:
            return 0
        t = self.state.tables
        row = req.row
        k = len(hits)
        t.host_block[row, :k] = hits
        t.host_mask[row, :k] = t.full_mask
        t.host_valid[row, :k] = True
        t.num_pages[row] = k
        t.num_tokens[row] = k * t.block_size
        for page, host_block in enumerate(hits):
            self.state.steps.emit_page(row, page, -1, host_block)
        self.state.stats.num_host_prefix_hit_pages += k
        self.state.requests.set_status(req, RequestStatus.PARKED)
        self.state.requests.set_residency(req, Residency.NONE)
        return k

    def adopt(self, req: Request, device_block_ids: Sequence[int], host_block_ids: Sequence[int],
              first_load_page: int) -> int:
        """See :meth:`ResidencyPolicy.adopt_host_prefix`; returns the RESTORE's id or -1."""
        t = self.state.tables
        row = req.row
        request_id = req.request_id
        n = len(device_block_ids)
        if req.status != RequestStatus.ACTIVE or req.residency != Residency.FULL or t.num_tokens[row] != 0:
            raise ProtocolError(f"request {request_id!r}: a host prefix is adopted by a new, empty request")
        if len(host_block_ids) != n or not 0 <= first_load_page <= n:
            raise ProtocolError(
                f"request {request_id!r}: {n} device blocks, {len(host_block_ids)} host blocks and "
                f"first load page {first_load_page} do not describe one prefix"
            )
        if n > self.state.config.max_pages_per_request:
            raise ProtocolError(f"request {request_id!r}: prefix of {n} pages exceeds max_pages_per_request")
        if n == 0:
            return -1
        device = [int(b) for b in device_block_ids]
        host = [int(b) for b in host_block_ids]
        t.device_block[row, :n] = device
        t.pinned[row, :n] = True
        t.num_pinned[row] = n
        t.host_block[row, :n] = host
        t.host_mask[row, :n] = t.full_mask
        t.host_valid[row, :n] = True
        t.num_clean_pinned[row] = n
        t.num_pages[row] = n
        t.num_tokens[row] = n * t.block_size
        for page in range(n):
            self.state.steps.emit_page(row, page, device[page], host[page])
        pages = list(range(first_load_page, n))
        if not pages:
            return -1
        txn = self.planner.open_restore(req, pages, device[first_load_page:], host[first_load_page:],
                                        into_pinned=True)
        self.state.stats.num_prefix_load_pages += len(pages)
        return txn.transfer_id

    def set_block_hashes(self, req: Request, first_page: int, block_hashes: Sequence[Hashable | None]) -> int:
        """See :meth:`ResidencyPolicy.set_block_hashes`; returns the pages published."""
        end = int(first_page) + len(block_hashes)
        if first_page < 0 or end > self.state.config.max_pages_per_request:
            raise ProtocolError(f"request {req.request_id!r}: block hashes for pages [{first_page}, {end})")
        if len(req.block_hashes) < end:
            req.block_hashes.extend([None] * (end - len(req.block_hashes)))
        t = self.state.tables
        row = req.row
        published = 0
        for i, block_hash in enumerate(block_hashes):
            page = int(first_page) + i
            req.block_hashes[page] = block_hash
            if block_hash is None or page >= t.num_pages[row] or not t.host_valid[row, page]:
                continue
            if self.state.host_pool.publish(int(t.host_block[row, page]), block_hash):
                published += 1
        self.state.stats.num_published_pages += published
        return published

    def revoke(self, transfer_id: int, pages: Sequence[tuple[str, int, int, int]]) -> None:
        """See :meth:`ResidencyPolicy.revoke_block_hashes`."""
        for request_id, serial, page, host_block in pages:
            req = self.state.requests.find(request_id)
            if req is not None and req.serial == serial and page < len(req.block_hashes):
                req.block_hashes[page] = None
            self.planner.revoke_publication(int(transfer_id), host_block)
