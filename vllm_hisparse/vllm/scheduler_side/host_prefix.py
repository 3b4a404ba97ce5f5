"""The scheduler role's host-prefix service: host pages served as vLLM prefix hits.

A full page (docs/vllm-integration.md, "The host tier as a prefix cache") is published
in the host pool under vLLM's block hash once both its sparse-MLA rows (the mirror) and
its indexer page (saved with the step's mirror, ``IndexerPages``) are on the host. The
admission gate reports published pages past vLLM's own prefix-cache hit as external
tokens, loaded asynchronously: vLLM allocates blocks for them and holds the request in
WAITING_FOR_REMOTE_KVS; the policy adopts those blocks and restores the pages into them
(``ResidencyPolicy.adopt_host_prefix``), indexer pages included, and the worker reports
the request in ``finished_recving`` (``failed_recving`` too if the load failed: vLLM then
fails that request alone).

:class:`HostPrefixService` owns the hits offered and leased (``_offered_hits``,
``_host_hits``), the loads to start and their requests, the identities waiting for their
mirror (``_identity_pending``) and the step's indexer page copies.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm_hisparse.core.commands import StepCommand, TransferKind, WorkerAcks
from vllm_hisparse.core.policy import ResidencyPolicy
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.metadata import IndexerPages
from vllm_hisparse.vllm.scheduler_side.block_pool import BlockPoolDevicePool
from vllm_hisparse.vllm.scheduler_side.geometry import SchedulerGeometry
from vllm_hisparse.vllm.scheduler_side.request_book import RequestBook
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME

logger = logging.getLogger(__name__)


class HostPrefixService:
    """Publication and loading of host-prefix pages (module docstring).

    Verbs: offers (:meth:`hit_pages`, :meth:`lease_offer`, :meth:`take_offer`,
    :meth:`drop_offer`, :meth:`drop_stale_offers`), loads (:meth:`take_loads_to_start`,
    :meth:`has_hit`, :meth:`adopt`, :meth:`release_hit`, :meth:`take_load_requests`),
    publication (:meth:`take_step_indexer_pages`, :meth:`plan_indexer_saves`,
    :meth:`revoke_identities`, :meth:`settle_identities`).
    """

    def __init__(self, geometry: SchedulerGeometry, book: RequestBook) -> None:
        self.geometry = geometry
        self.book = book
        # Host tier as a prefix cache (decided in bind).
        self.enabled = False
        self._policy: ResidencyPolicy | None = None
        self._kv_cache_manager: Any = None
        self._managers: list[Any] = []
        self._indexer_managers: list[Any] = []
        self._device_pool: BlockPoolDevicePool | None = None
        # Host-prefix hits offered and leased, until vLLM allocates for the request (its
        # update_state_after_alloc may come a step later: defer_async_loads):
        # id -> (host blocks, local pages, request).
        self._offered_hits: dict[str, tuple[list[int], int, Any]] = {}
        # Admitted requests with a leased host prefix: id -> (host blocks, local pages).
        self._host_hits: dict[str, tuple[list[int], int]] = {}
        # Of those, the ones whose load starts with this step's command, and this step's
        # loads by RESTORE id (metadata.load_requests).
        self._loads_to_start: list[str] = []
        self._load_requests: dict[int, str] = {}
        # This step's indexer page copies, by the transfer they ride with.
        self._step_indexer_pages: dict[int, IndexerPages] = {}
        # MIRROR id -> pages (request id, serial, page, host block) whose indexer pages
        # it carries, and whether their identity was already given to the policy.
        self._identity_pending: dict[int, list[tuple[str, int, int, int, bool]]] = {}

    def bind(self, policy: ResidencyPolicy, kv_cache_manager: Any, managers: list[Any],
             indexer_managers: list[Any], device_pool: BlockPoolDevicePool) -> None:
        self._policy = policy
        self._kv_cache_manager = kv_cache_manager
        self._managers = managers
        self._indexer_managers = indexer_managers
        self._device_pool = device_pool
        self.enabled = self._usable(kv_cache_manager)

    def _usable(self, kv_cache_manager: Any) -> bool:
        """Whether host pages can be published and served as prefix hits (logged)."""
        g = self.geometry
        caching, hash_block_size = compat.prefix_cache_geometry(kv_cache_manager)
        why = None
        if not caching:
            why = "vLLM prefix caching is disabled"
        elif hash_block_size != g.block_size:
            why = f"vLLM hashes {hash_block_size}-token blocks, pages are {g.block_size} tokens"
        elif not g.eager_host_mirror:
            why = "eager_host_mirror is false (indexer pages are saved with the mirror)"
        elif not g.indexer_group_ids:
            why = "the plan has no indexer group"
        elif len(g.sparse_group_ids) + len(g.indexer_group_ids) < g.num_kv_groups:
            # A restore would leave those groups' pages (MTP draft layers) unwritten.
            why = (f"{g.num_kv_groups - len(g.sparse_group_ids) - len(g.indexer_group_ids)}"
                   " KV cache group(s) hold layers the host tier does not store (MTP draft layers)")
        elif g.load_failure_policy != "fail":
            why = (f"kv_load_failure_policy={g.load_failure_policy!r} (a failed host load "
                   "would rewind tokens the policy already holds; accepted: 'fail')")
        if why is not None:
            logger.info("%s: host-prefix hits off: %s", CONNECTOR_NAME, why)
            return False
        logger.info("%s: host-prefix hits on (pages published once mirrored, indexer page "
                    "included)", CONNECTOR_NAME)
        return True

    def _require_policy(self) -> ResidencyPolicy:
        if self._policy is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: scheduler role used before bind_kv_cache_manager")
        return self._policy

    # ------------------------------------------------------------------ offered hits
    def hit_pages(self, request: Any, local_pages: int) -> int:
        """Published host pages of ``request`` past its first ``local_pages`` pages.

        None when the tokens left to compute fit in one prefill chunk: a load keeps the
        request waiting a step (``WAITING_FOR_REMOTE_KVS``) while recomputing them takes
        that one step anyway, so the load would only delay it. None, too, when the
        sparse-MLA groups still hold every one of those pages on the device (only their
        indexer pages are gone): a load would restore no sparse-MLA row, so it is left to
        ``OffloadingConnector`` (which loads the indexer groups up to the sparse groups' own
        hit) or recomputed."""
        if not self.enabled:
            return 0
        bs = self.geometry.block_size
        if request.num_tokens - local_pages * bs <= self.geometry.max_chunk_tokens:
            return 0
        max_pages = (request.num_tokens - 1) // bs  # leave a token to compute
        if max_pages <= local_pages:
            return 0
        hits = self._require_policy().lookup_host_prefix(request.block_hashes[:max_pages])
        if hits <= local_pages:
            return 0
        per_group = compat.per_group_prefix_hits(self._kv_cache_manager, request.block_hashes, hits * bs)
        if min(per_group[g] for g in self.geometry.sparse_group_ids) >= hits * bs:
            return 0
        return hits - local_pages

    def lease_offer(self, request: Any, local_pages: int, prefix_pages: int) -> int:
        """Lease the offered prefix until vLLM allocates for the request (its
        ``update_state_after_alloc`` may come a step later, ``defer_async_loads``), so LRU
        eviction cannot take it meanwhile. Returns the hit pages past ``local_pages``."""
        policy = self._require_policy()
        hits = policy.acquire_host_prefix(request.block_hashes, max_pages=prefix_pages)
        if len(hits) <= local_pages:
            policy.release_host_prefix(hits)
            return 0
        self._offered_hits[request.request_id] = (hits, local_pages, request)
        return len(hits) - local_pages

    def take_offer(self, request: Any, num_external_tokens: int) -> int:
        """vLLM allocated ``num_external_tokens`` for our offer: the request's host prefix
        (the lease passes to the admitted hits, and its load starts with the next command;
        pages vLLM did not take are given back). Returns the prefix pages, device-cached
        ones included."""
        rid = request.request_id
        bs = self.geometry.block_size
        offered = self._offered_hits.pop(rid, None)
        if offered is None or num_external_tokens % bs:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: request {rid!r} allocated with {num_external_tokens} "
                "external tokens this connector did not offer in whole pages")
        hits, local_pages, _ = offered
        prefix_pages = local_pages + num_external_tokens // bs
        if prefix_pages > len(hits):
            self._require_policy().release_host_prefix(hits)
            raise RuntimeError(
                f"{CONNECTOR_NAME}: request {rid!r} allocated with a host prefix of "
                f"{prefix_pages} pages; {len(hits)} were offered")
        self._require_policy().release_host_prefix(hits[prefix_pages:])
        self._host_hits[rid] = (hits[:prefix_pages], local_pages)
        self._loads_to_start.append(rid)
        return prefix_pages

    def drop_offer(self, rid: str) -> None:
        offered = self._offered_hits.pop(rid, None)
        if offered is not None:
            self._require_policy().release_host_prefix(offered[0])

    def drop_stale_offers(self) -> None:
        """Offers vLLM did not admit this step give their lease back (they are offered
        again); admitted ones whose ``update_state_after_alloc`` vLLM deferred wait in
        WAITING_FOR_REMOTE_KVS and keep it."""
        if not self._offered_hits:
            return
        for rid, (_, _, request) in list(self._offered_hits.items()):
            if not compat.is_waiting_for_remote_kvs(request):
                self.drop_offer(rid)

    # ------------------------------------------------------------------ loads
    def take_loads_to_start(self) -> list[str]:
        """Requests vLLM admitted with a host-prefix hit since the last step, still holding
        it: they wait in WAITING_FOR_REMOTE_KVS, and the policy adopts them now (the
        role adds them, :meth:`adopt`), so the step's command loads their pages."""
        if not self._loads_to_start:
            return []
        loads, self._loads_to_start = self._loads_to_start, []
        return [rid for rid in loads if rid in self._host_hits]

    def has_hit(self, rid: str) -> bool:
        """``rid`` was admitted with a leased host prefix not adopted yet."""
        return rid in self._host_hits

    def adopt(self, rid: str) -> int:
        """A new request with a leased host prefix: the policy adopts vLLM's blocks for
        its pages and loads those not already on the device (sparse-MLA rows through
        the policy's RESTORE, indexer pages with it). Returns the tokens adopted."""
        hits, local_pages = self._host_hits.pop(rid)
        policy = self._require_policy()
        n = len(hits)
        tables = [m.req_to_blocks[rid] for m in self._managers]
        adopt = self._device_pool.adopt
        leads = [adopt([table[p] for table in tables]) for p in range(n)]
        # vLLM gave the sparse groups back their cached blocks for the pages of the hit
        # still on the device (``retains_longer_hit``, managers.py): restore the sparse
        # rows from the first page that is not; the indexer pages of the whole hit load.
        first_load = local_pages
        while first_load < n and all(compat.block_is_cached(t[first_load]) for t in tables):
            first_load += 1
        if first_load == n:  # the offer checked the sparse groups' own hit (hit_pages)
            raise RuntimeError(f"{CONNECTOR_NAME}: request {rid!r}: host prefix of {n} pages "
                               "with every sparse-MLA page still cached; nothing to load")
        load_id = policy.adopt_host_prefix(rid, leads, hits, first_load)
        policy.set_block_hashes(rid, 0, self.book.requests[rid].block_hashes[:n])
        if load_id >= 0:
            self._load_requests[load_id] = rid
            self._step_indexer_pages[load_id] = IndexerPages(
                [[m.req_to_blocks[rid][p].block_id for p in range(local_pages, n)]
                 for m in self._indexer_managers],
                hits[local_pages:], to_host=False)
        return n * self.geometry.block_size

    def release_hit(self, rid: str) -> None:
        """``rid`` was freed before it was ever scheduled: give its leased prefix back."""
        hit = self._host_hits.pop(rid, None)
        if hit is not None:
            self._require_policy().release_host_prefix(hit[0])

    def take_load_requests(self) -> dict[int, str]:
        """This step's loads by RESTORE id (``metadata.load_requests``)."""
        loads, self._load_requests = self._load_requests, {}
        return loads

    # ------------------------------------------------------------------ publication
    def take_step_indexer_pages(self) -> dict[int, IndexerPages]:
        """The indexer page copies of this step's loads, by the transfer they ride with."""
        pages, self._step_indexer_pages = self._step_indexer_pages, {}
        return pages

    def plan_indexer_saves(self, keys: tuple, rows: np.ndarray, counts: np.ndarray,
                           command: StepCommand, indexer_pages: dict[int, IndexerPages]) -> None:
        """Indexer pages of the pages this step's forward completes ride with its MIRROR.

        The forward writes a completed page's last rows, so that MIRROR is what makes the
        page clean, and the worker saves the indexer pages ahead of it on the same stream:
        a page is clean only once its indexer page is on the host too. The policy gets
        the pages' identities (vLLM's block hashes) now and publishes each page when it
        is clean, even if its request ended meanwhile; identities not known yet (a token
        still a placeholder under async scheduling) are given when the mirror completes,
        if the request still runs. A failed mirror or indexer save revokes them
        (:meth:`revoke_identities`, :meth:`settle_identities`). Cost: O(scheduled) numpy,
        plus the pages completed."""
        policy = self._require_policy()
        bs = self.geometry.block_size
        after = policy.num_tokens_at(rows)
        full_after = after // bs
        full_before = (after - counts) // bs
        done = np.nonzero(full_after > full_before)[0]
        if done.shape[0] == 0:
            return
        mirror = next((x for x in command.transfers if x.kind == TransferKind.MIRROR), None)
        if mirror is None:
            return
        idx_tables = [m.req_to_blocks for m in self._indexer_managers]
        device: list[list[int]] = [[] for _ in idx_tables]
        host: list[int] = []
        pending: list[tuple[str, int, int, int, bool]] = []
        requests = self.book.requests
        for i in done.tolist():
            rid, row = keys[i], int(rows[i])
            serial = policy.serial_at(row)
            first, end = int(full_before[i]), int(full_after[i])
            hashes = requests[rid].block_hashes
            known = min(end, len(hashes))
            if known > first:
                policy.set_block_hashes(rid, first, hashes[first:known])
            for page, host_block in enumerate(policy.host_blocks_at(row, first, end).tolist(), first):
                if host_block < 0:
                    continue
                for g, table in enumerate(idx_tables):
                    device[g].append(table[rid][page].block_id)
                host.append(host_block)
                pending.append((rid, serial, page, host_block, page < known))
        if pending:
            indexer_pages[mirror.transfer_id] = IndexerPages(device, host, to_host=True)
            self._identity_pending[mirror.transfer_id] = pending

    def revoke_identities(self, tid: int) -> None:
        """Transfer ``tid`` failed (a mirror, or the indexer saves riding with it): the
        identities of its pages are withdrawn (the pages may become clean later, by a spill)."""
        entries = self._identity_pending.pop(tid, None)
        if entries:
            self._require_policy().revoke_block_hashes(
                tid, [(rid, serial, page, host) for rid, serial, page, host, _ in entries])

    def settle_identities(self, acks: WorkerAcks) -> None:
        """The voted acks, before the policy applies them: failed mirrors revoke their pages'
        identities; completed ones give those not known when they were planned."""
        if not self._identity_pending:
            return
        for tid in acks.failed:
            self.revoke_identities(tid)
        for tid in acks.completed:
            entries = self._identity_pending.pop(tid, None)
            if entries:
                self._give_late_identities(entries)

    def _give_late_identities(self, entries: list[tuple[str, int, int, int, bool]]) -> None:
        """Identities not known when the pages' mirror was planned, now that it completed
        (the policy publishes each page once it is also clean). Pages of requests that
        ended or restarted since are skipped."""
        policy = self._require_policy()
        row_of, requests = self.book.row_of, self.book.requests
        for rid, serial, page, _, given in entries:
            if given:
                continue
            row = row_of.get(rid)
            if row is None or policy.serial_at(row) != serial:
                continue
            hashes = requests[rid].block_hashes
            if page < len(hashes):
                policy.set_block_hashes(rid, page, [hashes[page]])
