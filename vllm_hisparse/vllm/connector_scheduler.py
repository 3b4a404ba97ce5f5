"""The scheduler role of ``HiSparseResidencyConnector``: core policy ↔ vLLM's scheduler.

Division of labour
------------------
* **vLLM allocates every page.** The sparse-MLA groups keep vLLM's full-attention
  allocation (admission, chunked prefill, prefix-cache hits, preemption all stay
  vLLM's). A page's blocks (one per sparse group, a *bundle*, see
  ``device_pool_adapter``) are handed to the core :class:`~vllm_hisparse.core.ResidencyPolicy`
  the step the page first holds a scheduled token; from then on the policy owns that
  lease.
* **The policy decides residency.** Under pool pressure (or a chunked prefill past its
  admission window) it leases a hot region and releases clean pages back to the pool,
  readable until vLLM reuses them. Released blocks count as free for vLLM, so the
  scheduler admits more requests, and preempts fewer.
* **The managers never double free.** ``ResidencyAwareManager.pop_blocks_for_free``
  (every free path: finish, abort, preemption) asks :meth:`on_blocks_freed`, which ends
  the request in the policy (returning its page leases and hot region) and lets vLLM
  free only the blocks the policy never adopted.

Per step: ``build_connector_meta`` feeds the step's scheduled tokens to the policy
(one vectorised ``schedule_rows`` call; a request that crosses into new pages adopts
vLLM's blocks through a callback), takes the policy's :class:`~vllm_hisparse.core.StepCommand`, applies its
page losses to vLLM's block tables (null blocks), and returns the command as metadata.
It does not modify ``scheduler_output``. ``update_connector_output`` counts worker acks
(a transfer is complete only once every worker completed it, failed if any failed) and
applies them. The work is proportional to the scheduled requests (one dict walk and a
few numpy operations) plus what changed this step.

Requirement R1 (docs/core.md): the policy is told which requests are prefilling (a
prompt not fully computed, or a recompute), so it never demotes them or releases their
pages; vLLM's prefill reads the whole context through the block table.

Host tier as a prefix cache (docs/vllm-integration.md, "Host-prefix hits"): a full page
is published in the host pool under vLLM's block hash once both its sparse-MLA rows
(the mirror) and its indexer page (saved with the step's mirror, ``IndexerPages``) are
on the host. ``get_num_new_matched_tokens`` reports published pages past vLLM's own
prefix-cache hit as external tokens (a synchronous load); vLLM allocates blocks for
them, and the policy adopts those blocks and restores the pages into them before the
step's forward (``ResidencyPolicy.adopt_host_prefix``), indexer pages included.

Preemption: vLLM recomputes a preempted request, so the policy ends it (``abort``),
which publishes its clean pages; when vLLM re-admits it, they are host-prefix hits, so
only its partial last page is recomputed. Host back-pressure: a request is admitted
only when the host pool can back its whole length (``get_num_new_matched_tokens``
returns ``None`` otherwise, which keeps it waiting).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from vllm_hisparse.core.commands import Residency, StepCommand, TransferKind, WorkerAcks
from vllm_hisparse.core.host_blocks import HostBlockPool
from vllm_hisparse.core.policy import Outcome, PolicyConfig, ResidencyPolicy
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.config import CONNECTOR_NAME, HiSparseResidencyConfig
from vllm_hisparse.vllm.device_pool_adapter import BlockPoolDevicePool
from vllm_hisparse.vllm.kv_planning import (
    engine_capacity_report,
    format_capacity_table,
    indexer_group_ids,
    sparse_group_ids,
)
from vllm_hisparse.vllm.managers import ResidencyAwareManager, residency_manager_group_ids
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, HiSparseWorkerMetadata, IndexerPages
from vllm_hisparse.vllm.metrics import HiSparseConnectorStats

logger = logging.getLogger(__name__)

#: PolicyStats field -> our stats counter.
_POLICY_COUNTERS = {
    "num_spill_pages": "num_spilled_pages",
    "num_restore_pages": "num_restored_pages",
    "num_pages_released": "num_released_pages",
    "num_pages_reused": "num_reused_pages",
    "num_demotions": "num_demotions",
    "num_promotions": "num_promotions",
    "num_failed_transfers": "num_failed_transfers",
}


#: get_kv_connector_stats reports at most once per this many calls (steps).
_STATS_EVERY_STEPS = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class HiSparseConnectorScheduler:
    """Scheduler-side residency: owns the host pool, the policy and the ack counting."""

    def __init__(
        self,
        vllm_config: compat.VllmConfig,
        hisparse_config: HiSparseResidencyConfig,
        kv_cache_config: compat.KVCacheConfig,
    ) -> None:
        self.hisparse_config = hisparse_config
        self.block_size = hisparse_config.block_size
        self.sparse_group_ids = sparse_group_ids(kv_cache_config)
        self.indexer_group_ids = indexer_group_ids(kv_cache_config)
        self._load_failure_policy = compat.kv_load_failure_policy(vllm_config)
        # Our manager for the sparse groups, chosen by group role. This must happen
        # before the scheduler builds its KVCacheManager, i.e. here (see compat).
        compat.register_residency_manager(ResidencyAwareManager)
        # The other full-attention groups get it too, unbound: one manager class keeps
        # vLLM's per-group call sites fast (managers.residency_manager_group_ids).
        compat.assign_group_role(
            kv_cache_config, residency_manager_group_ids(kv_cache_config, self.sparse_group_ids))

        report = engine_capacity_report(vllm_config, kv_cache_config)
        logger.info("%s", format_capacity_table(report))
        self.capacity_report = report
        self.host_pool = HostBlockPool(report.host_blocks)

        sched = vllm_config.scheduler_config
        self.max_model_len = vllm_config.model_config.max_model_len
        self._max_chunk_tokens = sched.max_num_batched_tokens
        self._num_kv_groups = len(kv_cache_config.kv_cache_groups)
        low, high = self._watermarks(kv_cache_config, sched, hisparse_config)
        self.policy_config = PolicyConfig(
            block_size=self.block_size,
            max_num_rows=sched.max_num_seqs,
            max_pages_per_request=_cdiv(self.max_model_len, self.block_size),
            device_buffer_size_rows=hisparse_config.device_buffer_size,
            admission_window_pages=_cdiv(sched.max_num_batched_tokens, self.block_size),
            eager_host_mirror=hisparse_config.eager_host_mirror,
            low_watermark_blocks=low,
            high_watermark_blocks=high,
        )
        # Every rank of the replica runs a worker role that acks each transfer.
        self.num_workers = max(1, vllm_config.parallel_config.world_size)

        # Bound in bind_kv_cache_manager (vLLM builds the KVCacheManager after us).
        self.policy: ResidencyPolicy | None = None
        self.device_pool: BlockPoolDevicePool | None = None
        self._managers: list[ResidencyAwareManager] = []
        self._indexer_managers: list[Any] = []

        # Host tier as a prefix cache (decided in bind_kv_cache_manager).
        self.host_prefix_cache = False
        # The last request get_num_new_matched_tokens offered a host hit: (id, local pages).
        self._offered_hit: tuple[str, int] | None = None
        # Admitted requests with a leased host prefix: id -> (host blocks, local pages).
        self._host_hits: dict[str, tuple[list[int], int]] = {}
        # This step's indexer page copies, by the transfer they ride with.
        self._step_indexer_pages: dict[int, IndexerPages] = {}
        # MIRROR id -> pages (request id, serial, page, host block) whose indexer pages
        # it carries, and whether their identity was already given to the policy.
        self._identity_pending: dict[int, list[tuple[str, int, int, int, bool]]] = {}
        self._adopted_tokens = 0  # set by _add_request for build_connector_meta

        # Requests known to the policy.
        self._row_of: dict[str, int] = {}
        self._rid_of_row: list[str | None] = [None] * self.policy_config.max_num_rows
        self._requests: dict[str, Any] = {}  # admitted requests (vLLM Request objects)
        self._finishing: set[str] = set()
        # Free in progress: request id -> (policy pages, sparse groups still to visit).
        self._freeing: dict[str, list[int]] = {}
        # Host blocks promised to admitted requests and not yet allocated.
        self._host_remaining: dict[str, int] = {}
        self._host_outstanding = 0
        # Residency bookkeeping for metrics.
        self._non_full: set[str] = set()
        self._hot_rows: set[int] = set()
        # R1: requests the policy was told are prefilling (docs/core.md).
        self.max_decode_query_len = max(1, int(hisparse_config.max_decode_query_len))
        self._prefilling: set[str] = set()
        # build_connector_meta: the previous step's scheduled ids and their state rows.
        self._cached_keys: tuple | None = None
        self._cached_rows: np.ndarray | None = None
        # Unmet device demand: the last waiting request offered to us this step.
        self._offered: tuple[str, int] | None = None
        # Device headroom gate (offer): requests let through this step (id -> pages they
        # will need) and whether one was deferred (then later offers wait too, FCFS).
        self._let_through: dict[str, int] = {}
        self._admission_closed = False
        # get_kv_connector_stats: report at most every _STATS_EVERY_STEPS calls.
        self._stats_calls = 0
        # Ack counting across workers (only used with more than one worker).
        self._ack_enqueued: dict[int, int] = {}
        self._ack_completed: dict[int, int] = {}
        self._failed_ids: set[int] = set()
        # Metrics.
        self._stats = HiSparseConnectorStats()
        self._policy_stats_seen = {k: 0 for k in _POLICY_COUNTERS}
        self.num_preemptions = 0  # lifetime count (tests, tools)

    def _watermarks(self, kv_cache_config, sched, hisparse_config) -> tuple[int, int]:
        """Pressure watermarks, in page bundles, sized to what one vLLM step allocates.

        The policy relieves pressure only at the end of a step, after vLLM allocated
        (and, failing that, preempted). So the low watermark covers the most one step
        can ask for: a full prefill budget of pages plus one page crossing per running
        request, in every group, converted to bundles of the sparse groups (capped at
        half the pool). The high watermark adds one hot region and 5 % of the pool on
        top (hysteresis). On top of that, demand the connector sees is reported each
        step (``note_device_demand``): the next chunks of prefilling requests, a waiting
        request vLLM could not admit, an allocation that failed.

        Measured alternative (docs/vllm-integration.md): a low watermark of decode growth
        only, relying on the reported demand for prefills and admissions, kept about 5 %
        of the pool less in reserve but took 4 % more steps on one workload, so the
        worst-case sizing stays.
        """
        num_sparse = len(self.sparse_group_ids)
        num_groups = len(kv_cache_config.kv_cache_groups)
        step_pages = _cdiv(sched.max_num_batched_tokens, self.block_size) + min(
            sched.max_num_seqs, sched.max_num_batched_tokens
        )
        step_blocks = step_pages * num_groups
        bundles = (kv_cache_config.num_blocks - 1) // num_sparse
        low = min(_cdiv(step_blocks, num_sparse), bundles // 2)
        high = min(low + hisparse_config.hot_blocks_per_request + _cdiv(bundles, 20), bundles)
        return low, max(high, low)

    # ==================================================================== binding
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Bind the policy to vLLM's ``BlockPool`` and our managers of the sparse groups."""
        managers = compat.group_managers(kv_cache_manager, self.sparse_group_ids)
        for group_id, manager in zip(self.sparse_group_ids, managers):
            if not isinstance(manager, ResidencyAwareManager):
                raise RuntimeError(
                    f"{CONNECTOR_NAME}: KV cache group {group_id} is managed by "
                    f"{type(manager).__name__}, not ResidencyAwareManager; the group role "
                    f"{compat.RESIDENCY_GROUP_ROLE!r} was not honoured (was the KVCacheManager "
                    "built before the connector?)"
                )
        for index, manager in enumerate(managers):
            manager.bind_residency(self, index)
        self._managers = managers
        self._indexer_managers = compat.group_managers(kv_cache_manager, self.indexer_group_ids)
        self.device_pool = BlockPoolDevicePool(kv_cache_manager.block_pool, len(managers))
        self.policy = ResidencyPolicy(self.policy_config, self.device_pool, self.host_pool)
        self.host_prefix_cache = self._host_prefix_cache_usable(kv_cache_manager)

    def _host_prefix_cache_usable(self, kv_cache_manager: Any) -> bool:
        """Whether host pages can be published and served as prefix hits (logged)."""
        caching, hash_block_size = compat.prefix_cache_geometry(kv_cache_manager)
        why = None
        if not caching:
            why = "vLLM prefix caching is disabled"
        elif hash_block_size != self.block_size:
            why = f"vLLM hashes {hash_block_size}-token blocks, pages are {self.block_size} tokens"
        elif not self.hisparse_config.eager_host_mirror:
            why = "eager_host_mirror is false (indexer pages are saved with the mirror)"
        elif not self.indexer_group_ids:
            why = "the plan has no indexer group"
        elif self._load_failure_policy != "fail":
            why = (f"kv_load_failure_policy={self._load_failure_policy!r} (a failed host load "
                   "would rewind tokens the policy already holds; accepted: 'fail')")
        if why is not None:
            logger.info("%s: host-prefix hits off: %s", CONNECTOR_NAME, why)
            return False
        logger.info("%s: host-prefix hits on (pages published once mirrored, indexer page "
                    "included)", CONNECTOR_NAME)
        return True

    def _require_policy(self) -> ResidencyPolicy:
        if self.policy is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: scheduler role used before bind_kv_cache_manager")
        return self.policy

    # ==================================================================== admission
    def _host_pages_for(self, request: Any) -> int:
        max_tokens = getattr(request, "max_tokens", None) or 0
        total = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        return _cdiv(max(total, 1), self.block_size)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Host-prefix hit past vLLM's own (``num_computed_tokens``, block aligned), as
        external tokens loaded synchronously; ``None`` (wait) when the host pool cannot
        back the request.

        The hit is the longest published prefix of the request's block hashes, in whole
        pages, leaving at least one token to compute; it counts only past the local hit.
        """
        rid = request.request_id
        if rid in self._requests:
            return 0, False
        local_pages = num_computed_tokens // self.block_size
        hit_pages = self._host_hit_pages(request, local_pages)
        prefix_pages = local_pages + hit_pages if hit_pages else 0
        # Hit pages need no new host block; they may sit among the evictable ones.
        available = self.host_pool.num_allocatable_blocks - self._host_outstanding - prefix_pages
        if self._host_pages_for(request) - prefix_pages > available:
            return None, False
        self._offered_hit = (rid, local_pages) if hit_pages else None
        # If vLLM cannot allocate its first chunk, this is unmet device demand
        # (``_note_unadmitted``): vLLM offers waiting requests in order and stops at the
        # first one it cannot allocate.
        first_chunk = min(max(request.num_tokens - num_computed_tokens, 1), self._max_chunk_tokens)
        self._offered = (rid, _cdiv(first_chunk, self.block_size))
        return hit_pages * self.block_size, False

    def _host_hit_pages(self, request: Any, local_pages: int) -> int:
        """Published host pages of ``request`` past its first ``local_pages`` pages."""
        if not self.host_prefix_cache:
            return 0
        max_pages = (request.num_tokens - 1) // self.block_size  # leave a token to compute
        if max_pages <= local_pages:
            return 0
        hits = self._require_policy().lookup_host_prefix(request.block_hashes[:max_pages])
        return max(0, hits - local_pages)

    def _note_unadmitted(self, scheduled: dict[str, int]) -> None:
        """Unmet device demand the connector can see, fed to the policy's next decision
        (``note_device_demand``, in page bundles covering every KV cache group): the last
        waiting request offered this step that vLLM did not admit."""
        offered = self._offered
        if offered is None:
            return
        self._offered = None
        rid, pages = offered
        if rid not in scheduled and rid not in self._requests:
            self._require_policy().note_device_demand(self._bundles_for_pages(pages))

    def _bundles_for_pages(self, pages: int) -> int:
        """Policy blocks (page bundles of the sparse groups) that free the vLLM blocks
        ``pages`` pages need in every KV cache group."""
        return _cdiv(pages * self._num_kv_groups, len(self.sparse_group_ids))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Admitted: remember the request, lease its host-prefix hit (if vLLM took it) and
        reserve host blocks for the rest of its length."""
        rid = request.request_id
        if rid in self._requests:
            return
        offered, self._offered_hit = self._offered_hit, None
        prefix_pages = 0
        if num_external_tokens:
            if offered is None or offered[0] != rid or num_external_tokens % self.block_size:
                raise RuntimeError(
                    f"{CONNECTOR_NAME}: request {rid!r} allocated with {num_external_tokens} "
                    "external tokens this connector did not offer in whole pages")
            local_pages = offered[1]
            prefix_pages = local_pages + num_external_tokens // self.block_size
            policy = self._require_policy()
            hits = policy.acquire_host_prefix(request.block_hashes, max_pages=prefix_pages)
            if len(hits) != prefix_pages:
                policy.release_host_prefix(hits)
                raise RuntimeError(
                    f"{CONNECTOR_NAME}: request {rid!r}: a host prefix of {prefix_pages} pages "
                    f"was offered but only {len(hits)} are still published")
            self._host_hits[rid] = (hits, local_pages)
        self._requests[rid] = request
        need = self._host_pages_for(request) - prefix_pages
        self._host_remaining[rid] = need
        self._host_outstanding += need

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Finish or abort (not preemption): the free that follows ends it as finished."""
        self._finishing.add(request.request_id)
        return False, None

    # ==================================================================== device headroom
    def offer(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM offers a waiting request (the connector's ``get_num_new_matched_tokens``):
        the host-side answer (:meth:`get_num_new_matched_tokens`), then the device
        headroom gate (:meth:`_lacks_device_headroom`). ``(None, False)`` keeps the request
        waiting. Once one request is deferred, the later offers of the step wait too, as
        after a failed allocation in vLLM (first come, first served)."""
        if self._admission_closed and request.request_id not in self._requests:
            self._stats.add("num_admissions_deferred", 1)
            return None, False
        matched = self.get_num_new_matched_tokens(request, num_computed_tokens)
        if matched[0] is None or request.request_id in self._requests:
            return matched
        if self._lacks_device_headroom(request):
            self._admission_closed = True
            self._stats.add("num_admissions_deferred", 1)
            return None, False
        return matched

    def _lacks_device_headroom(self, request: Any) -> bool:
        """Whether admitting ``request`` now would leave the running requests too few free
        device blocks (docs/vllm-integration.md, "Admission headroom").

        vLLM admits a request as soon as its first chunk fits. Without the connector a
        pool that full is full of resident pages and that greedy rule over-commits it by
        one request at most. With the connector part of the pool is free because MIXED
        requests released their pages; a request admitted into that space leaves nothing
        for the others' growth, vLLM preempts it, re-admits it from its prefix-cache hits
        and preempts it again at the next page boundaries (``vllm-hisparse simulate``:
        3 preemptions against 1 without the connector).

        The request is admitted only if the free blocks cover, after it:

        * its whole prompt in every KV cache group (it stays resident while it prefills,
          R1; the first chunk alone admitted chunked prefills that could not continue),
          the rest of the prompt of every prefilling request and of every request let
          through earlier this step;
        * one page in every group for one request crossing a page boundary (what a
          crossing takes until the policy releases the page it made non-tail);
        * one page of each decoding request in the groups the policy does not manage
          (the indexer groups): growth that no release can offset.

        A shortfall is reported as device demand (``note_device_demand``), so the policy
        demotes to make that room. Cost: O(prefilling requests) per offer.
        """
        if self.device_pool is None:
            return False
        bs = self.block_size
        groups = self._num_kv_groups
        need = _cdiv(request.num_tokens + 1, bs)
        if not self._requests and not self._let_through:
            # Nothing runs that the headroom would protect: vLLM's own allocation decides
            # (else a prompt near the pool's size would wait forever on an idle engine).
            self._let_through[request.request_id] = need
            return False
        pages = need + 1 + sum(self._let_through.values())
        requests = self._requests
        for rid in self._prefilling:
            r = requests[rid]
            pages += max(_cdiv(r.num_tokens + 1, bs) - _cdiv(r.num_computed_tokens, bs), 0)
        num_decoding = len(requests) - len(self._prefilling)
        num_decoding -= sum(1 for rid in self._let_through if rid in requests)
        blocks = pages * groups + max(num_decoding, 0) * (groups - len(self.sparse_group_ids))
        free = self.device_pool.block_pool.get_num_free_blocks()
        if blocks > free:
            self._require_policy().note_device_demand(_cdiv(blocks - free, len(self.sparse_group_ids)))
            return True
        self._let_through[request.request_id] = need
        return False

    # ==================================================================== the step
    def build_connector_meta(self, scheduler_output: Any) -> HiSparseConnectorMetadata:
        """Feed the step to the policy; return its command (``scheduler_output`` untouched).

        Per step: the state rows of the scheduled requests (cached while the scheduled set
        is unchanged), one vectorised ``schedule_rows`` call in which each request that
        crosses into new pages adopts vLLM's blocks through ``_adopt_pages``, and the
        policy's command. Prefilling requests are re-checked first (R1, O(prefilling)).
        """
        policy = self._require_policy()
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        # The admission pass of this step is over (offer).
        if self._let_through:
            self._let_through.clear()
        self._admission_closed = False
        self._note_unadmitted(scheduled)
        if self._prefilling:
            self._update_prefilling(scheduled)
        new_rows: dict[str, int] = {}
        if scheduled:
            n = len(scheduled)
            keys = tuple(scheduled)
            counts = np.fromiter(scheduled.values(), dtype=np.int64, count=n)
            if keys == self._cached_keys:
                # Same requests as the previous step, in the same order: same rows.
                rows = self._cached_rows
            else:
                row_of = self._row_of
                rows = np.fromiter((row_of.get(rid, -1) for rid in keys), dtype=np.int64, count=n)
                for i in (rows < 0).nonzero()[0].tolist():
                    rid = keys[i]
                    rows[i] = new_rows[rid] = self._add_request(rid)
                    # A prefix hit: vLLM's computed tokens not adopted as a host prefix are
                    # new to the policy (a device prefix-cache hit).
                    counts[i] += self._requests[rid].num_computed_tokens - self._adopted_tokens
                    self._adopted_tokens = 0
                self._cached_keys, self._cached_rows = keys, rows
            # One vectorised call; requests crossing into new pages adopt vLLM's blocks.
            outcome = policy.schedule_rows(rows, counts, self._adopt_pages)
            if np.count_nonzero(outcome):
                # Admission reserved host blocks for every request and R1 keeps prefilling
                # requests FULL, so this is an accounting error, not back-pressure; refuse
                # loudly rather than lose KV.
                refused = outcome.nonzero()[0][:8].tolist()
                raise RuntimeError(
                    f"{CONNECTOR_NAME}: residency policy refused requests "
                    f"{[keys[i] for i in refused]} (outcomes "
                    f"{[Outcome(int(outcome[i])).name for i in refused]}; host pool: "
                    f"{self.host_pool.num_allocatable_blocks} allocatable, "
                    f"{self._host_outstanding} reserved; a prefilling request must be fully "
                    "resident, requirement R1 in docs/core.md)")
        command = policy.build_step()
        self._apply_command(command)
        indexer_pages, self._step_indexer_pages = self._step_indexer_pages, {}
        if self.host_prefix_cache and scheduled:
            self._plan_indexer_saves(keys, rows, counts, command, indexer_pages)
        return HiSparseConnectorMetadata(
            command=command, new_rows=new_rows, bundles=self._bundles_of(command),
            indexer_pages=indexer_pages,
        )

    # ------------------------------------------------------------------ host-prefix cache
    def _plan_indexer_saves(self, keys: tuple, rows: np.ndarray, counts: np.ndarray,
                            command: StepCommand, indexer_pages: dict[int, IndexerPages]) -> None:
        """Indexer pages of the pages this step's forward completes ride with its MIRROR.

        The forward writes a completed page's last rows, so that MIRROR is what makes the
        page clean, and the worker saves the indexer pages ahead of it on the same stream:
        a page is clean only once its indexer page is on the host too. The policy gets
        the pages' identities (vLLM's block hashes) now and publishes each page when it
        is clean, even if its request ended meanwhile; identities not known yet (a token
        still a placeholder under async scheduling) are given when the mirror completes,
        if the request still runs. A failed mirror or indexer save revokes them
        (``update_connector_output``). Cost: O(scheduled) numpy, plus the pages completed."""
        policy = self._require_policy()
        t = policy.tables
        bs = self.block_size
        after = t.num_tokens[rows]
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
        for i in done.tolist():
            rid, row = keys[i], int(rows[i])
            serial = int(t.serial[row])
            first, end = int(full_before[i]), int(full_after[i])
            hashes = self._requests[rid].block_hashes
            known = min(end, len(hashes))
            if known > first:
                policy.set_block_hashes(rid, first, hashes[first:known])
            for page in range(first, end):
                host_block = int(t.host_block[row, page])
                if host_block < 0:
                    continue
                for g, table in enumerate(idx_tables):
                    device[g].append(table[rid][page].block_id)
                host.append(host_block)
                pending.append((rid, serial, page, host_block, page < known))
        if pending:
            indexer_pages[mirror.transfer_id] = IndexerPages(device, host, to_host=True)
            self._identity_pending[mirror.transfer_id] = pending

    def _give_late_identities(self, entries: list[tuple[str, int, int, int, bool]]) -> None:
        """Identities not known when the pages' mirror was planned, now that it completed
        (the policy publishes each page once it is also clean). Pages of requests that
        ended or restarted since are skipped."""
        policy = self._require_policy()
        serial_of = policy.tables.serial
        for rid, serial, page, _, given in entries:
            if given:
                continue
            row = self._row_of.get(rid)
            if row is None or int(serial_of[row]) != serial:
                continue
            hashes = self._requests[rid].block_hashes
            if page < len(hashes):
                policy.set_block_hashes(rid, page, [hashes[page]])

    def _revoke_identities(self, tid: int) -> None:
        entries = self._identity_pending.pop(tid, None)
        if entries:
            self._require_policy().revoke_block_hashes(
                tid, [(rid, serial, page, host) for rid, serial, page, host, _ in entries])

    def _adopt_host_prefix(self, rid: str) -> int:
        """A new request with a leased host prefix: the policy adopts vLLM's blocks for
        its pages and loads those not already on the device (sparse-MLA rows through
        the policy's RESTORE, indexer pages with it). Returns the tokens adopted."""
        hits, local_pages = self._host_hits.pop(rid)
        policy = self._require_policy()
        n = len(hits)
        tables = [m.req_to_blocks[rid] for m in self._managers]
        adopt = self.device_pool.adopt
        leads = [adopt([table[p] for table in tables]) for p in range(n)]
        load_id = policy.adopt_host_prefix(rid, leads, hits, local_pages)
        policy.set_block_hashes(rid, 0, self._requests[rid].block_hashes[:n])
        if load_id >= 0:
            self._step_indexer_pages[load_id] = IndexerPages(
                [[m.req_to_blocks[rid][p].block_id for p in range(local_pages, n)]
                 for m in self._indexer_managers],
                hits[local_pages:], to_host=False)
        return n * self.block_size

    # ------------------------------------------------------------------ R1: prefilling
    def _is_prefilling(self, request: Any) -> bool:
        """True while the request has prompt tokens to compute, or more than
        ``max_decode_query_len`` known tokens left (a recompute after vLLM's preemption):
        any step of it may schedule prefill tokens, which read the whole context (R1)."""
        computed = request.num_computed_tokens
        return computed < request.num_prompt_tokens or computed + self.max_decode_query_len < request.num_tokens

    def _update_prefilling(self, scheduled: dict[str, int]) -> None:
        """Tell the policy which prefilling requests completed their prompt (before this
        step's schedule, so the admission-window demotion fires at the first decode step),
        and report the pages the others' next chunks will need as device demand."""
        policy = self._require_policy()
        done = []
        left = 0
        for rid in self._prefilling:
            request = self._requests[rid]
            if not self._is_prefilling(request):
                done.append(rid)
                continue
            left += max(request.num_tokens - request.num_computed_tokens - scheduled.get(rid, 0), 0)
        for rid in done:
            self._prefilling.discard(rid)
            policy.set_prefilling(rid, False)
        if left:
            pages = _cdiv(min(left, self._max_chunk_tokens), self.block_size) + 1
            policy.note_device_demand(self._bundles_for_pages(pages))

    def _add_request(self, rid: str) -> int:
        request = self._requests.get(rid)
        if request is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: request {rid!r} scheduled without update_state_after_alloc")
        prefilling = self._is_prefilling(request)
        result = self._require_policy().add_request(rid, prefilling=prefilling)
        if prefilling:
            self._prefilling.add(rid)
        self._row_of[rid] = result.row
        self._rid_of_row[result.row] = rid
        self._cached_keys = None
        if rid in self._host_hits:
            self._adopted_tokens = self._adopt_host_prefix(rid)
        return result.row

    def _adopt_pages(self, row: int, first_page: int, num_pages: int) -> list[int]:
        """``schedule_rows`` callback: a request crosses into ``num_pages`` new pages from
        ``first_page``; adopt vLLM's blocks for them (one bundle per page) and count the
        host blocks the policy is about to take against the request's reservation."""
        rid = self._rid_of_row[row]
        tables = [m.req_to_blocks[rid] for m in self._managers]
        end = first_page + num_pages
        if len(tables[0]) < end:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: request {rid!r} scheduled to {end} pages but vLLM "
                f"allocated {len(tables[0])} blocks in sparse group {self.sparse_group_ids[0]}"
            )
        adopt = self.device_pool.adopt
        leads = [adopt([table[p] for table in tables]) for p in range(first_page, end)]
        remaining = self._host_remaining.get(rid, 0)
        used = min(num_pages, remaining)
        self._host_remaining[rid] = remaining - used
        self._host_outstanding -= used
        return leads

    def _apply_command(self, command: StepCommand) -> None:
        """Mirror the command's page losses/restores into vLLM's block tables; track
        residency and hot leases for metrics. Cost: proportional to the command."""
        for row in command.cleared_rows:
            self._hot_rows.discard(row)
        for lease in command.hot_leases:
            if lease.block_ids:
                self._hot_rows.add(lease.row)
            else:
                self._hot_rows.discard(lease.row)
        for change in command.residency_changes:
            if change.residency == Residency.FULL:
                self._non_full.discard(change.request_id)
            else:
                self._non_full.add(change.request_id)
        if not command.page_rows:
            return
        rid_of_row = self._rid_of_row
        lead_manager = self._managers[0]
        for row, page, device in zip(command.page_rows, command.page_indices, command.page_device_blocks):
            rid = rid_of_row[row]
            if rid is None:
                continue
            table = lead_manager.req_to_blocks.get(rid)
            if table is None or page >= len(table):
                continue
            if device < 0:
                if not table[page].is_null:
                    for manager in self._managers:
                        manager.null_page(rid, page)
            elif table[page].block_id != device:
                for manager, block in zip(self._managers, self.device_pool.bundle(device)):
                    manager.set_page(rid, page, block)

    def _bundles_of(self, command: StepCommand) -> dict[int, list[int]]:
        """Every sparse group's block for each device block the command names (G > 1)."""
        pool = self.device_pool
        if pool.num_groups == 1:
            return {}
        if not command.page_device_blocks and not command.hot_leases and len(command.transfers) <= 1:
            # Typical decode step: no page update, no lease, only the mirror (no blocks).
            if not command.transfers or not command.transfers[0].device_blocks:
                return {}
        leads = {b for b in command.page_device_blocks if b >= 0}
        for lease in command.hot_leases:
            leads.update(lease.block_ids)
        for transfer in command.transfers:
            leads.update(transfer.device_blocks)
        return {lead: pool.bundle_block_ids(lead) for lead in leads}

    # ==================================================================== frees
    def on_blocks_freed(self, group_index: int, request_id: str, blocks: list) -> list:
        """``ResidencyAwareManager`` callback (every free path). The first sparse group
        to be freed ends the request in the policy; each group's blocks past the pages
        the policy adopted are returned to vLLM to free."""
        state = self._freeing.get(request_id)
        if state is None:
            row = self._row_of.get(request_id)
            num_pages = 0
            if row is not None:
                num_pages = int(self._require_policy().tables.num_pages[row])
                self._end_request(request_id)
            else:
                self._forget(request_id)
            state = self._freeing[request_id] = [num_pages, len(self._managers)]
        state[1] -= 1
        if state[1] == 0:
            del self._freeing[request_id]
        return [b for b in blocks[state[0]:] if not b.is_null]

    def _end_request(self, rid: str) -> None:
        policy = self._require_policy()
        if rid in self._finishing:
            policy.finish(rid)
        else:
            # vLLM preemption: the request restarts from zero tokens, so the policy
            # forgets it (its durable pages would only matter for a host-prefix hit).
            self._stats.add("num_preemptions", 1)
            self.num_preemptions += 1
            policy.abort(rid)
        row = self._row_of.pop(rid)
        self._rid_of_row[row] = None
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        hit = self._host_hits.pop(rid, None)
        if hit is not None:  # freed before it was ever scheduled
            self._require_policy().release_host_prefix(hit[0])
        self._cached_keys = None
        self._prefilling.discard(rid)
        self._requests.pop(rid, None)
        self._finishing.discard(rid)
        self._non_full.discard(rid)
        self._host_outstanding -= self._host_remaining.pop(rid, 0)

    # ==================================================================== acks
    def update_connector_output(self, connector_output: Any) -> None:
        """Apply the workers' transfer acks (unanimous completion, any-failure)."""
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, HiSparseWorkerMetadata):
            raise TypeError(
                f"{CONNECTOR_NAME}: expected HiSparseWorkerMetadata from the workers, got {type(meta).__name__}"
            )
        # Before the acks that make pages clean (a clean page with an identity is
        # published): a worker that failed to save indexer pages reports it no later
        # than its own completion of the mirror.
        for tid in meta.failed_indexer_saves:
            self._revoke_identities(tid)
        acks = meta.acks
        if acks.is_empty():
            return
        policy = self._require_policy()
        if self.num_workers > 1:
            acks = self._count_acks(acks)
        if self._identity_pending:
            for tid in acks.failed:  # the pages may become clean later, by a spill
                self._revoke_identities(tid)
            for tid in acks.completed:
                entries = self._identity_pending.pop(tid, None)
                if entries:
                    self._give_late_identities(entries)
        policy.apply_acks(acks)

    def _count_acks(self, acks: WorkerAcks) -> WorkerAcks:
        """Turn per-worker reports into transfer-level outcomes (N workers)."""
        n = self.num_workers
        failed = [tid for tid in dict.fromkeys(acks.failed) if tid not in self._failed_ids]
        for tid in failed:
            self._failed_ids.add(tid)
            self._ack_completed.pop(tid, None)
        done_enq, done_comp = [], []
        for tid in acks.enqueued:
            if tid in self._failed_ids:
                continue
            c = self._ack_enqueued[tid] = self._ack_enqueued.get(tid, 0) + 1
            if c == n:
                done_enq.append(tid)
        for tid in acks.completed:
            if tid in self._failed_ids:
                continue
            c = self._ack_completed[tid] = self._ack_completed.get(tid, 0) + 1
            if c == n:
                done_comp.append(tid)
                del self._ack_completed[tid]
                self._ack_enqueued.pop(tid, None)
        # An enqueue count that never reached n is moot once the transfer is closed.
        for tid in failed:
            self._ack_enqueued.pop(tid, None)
        # Only drop ids from the failure set once every worker could have reported.
        return WorkerAcks(enqueued=done_enq, completed=done_comp, failed=failed)

    # ==================================================================== queries
    def has_pending_block_frees(self) -> bool:
        """True when acks already in flight will release device blocks.

        vLLM calls this only when an allocation for a running request failed, so it is
        also unmet demand: one page in every group is noted for the policy's next
        decision (``note_device_demand``). Pages whose host copy is being completed
        (a mirror or spill in flight) are released as soon as the ack arrives, and
        transfers of ended requests return their leases: only then is waiting better
        than preempting (``num_device_blocks_pending_release() > 0``); otherwise vLLM
        must preempt (waiting could stall).
        """
        policy = self.policy
        if policy is None:
            return False
        policy.note_device_demand(self._bundles_for_pages(1))
        if policy.num_open_transfers == 0 or policy.num_device_blocks_pending_release() <= 0:
            return False
        self._stats.add("num_preemptions_avoided", 1)
        return True

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while transfers wait for their acks."""
        return self.policy is not None and self.policy.num_open_transfers > 0

    def get_kv_connector_stats(self) -> HiSparseConnectorStats | None:
        """Counters since the previous report plus current gauges; None when nothing to say.

        vLLM asks every step, and a mirror is always open, so reports are throttled: at
        most one every ``_STATS_EVERY_STEPS`` calls (counters are deltas, so nothing is
        lost, only delayed; gauges are levels).
        """
        policy = self.policy
        if policy is None:
            return None
        self._stats_calls += 1
        if self._stats_calls < _STATS_EVERY_STEPS:
            return None
        self._stats_calls = 0
        stats = self._stats
        for field_name, key in _POLICY_COUNTERS.items():
            value = getattr(policy.stats, field_name)
            stats.add(key, value - self._policy_stats_seen[field_name])
            self._policy_stats_seen[field_name] = value
        if stats.is_empty() and not self._non_full and policy.num_open_transfers == 0:
            return None
        host = self.host_pool
        stats.set_gauge("num_hot_leases", len(self._hot_rows))
        stats.set_gauge("num_host_blocks_used", host.num_blocks - host.num_free_blocks - host.num_cached_blocks)
        stats.set_gauge("num_host_blocks_total", host.num_blocks)
        stats.set_gauge("num_pending_transfers", policy.num_open_transfers)
        stats.set_gauge("num_mixed_requests", len(self._non_full))
        self._stats = HiSparseConnectorStats()
        return stats

    def is_idle(self) -> bool:
        """No request and no transfer open (pools should be at rest)."""
        return self.policy is not None and self.policy.is_idle() and not self._requests
