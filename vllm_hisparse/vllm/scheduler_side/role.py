"""The scheduler role of ``HiSparseResidencyConnector``: core policy ↔ vLLM's scheduler.

The role is one object; its admission gate (``admission``), host-prefix cache
(``host_prefix_cache``) and ack intake (``scheduler_side/acks.py``) live in their own modules
as mixins over this state.

Division of labour
------------------
* **vLLM allocates every page.** The sparse-MLA groups keep vLLM's full-attention
  allocation (admission, chunked prefill, prefix-cache hits, preemption all stay
  vLLM's). A page's blocks (one per sparse group, a *bundle*, see
  ``scheduler_side/block_pool.py``) are handed to the core :class:`~vllm_hisparse.core.ResidencyPolicy`
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
vLLM's blocks through a callback), takes the policy's
:class:`~vllm_hisparse.core.StepCommand`, applies its page losses to vLLM's block tables
(null blocks), and returns the command as metadata. The one field of
``scheduler_output`` it sets is ``has_sync_kv_loads`` (the worker applies the command
before the forward; docs/vllm-integration.md, "Step order"). ``update_connector_output`` votes the worker acks per (transfer,
worker) and applies them (``scheduler_side/acks.py``). The work is proportional to the scheduled
requests (one dict walk and a few numpy operations) plus what changed this step.

Requirement R1 (docs/core.md): the policy is told which requests are prefilling (a
prompt not fully computed, or a recompute), so it never demotes them or releases their
pages; vLLM's prefill reads the whole context through the block table.

Preemption: vLLM recomputes a preempted request, so the policy ends it (``abort``),
which publishes its clean pages; when vLLM re-admits it, they are host-prefix hits, so
only its partial last page is recomputed.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import numpy as np

from vllm_hisparse.core.ack_vote import AckVote
from vllm_hisparse.core.commands import Residency, StepCommand
from vllm_hisparse.core.host_blocks import HostBlockPool
from vllm_hisparse.core.policy import Outcome, PolicyConfig, ResidencyPolicy
from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.scheduler_side.admission import AdmissionGate
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME, HiSparseResidencyConfig
from vllm_hisparse.vllm.scheduler_side.block_pool import BlockPoolDevicePool
from vllm_hisparse.vllm.setup.capacity_report import engine_capacity_report, format_capacity_table
from vllm_hisparse.vllm.setup.kv_plan import indexer_group_ids, sparse_group_ids
from vllm_hisparse.vllm.scheduler_side.host_prefix import HostPrefixCache
from vllm_hisparse.vllm.pd.landings import PDLandings
from vllm_hisparse.vllm.patches.lockstep import lockstep_groups
from vllm_hisparse.vllm.scheduler_side.managers import ResidencyAwareManager, residency_manager_group_ids
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata, IndexerPages
from vllm_hisparse.vllm.metrics import POLICY_COUNTERS, HiSparseConnectorStats
from vllm_hisparse.vllm.setup.offloading_scope import describe_scope, is_scoped
from vllm_hisparse.vllm.scheduler_side.acks import AckIntake
from vllm_hisparse.vllm.scheduler_side.drafts import DraftRollback

logger = logging.getLogger(__name__)

#: get_kv_connector_stats reports at most once per this many calls (steps).
_STATS_EVERY_STEPS = 16


class SchedulerRole(PDLandings, AdmissionGate, HostPrefixCache, AckIntake, DraftRollback):
    """Scheduler side of ``HiSparseResidencyConnector``: owns the host pool, the policy and
    the ack vote (see the module docstring)."""

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

        report = engine_capacity_report(vllm_config, kv_cache_config, hisparse_config)
        logger.info("%s", format_capacity_table(report))
        if is_scoped(kv_cache_config):
            logger.info("%s", describe_scope(kv_cache_config))
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
            max_pages_per_request=cdiv(self.max_model_len, self.block_size),
            device_buffer_size_rows=hisparse_config.device_buffer_size,
            admission_window_pages=cdiv(sched.max_num_batched_tokens, self.block_size),
            eager_host_mirror=hisparse_config.eager_host_mirror,
            low_watermark_blocks=low,
            high_watermark_blocks=high,
            hot_sizing=hisparse_config.hot_sizing(),
        )
        # Every rank of the replica runs a worker role that acks each transfer.
        num_workers = max(1, vllm_config.parallel_config.world_size)

        # Bound in bind_kv_cache_manager (vLLM builds the KVCacheManager after us).
        self.policy: ResidencyPolicy | None = None
        self.device_pool: BlockPoolDevicePool | None = None
        self._managers: list[ResidencyAwareManager] = []
        self._indexer_managers: list[Any] = []

        # Host tier as a prefix cache (decided in bind_kv_cache_manager).
        self.host_prefix_cache = False
        # Host-prefix hits offered and leased, until vLLM allocates for the request (its
        # update_state_after_alloc may come a step later: defer_async_loads):
        # id -> (host blocks, local pages, request).
        self._offered_hits: dict[str, tuple[list[int], int, Any]] = {}
        self._kv_cache_manager: Any = None
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
        # Admission (admission.py): requests let through this step (id -> prompt pages
        # still to allocate), vLLM's admission watermark as configured, the request just
        # offered without host backing, and the admitted requests that run unmanaged.
        self._let_through: dict[str, int] = {}
        # Blocks residency spares, in vLLM blocks, computed at the first offer of a pass.
        self._spared_blocks: int | None = None
        # Requests admitted with a host-prefix load that have not run yet: id -> prompt
        # pages still to allocate (reserved in the admission watermark).
        self._loading: dict[str, int] = {}
        self._base_watermark_blocks = 0
        self._offered_unmanaged: str | None = None
        self._unmanaged: set[str] = set()
        # get_kv_connector_stats: report at most every _STATS_EVERY_STEPS calls.
        self._stats_calls = 0
        # The acks: one vote per (transfer, worker rank); a transfer without every
        # worker's final ack for ack_deadline_s stops the engine (check_ack_deadline).
        self._vote = AckVote(num_workers, "worker")
        self.ack_deadline_s = hisparse_config.ack_deadline_s
        self._num_steps = 0
        self._duplicates_seen = 0
        self._duplicates_logged_s = -math.inf
        # Metrics.
        self._stats = HiSparseConnectorStats()
        self._policy_stats_seen = {k: 0 for k in POLICY_COUNTERS}
        self.num_preemptions = 0  # lifetime count (tests, tools)
        self._init_pd_imports(vllm_config)  # P/D decode consumer (pd/landings.py)

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
        step_pages = cdiv(sched.max_num_batched_tokens, self.block_size) + min(
            sched.max_num_seqs, sched.max_num_batched_tokens
        )
        step_blocks = step_pages * num_groups
        bundles = (kv_cache_config.num_blocks - 1) // num_sparse
        low = min(cdiv(step_blocks, num_sparse), bundles // 2)
        high = min(low + hisparse_config.hot_blocks_per_request + cdiv(bundles, 20), bundles)
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
        self._kv_cache_manager = kv_cache_manager
        self.device_pool = BlockPoolDevicePool(kv_cache_manager.block_pool, len(managers))
        self._base_watermark_blocks = compat.admission_watermark_blocks(kv_cache_manager)
        # Our groups move in lockstep: vLLM's per-group loops answer from the first group
        # on steps with nothing to allocate or cache (lockstep.py).
        coordinator = compat.kv_cache_coordinator(kv_cache_manager)
        if lockstep_groups(coordinator):
            patches.LOCKSTEP_COORDINATOR.install(coordinator)
        else:
            logger.info("%s: KV cache groups not in lockstep (%s); vLLM's per-group loops run "
                        "unchanged", CONNECTOR_NAME, type(coordinator).__name__)
        self.policy = ResidencyPolicy(self.policy_config, self.device_pool, self.host_pool)
        self.host_prefix_cache = self._host_prefix_cache_usable(kv_cache_manager)

    def _require_policy(self) -> ResidencyPolicy:
        if self.policy is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: scheduler role used before bind_kv_cache_manager")
        return self.policy

    # ==================================================================== finishing
    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Finish or abort (not preemption): the free that follows ends it as finished."""
        self._finishing.add(request.request_id)
        self._pd_finished(request)  # a P/D request aborted while waiting (pd/landings.py)
        return False, None

    # ==================================================================== the step
    def build_connector_meta(self, scheduler_output: Any) -> HiSparseConnectorMetadata:
        """Feed the step to the policy; return its command (of ``scheduler_output`` only
        ``has_sync_kv_loads`` is set, on steps that run a forward).

        Per step: the state rows of the scheduled requests (cached while the scheduled set
        is unchanged), one vectorised ``schedule_rows`` call in which each request that
        crosses into new pages adopts vLLM's blocks through ``_adopt_pages``, and the
        policy's command. Prefilling requests are re-checked first (R1, O(prefilling)).
        """
        policy = self._require_policy()
        self.check_ack_deadline()
        self._roll_back_rejected()  # the previous step's drafts, if no ack came to do it
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        if scheduled:
            # The worker must apply this step's command before the forward reads KV. MRV2
            # calls start_load_kv before the forward only for steps with synchronous loads
            # (after it otherwise), so every step that runs a forward asks for that order.
            compat.request_load_before_forward(scheduler_output)
        # The admission pass of this step is over (offer).
        self._note_unadmitted(scheduled)
        if self._offered_hits:
            self._drop_stale_offers()
        self._end_admission_pass()
        if self._unmanaged:
            # Requests the host pool could not back run as vLLM runs them without us.
            scheduled = {rid: n for rid, n in scheduled.items() if rid not in self._unmanaged}
        if self._loading:
            for rid in [rid for rid in self._loading if scheduled.get(rid)]:
                del self._loading[rid]  # its load is done and it runs: vLLM allocated the rest
        if self._prefilling:
            self._update_prefilling(scheduled)
        new_rows: dict[str, int] = {}
        if self._loads_to_start:
            self._start_loads(new_rows)
        imports = self._start_imports(new_rows) if self._pd_pending() else []
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
            self._remember_spec_step(keys, rows)
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
        self._num_steps += 1
        if command.transfers:
            self._vote.expect((t.transfer_id for t in command.transfers), self._num_steps,
                              time.monotonic())
        self._apply_command(command)
        indexer_pages, self._step_indexer_pages = self._step_indexer_pages, {}
        if self.host_prefix_cache and scheduled:
            self._plan_indexer_saves(keys, rows, counts, command, indexer_pages)
        return HiSparseConnectorMetadata(
            command=command, new_rows=new_rows, bundles=self._bundles_of(command),
            indexer_pages=indexer_pages, load_requests=self._take_load_requests(),
            imports=imports, heartbeats=self._pd_heartbeats(),
        )

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
            pages = cdiv(min(left, self._max_chunk_tokens), self.block_size) + 1
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

    def _take_load_requests(self) -> dict[int, str]:
        loads, self._load_requests = self._load_requests, {}
        return loads

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
        self._pd_ending(rid)
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
        self._drop_offer(rid)
        self._pd_forget(rid)
        hit = self._host_hits.pop(rid, None)
        if hit is not None:  # freed before it was ever scheduled
            self._require_policy().release_host_prefix(hit[0])
        self._cached_keys = None
        self._prefilling.discard(rid)
        self._requests.pop(rid, None)
        self._finishing.discard(rid)
        self._unmanaged.discard(rid)
        self._loading.pop(rid, None)
        self._non_full.discard(rid)
        self._host_outstanding -= self._host_remaining.pop(rid, 0)

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
        for field_name, key in POLICY_COUNTERS.items():
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
