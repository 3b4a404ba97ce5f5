"""The residency invariants, checked by the tests after every operation (O(everything)).

* every written page of every request (except one mid-import) has a valid copy: pinned on
  the device, released but not reused, or on the host (host rows cover the written rows);
* the running tail pages of an ACTIVE MIXED/NONE request are pinned; an ACTIVE FULL request
  has every page pinned, and so has an ACTIVE FULL prefilling one (R1.a);
* each request's record agrees with the request table's row vectors; free rows are clean;
* device and host reference counts equal the leases the pages, hot regions and open
  transactions hold (so never negative, and no block is both free and owned); a released
  block is free in the pool, or still pinned by another request (a shared prefix page);
* hot leases belong to live MIXED/NONE requests that are active, activating or importing
  (an import into an engine's tail blocks); a lease's size agrees with the request's
  record, names distinct blocks and, with adaptive sizing, stays within the table width.

:func:`check_records` checks the policy's own records and returns the leases they hold;
:func:`check_pool_leases` compares those with the pools' reference counts, on the device side
exactly only against :class:`InMemoryDevicePool`, the one pool that exposes its counts (with
another pool only the records are checked). ``ResidencyPolicy.check_invariants`` runs both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_hisparse.core.commands import Residency
from vllm_hisparse.core.device_pool import DevicePool, InMemoryDevicePool
from vllm_hisparse.core.host_blocks import HostBlockPool
from vllm_hisparse.core.page_table import range_mask
from vllm_hisparse.core.policy_state import PolicyState
from vllm_hisparse.core.request_table import RequestStatus
from vllm_hisparse.core.transactions import TransactionTable
from vllm_hisparse.core.transitions import ResidencyTransitions
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, cdiv


@dataclass(frozen=True)
class HeldLeases:
    """The leases the policy's records hold: block id -> count, per pool."""

    device: dict[int, int]
    host: dict[int, int]


def check_records(
    state: PolicyState,
    released_owner: dict[int, list[tuple[int, int, int]]],
    txns: TransactionTable,
    transitions: ResidencyTransitions,
) -> HeldLeases:
    """Raise AssertionError if the records break an invariant; the leases they hold otherwise.

    ``released_owner``: :attr:`PageLeases.released_owner`.
    """
    t, requests = state.tables, state.requests
    device_pool, host_pool = state.device_pool, state.host_pool
    in_memory = isinstance(device_pool, InMemoryDevicePool)
    sizing = state.config.hot_sizing
    dev_leases: dict[int, int] = {}
    host_leases: dict[int, int] = {}

    def add(d, k):
        d[k] = d.get(k, 0) + 1

    for req in requests.values():
        row = req.row
        assert requests.at(row) is req
        assert t.serial[row] == req.serial
        assert requests.watch[row] == (
            req.status == RequestStatus.PARKED or req.residency != Residency.FULL
        ), (req.request_id, "row watch flag out of date")
        assert requests.prefilling[row] == req.prefilling, (req.request_id, "prefilling flag out of date")
        assert requests.gate[row] == (
            req.status != RequestStatus.ACTIVE or (req.prefilling and req.residency != Residency.FULL)
        ), (req.request_id, "schedule gate out of date")
        if req.prefilling and req.status == RequestStatus.ACTIVE and req.residency == Residency.FULL:
            # R1.a: a prefilling request that may be scheduled has its whole context pinned.
            assert t.num_pinned[row] == cdiv(int(t.num_tokens[row]), t.block_size), req.request_id
        n = int(t.num_pages[row])
        # Pages past the length stay adopted after a rollback (rejected drafts); no page
        # has a host row at or past the length.
        written = int(t.num_tokens[row])
        assert n >= cdiv(written, t.block_size), req.request_id
        for page in range(written // t.block_size, n):
            keep = range_mask(0, max(written - page * t.block_size, 0), t.num_mask_words)
            assert np.all(t.host_mask[row, page] & ~keep == 0), (req.request_id, page, "host row past the length")
            if req.status == RequestStatus.ACTIVE:  # the next forward writes there
                assert t.pinned[row, page], (req.request_id, page, "page at or past the length not pinned")
        assert t.num_pinned[row] == int(np.count_nonzero(t.pinned[row, :n])), req.request_id
        assert t.num_clean_pinned[row] == int(np.count_nonzero(t.pinned[row, :n] & t.host_valid[row, :n]))
        assert not np.any(t.pinned[row, n:]) and not np.any(t.device_block[row, n:] >= 0)
        for page in range(n):
            block = int(t.device_block[row, page])
            host_block = int(t.host_block[row, page])
            if req.status != RequestStatus.IMPORTING:
                assert host_block >= 0, (req.request_id, page, "page without host block")
            if host_block >= 0:
                add(host_leases, host_block)
            if t.pinned[row, page]:
                assert block >= 0
                add(dev_leases, block)
                continue
            if block >= 0:
                owners = released_owner.get(block, [])
                assert (row, req.serial, page) in owners, (req.request_id, page, "released page not tracked")
                if in_memory:
                    # Free, or still pinned by another request (a shared prefix page).
                    assert device_pool.is_free(block) or bool(
                        np.any(t.pinned & (t.device_block == block))), (
                        req.request_id, page, "released block re-owned")
            if t.host_valid[row, page]:
                assert np.all(t.host_mask[row, page] == t.full_mask)
            if req.status == RequestStatus.IMPORTING:
                continue
            assert t.host_covers_written(row, page), (req.request_id, page, "page has no valid copy")
        if req.status == RequestStatus.ACTIVE and req.residency != Residency.FULL:
            for page in range(max(0, n - ACTIVE_TAIL_PAGES), n):
                assert t.pinned[row, page], (req.request_id, page, "tail page not pinned")
        if req.residency == Residency.FULL and req.status in (RequestStatus.ACTIVE,):
            assert t.num_pinned[row] == n, (req.request_id, "FULL request with unpinned pages")
        if req.hot_block_ids:
            # An import landing in an engine's tail blocks holds its hot region already.
            assert req.residency != Residency.FULL and req.status in (
                RequestStatus.ACTIVE,
                RequestStatus.ACTIVATING,
                RequestStatus.IMPORTING,
            ), (req.request_id, "hot lease held outside MIXED/NONE running or importing")
            assert len(req.hot_block_ids) == req.hot_blocks == int(requests.hot_blocks[row]), (
                req.request_id, "hot lease size disagrees with the request's record")
            assert len(set(req.hot_block_ids)) == len(req.hot_block_ids), (
                req.request_id, "hot lease names a block twice")
            if sizing is not None:  # the worker's hot tables are max_blocks wide
                assert 1 <= req.hot_blocks <= sizing.max_blocks, (
                    req.request_id, "hot lease resized past the sizing bounds")
            for block in req.hot_block_ids:
                add(dev_leases, block)
        elif req.status == RequestStatus.ACTIVE and req.residency != Residency.FULL:
            raise AssertionError((req.request_id, "MIXED/NONE request without hot lease"))
    for txn in txns.values():
        for block in txn.held_device_until_enqueued + txn.held_device_until_done:
            add(dev_leases, block)
        for block in txn.held_host_until_done:
            add(host_leases, block)
    for row in range(t.num_rows):
        if requests.at(row) is None:
            assert t.serial[row] == 0 and t.num_pages[row] == 0
            assert requests.gate[row] and not requests.prefilling[row]
            assert not transitions.is_window_pending(row)
    return HeldLeases(dev_leases, host_leases)


def check_pool_leases(device_pool: DevicePool, host_pool: HostBlockPool, held: HeldLeases) -> None:
    """Raise AssertionError unless each pool's reference counts are exactly ``held`` (the
    device pool only when it is an :class:`InMemoryDevicePool`)."""
    if isinstance(device_pool, InMemoryDevicePool):
        ref = device_pool.ref_counts
        assert np.all(ref >= 0)
        expected = np.zeros_like(ref)
        for block, count in held.device.items():
            expected[block] = count
        bad = np.nonzero(expected != ref)[0]
        assert bad.shape[0] == 0, f"device leases differ at blocks {bad[:8].tolist()}: " \
            f"expected {expected[bad[:8]].tolist()} got {ref[bad[:8]].tolist()}"
        assert device_pool.get_num_free_blocks() == int(np.count_nonzero(ref == 0))
    ref = host_pool.ref_counts
    assert np.all(ref >= 0)
    expected = np.zeros_like(ref)
    for block, count in held.host.items():
        expected[block] = count
    bad = np.nonzero(expected != ref)[0]
    assert bad.shape[0] == 0, f"host leases differ at blocks {bad[:8].tolist()}"
    for block in held.host:
        assert not host_pool.is_free(block)
    assert host_pool.num_free_blocks + host_pool.num_cached_blocks == int(np.count_nonzero(ref == 0))
