"""The scheduler role of ``HiSparseResidencyConnector``: core policy ↔ vLLM's scheduler.

:class:`SchedulerRole` owns its parts and calls each by name (its class docstring says
which part answers which connector verb); the parts share the role's
:class:`~vllm_hisparse.vllm.scheduler_side.request_book.RequestBook` and
:class:`~vllm_hisparse.vllm.scheduler_side.geometry.SchedulerGeometry`, and none reads
another's state.

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
from typing import Any

import numpy as np

from vllm_hisparse.core.commands import StepCommand
from vllm_hisparse.core.host_blocks import HostBlockPool
from vllm_hisparse.core.policy import Outcome, ResidencyPolicy
from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata
from vllm_hisparse.vllm.metrics import POLICY_COUNTERS, HiSparseConnectorStats
from vllm_hisparse.vllm.patches.lockstep import lockstep_groups
from vllm_hisparse.vllm.pd.landings import PDLandings
from vllm_hisparse.vllm.scheduler_side.acks import AckIntake
from vllm_hisparse.vllm.scheduler_side.admission import AdmissionGate
from vllm_hisparse.vllm.scheduler_side.block_pool import BlockPoolDevicePool
from vllm_hisparse.vllm.scheduler_side.drafts import DraftRollback
from vllm_hisparse.vllm.scheduler_side.geometry import SchedulerGeometry
from vllm_hisparse.vllm.scheduler_side.host_prefix import HostPrefixService
from vllm_hisparse.vllm.scheduler_side.managers import ResidencyAwareManager, residency_manager_group_ids
from vllm_hisparse.vllm.scheduler_side.request_book import RequestBook
from vllm_hisparse.vllm.setup.capacity_report import engine_capacity_report, format_capacity_table
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME, HiSparseResidencyConfig
from vllm_hisparse.vllm.setup.offloading_scope import describe_scope, is_scoped

logger = logging.getLogger(__name__)

#: get_kv_connector_stats reports at most once per this many calls (steps).
_STATS_EVERY_STEPS = 16


class SchedulerRole:
    """Scheduler side of ``HiSparseResidencyConnector``: owns the host pool, the policy and
    these parts (module docstring for the division of labour):

    * ``geometry`` (:class:`SchedulerGeometry`): block size, KV cache groups, budgets;
    * ``book`` (:class:`RequestBook`): admitted requests, state rows, phases, host
      reservations;
    * ``admission`` (:class:`AdmissionGate`): device headroom and host backing of offers;
    * ``host_prefix`` (:class:`HostPrefixService`): host pages served as prefix hits;
    * ``acks`` (:class:`AckIntake`): the workers' acks voted, the ack deadline;
    * ``drafts`` (:class:`DraftRollback`): rejected speculative drafts rolled back;
    * ``landings`` (:class:`~vllm_hisparse.vllm.pd.landings.PDLandings`, None when this
      instance reads no P/D request).

    Verbs and who answers them:

    * ``bind_kv_cache_manager``: the role (policy, managers), then every part's ``bind``;
    * ``offer`` (vLLM's ``get_num_new_matched_tokens``): ``landings`` for a P/D request
      it claims, else ``admission``;
    * ``on_new_request``: ``landings``;
    * ``update_state_after_alloc``: ``landings`` for an allocation it offered, else
      ``admission``;
    * ``build_connector_meta``: the role, calling the parts in step order;
    * ``update_connector_output``: ``landings`` (imports), ``drafts``, ``acks``, then the
      policy;
    * ``request_finished_all_groups``, ``on_blocks_freed`` and ``import_null_pages``
      (``ResidencyAwareManager``'s owner): the role, with ``book`` and ``landings``;
    * ``has_pending_block_frees``, ``has_pending_push_work``, ``get_kv_connector_stats``,
      ``is_idle``: the role, from the policy.
    """

    def __init__(
        self,
        vllm_config: compat.VllmConfig,
        hisparse_config: HiSparseResidencyConfig,
        kv_cache_config: compat.KVCacheConfig,
    ) -> None:
        geometry = self.geometry = SchedulerGeometry.of_engine(vllm_config, hisparse_config, kv_cache_config)
        # Our manager for the sparse groups, chosen by group role. This must happen
        # before the scheduler builds its KVCacheManager, i.e. here (see compat).
        compat.register_residency_manager(ResidencyAwareManager)
        # The other full-attention groups get it too, unbound: one manager class keeps
        # vLLM's per-group call sites fast (managers.residency_manager_group_ids).
        compat.assign_group_role(
            kv_cache_config, residency_manager_group_ids(kv_cache_config, geometry.sparse_group_ids))

        report = engine_capacity_report(vllm_config, kv_cache_config, hisparse_config)
        logger.info("%s", format_capacity_table(report))
        if is_scoped(kv_cache_config):
            logger.info("%s", describe_scope(kv_cache_config))
        self.capacity_report = report
        self.host_pool = HostBlockPool(report.host_blocks)

        self.policy_config = geometry.policy_config(vllm_config.scheduler_config, kv_cache_config,
                                                    hisparse_config)

        # Bound in bind_kv_cache_manager (vLLM builds the KVCacheManager after us).
        self.policy: ResidencyPolicy | None = None
        self.device_pool: BlockPoolDevicePool | None = None
        self.managers: list[ResidencyAwareManager] = []
        self.indexer_managers: list[Any] = []

        # Counters since the last report, shared by the parts (get_kv_connector_stats).
        self.stats = HiSparseConnectorStats()
        self._policy_stats_seen = {k: 0 for k in POLICY_COUNTERS}
        self._stats_calls = 0
        self.num_preemptions = 0  # lifetime count (tests, tools)

        self.book = RequestBook(self.policy_config.max_num_rows, geometry.max_decode_query_len)
        self.host_prefix = HostPrefixService(geometry, self.book)
        self.admission = AdmissionGate(geometry, self.book, self.host_prefix, self.host_pool, self.stats)
        # Every rank of the replica runs a worker role that acks each transfer.
        num_workers = max(1, vllm_config.parallel_config.world_size)
        self.acks = AckIntake(num_workers, hisparse_config.ack_deadline_s, self.stats)
        self.drafts = DraftRollback(self.book, geometry.max_decode_query_len)
        self.landings = PDLandings.for_engine(vllm_config, geometry, self.book, self.admission,
                                              self.host_pool, self.stats)

    @property
    def num_workers(self) -> int:
        """Workers that ack every transfer (the replica's world size)."""
        return self.acks.num_workers

    @num_workers.setter
    def num_workers(self, value: int) -> None:
        self.acks.num_workers = value

    # ==================================================================== binding
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Bind the policy to vLLM's ``BlockPool`` and our managers of the sparse groups."""
        geometry = self.geometry
        managers = compat.group_managers(kv_cache_manager, geometry.sparse_group_ids)
        for group_id, manager in zip(geometry.sparse_group_ids, managers):
            if not isinstance(manager, ResidencyAwareManager):
                raise RuntimeError(
                    f"{CONNECTOR_NAME}: KV cache group {group_id} is managed by "
                    f"{type(manager).__name__}, not ResidencyAwareManager; the group role "
                    f"{compat.RESIDENCY_GROUP_ROLE!r} was not honoured (was the KVCacheManager "
                    "built before the connector?)"
                )
        for index, manager in enumerate(managers):
            manager.bind_residency(self, index)
        self.managers = managers
        self.indexer_managers = compat.group_managers(kv_cache_manager, geometry.indexer_group_ids)
        device_pool = self.device_pool = BlockPoolDevicePool(kv_cache_manager.block_pool, len(managers))
        # Our groups move in lockstep: vLLM's per-group loops answer from the first group
        # on steps with nothing to allocate or cache (lockstep.py).
        coordinator = compat.kv_cache_coordinator(kv_cache_manager)
        if lockstep_groups(coordinator):
            patches.LOCKSTEP_COORDINATOR.install(coordinator)
        else:
            logger.info("%s: KV cache groups not in lockstep (%s); vLLM's per-group loops run "
                        "unchanged", CONNECTOR_NAME, type(coordinator).__name__)
        policy = self.policy = ResidencyPolicy(self.policy_config, device_pool, self.host_pool)
        self.admission.bind(policy, kv_cache_manager, device_pool)
        self.host_prefix.bind(policy, kv_cache_manager, managers, self.indexer_managers, device_pool)
        self.drafts.bind(policy)
        if self.landings is not None:
            self.landings.bind(policy, device_pool, managers, self.indexer_managers)

    def _require_policy(self) -> ResidencyPolicy:
        if self.policy is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: scheduler role used before bind_kv_cache_manager")
        return self.policy

    # ==================================================================== admission
    def offer(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM offers a waiting request (the connector's ``get_num_new_matched_tokens``):
        a P/D request the landings claim gets its landing (``None`` keeps it waiting for
        room); any other goes to the admission gate, unless it must wait for the hot
        regions of host landings admitted earlier in this pass."""
        landings = self.landings
        if landings is not None:
            remote = landings.claim(request)
            if remote is not None:
                return landings.offer(request, num_computed_tokens, remote)
            if landings.holds_back(request, num_computed_tokens):
                return None, False
        return self.admission.offer(request, num_computed_tokens)

    def on_new_request(self, request: Any) -> None:
        """A request arrived: a P/D request's ``kv_transfer_params`` are checked now."""
        if self.landings is not None:
            self.landings.on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated for ``request``: the landings admit what they offered, the
        admission gate everything else."""
        landings = self.landings
        if landings is not None and landings.claims_allocation(request):
            landings.admit(request, blocks, num_external_tokens)
        else:
            self.admission.admit(request, blocks, num_external_tokens)

    def import_null_pages(self, request_id: str, num_external_tokens: int, num_local_tokens: int) -> int:
        """``ResidencyAwareManager`` asks, while vLLM allocates a waiting request: leading
        sparse-MLA pages to leave null (a P/D host landing, ``PDLandings.import_null_pages``)."""
        if self.landings is None:
            return 0
        return self.landings.import_null_pages(request_id, num_external_tokens, num_local_tokens)

    # ==================================================================== finishing
    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict | None]:
        """Finish or abort (not preemption): the free that follows ends it as finished."""
        self.book.mark_finishing(request.request_id)
        if self.landings is not None:  # a P/D request aborted while waiting
            self.landings.finished(request)
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
        book, admission, host_prefix, landings = self.book, self.admission, self.host_prefix, self.landings
        self.acks.check_deadline()
        self.drafts.roll_back_rejected()  # the previous step's drafts, if no ack came to do it
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        if scheduled:
            # The worker must apply this step's command before the forward reads KV. MRV2
            # calls start_load_kv before the forward only for steps with synchronous loads
            # (after it otherwise), so every step that runs a forward asks for that order.
            compat.request_load_before_forward(scheduler_output)
        # The admission pass of this step is over (offer).
        admission.note_unadmitted(scheduled)
        host_prefix.drop_stale_offers()
        admission.end_pass()
        # Unmanaged requests run as vLLM runs them without us.
        scheduled = book.managed(scheduled)
        if book.prefilling:
            self._update_prefilling(scheduled)
        # Requests admitted with a host-prefix hit or a P/D landing enter the policy now.
        new_rows: dict[str, int] = {}
        for rid in host_prefix.take_loads_to_start():
            if rid not in book.row_of:
                new_rows[rid] = self._add_row(rid)
        imports = []
        if landings is not None and landings.has_orders():
            imports = landings.start_imports(new_rows, self._add_row)
        if scheduled:
            keys, rows, counts = self._schedule(scheduled, new_rows)
        command = policy.build_step()
        self.acks.issue(command)
        self._apply_command(command)
        indexer_pages = host_prefix.take_step_indexer_pages()
        if host_prefix.enabled and scheduled:
            host_prefix.plan_indexer_saves(keys, rows, counts, command, indexer_pages)
        return HiSparseConnectorMetadata(
            command=command, new_rows=new_rows, bundles=self._bundles_of(command),
            indexer_pages=indexer_pages, load_requests=host_prefix.take_load_requests(),
            imports=imports, heartbeats=landings.heartbeats() if landings is not None else [],
        )

    def _schedule(self, scheduled: dict[str, int],
                  new_rows: dict[str, int]) -> tuple[tuple, np.ndarray, np.ndarray]:
        """The step's scheduled tokens into the policy: one vectorised call, in which
        requests crossing into new pages adopt vLLM's blocks. Returns the scheduled ids,
        their state rows and token counts."""
        book = self.book
        n = len(scheduled)
        keys = tuple(scheduled)
        counts = np.fromiter(scheduled.values(), dtype=np.int64, count=n)
        rows = book.rows_of_step(keys)  # same requests as the previous step: same rows
        if rows is None:
            row_of = book.row_of
            rows = np.fromiter((row_of.get(rid, -1) for rid in keys), dtype=np.int64, count=n)
            for i in (rows < 0).nonzero()[0].tolist():
                rid = keys[i]
                row, adopted = self._add_request(rid)
                rows[i] = new_rows[rid] = row
                # A prefix hit: vLLM's computed tokens not adopted as a host prefix are
                # new to the policy (a device prefix-cache hit).
                counts[i] += book.requests[rid].num_computed_tokens - adopted
            book.remember_step(keys, rows)
        outcome = self.policy.schedule_rows(rows, counts, self._adopt_pages)
        self.drafts.remember(keys, rows)
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
                f"{book.host_outstanding} reserved; a prefilling request must be fully "
                "resident, requirement R1 in docs/core.md)")
        return keys, rows, counts

    # ------------------------------------------------------------------ R1: prefilling
    def _update_prefilling(self, scheduled: dict[str, int]) -> None:
        """Tell the policy which prefilling requests completed their prompt (before this
        step's schedule, so the admission-window demotion fires at the first decode step),
        and report the pages the others' next chunks will need as device demand."""
        policy = self._require_policy()
        done, left = self.book.prefill_progress(scheduled)
        for rid in done:
            policy.set_prefilling(rid, False)
        if left:
            geometry = self.geometry
            pages = cdiv(min(left, geometry.max_chunk_tokens), geometry.block_size) + 1
            policy.note_device_demand(geometry.bundles_for_pages(pages))

    def _add_request(self, rid: str) -> tuple[int, int]:
        """Add an admitted request to the policy (prefilling or not, R1) and adopt its
        leased host prefix, if any. Returns its state row and the tokens adopted."""
        book = self.book
        request = book.requests.get(rid)
        if request is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: request {rid!r} scheduled without update_state_after_alloc")
        prefilling = book.is_prefilling(request)
        row = self._require_policy().add_request(rid, prefilling=prefilling).row
        book.bind_row(rid, row, prefilling)
        adopted = self.host_prefix.adopt(rid) if self.host_prefix.has_hit(rid) else 0
        return row, adopted

    def _add_row(self, rid: str) -> int:
        """:meth:`_add_request` for a request not scheduled this step (its host prefix, if
        any, is loaded, not counted as scheduled): its state row."""
        return self._add_request(rid)[0]

    def _adopt_pages(self, row: int, first_page: int, num_pages: int) -> list[int]:
        """``schedule_rows`` callback: a request crosses into ``num_pages`` new pages from
        ``first_page``; adopt vLLM's blocks for them (one bundle per page) and count the
        host blocks the policy is about to take against the request's reservation."""
        rid = self.book.rid_of_row[row]
        tables = [m.req_to_blocks[rid] for m in self.managers]
        end = first_page + num_pages
        if len(tables[0]) < end:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: request {rid!r} scheduled to {end} pages but vLLM "
                f"allocated {len(tables[0])} blocks in sparse group {self.geometry.sparse_group_ids[0]}"
            )
        adopt = self.device_pool.adopt
        leads = [adopt([table[p] for table in tables]) for p in range(first_page, end)]
        self.book.take_host_reservation(rid, num_pages)
        return leads

    def _apply_command(self, command: StepCommand) -> None:
        """Mirror the command's page losses/restores into vLLM's block tables; track
        residency and hot leases for metrics. Cost: proportional to the command."""
        self.book.note_residency(command)
        if not command.page_rows:
            return
        rid_of_row = self.book.rid_of_row
        managers = self.managers
        lead_manager = managers[0]
        for row, page, device in zip(command.page_rows, command.page_indices, command.page_device_blocks):
            rid = rid_of_row[row]
            if rid is None:
                continue
            table = lead_manager.req_to_blocks.get(rid)
            if table is None or page >= len(table):
                continue
            if device < 0:
                if not table[page].is_null:
                    for manager in managers:
                        manager.null_page(rid, page)
            elif table[page].block_id != device:
                for manager, block in zip(managers, self.device_pool.bundle(device)):
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

    # ==================================================================== acks
    def update_connector_output(self, connector_output: Any) -> None:
        """The step's output: P/D imports the workers finished, then the drafts vLLM
        rejected, then the workers' transfer acks, voted per (transfer, worker rank)
        (``AckIntake.vote``) and applied by the policy."""
        if self.landings is not None:
            self.landings.settle_imports(connector_output)
        # Rejected drafts first: the acks below may complete their rows' mirror.
        self.drafts.roll_back_rejected()
        meta = self.acks.worker_meta(connector_output)
        if meta is None:
            return
        # Before the acks that make pages clean (a clean page with an identity is
        # published): a worker that failed to save indexer pages reports it no later
        # than its own completion of the mirror.
        for tid in meta.failed_indexer_saves:
            self.host_prefix.revoke_identities(tid)
        if meta.hot_counts:  # adaptive hot regions: sized in the next build_step
            self._require_policy().observe_hot_counts(meta.hot_counts)
        acks = self.acks.vote(meta)
        if acks.is_empty():
            return
        self.host_prefix.settle_identities(acks)
        self._require_policy().apply_acks(acks)

    # ==================================================================== frees
    def on_blocks_freed(self, group_index: int, request_id: str, blocks: list) -> list:
        """``ResidencyAwareManager`` callback (every free path). The first sparse group
        to be freed ends the request in the policy; each group's blocks past the pages
        the policy adopted are returned to vLLM to free."""
        freeing = self.book.freeing
        state = freeing.get(request_id)
        if state is None:
            row = self.book.row_of.get(request_id)
            num_pages = 0
            if row is not None:
                num_pages = self._require_policy().num_pages_at(row)
                self._end_request(request_id)
            else:
                self._forget(request_id)
            state = freeing[request_id] = [num_pages, len(self.managers)]
        state[1] -= 1
        if state[1] == 0:
            del freeing[request_id]
        return [b for b in blocks[state[0]:] if not b.is_null]

    def _end_request(self, rid: str) -> None:
        policy = self._require_policy()
        if self.landings is not None:  # a failed import vLLM frees ends as finished
            self.landings.ending(rid)
        if rid in self.book.finishing:
            policy.finish(rid)
        else:
            # vLLM preemption: the request restarts from zero tokens, so the policy
            # forgets it (its durable pages would only matter for a host-prefix hit).
            self.stats.add("num_preemptions", 1)
            self.num_preemptions += 1
            policy.abort(rid)
        self.book.end_row(rid)
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self.host_prefix.drop_offer(rid)
        if self.landings is not None:
            self.landings.forget(rid)
        self.host_prefix.release_hit(rid)  # freed before it was ever scheduled
        self.book.forget(rid)

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
        policy.note_device_demand(self.geometry.bundles_for_pages(1))
        if policy.num_open_transfers == 0 or policy.num_device_blocks_pending_release() <= 0:
            return False
        self.stats.add("num_preemptions_avoided", 1)
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
        stats = self.stats
        for field_name, key in POLICY_COUNTERS.items():
            value = getattr(policy.stats, field_name)
            stats.add(key, value - self._policy_stats_seen[field_name])
            self._policy_stats_seen[field_name] = value
        book = self.book
        if stats.is_empty() and not book.non_full and policy.num_open_transfers == 0:
            return None
        host = self.host_pool
        stats.set_gauge("num_hot_leases", len(book.hot_rows))
        stats.set_gauge("num_host_blocks_used", host.num_blocks - host.num_free_blocks - host.num_cached_blocks)
        stats.set_gauge("num_host_blocks_total", host.num_blocks)
        stats.set_gauge("num_pending_transfers", policy.num_open_transfers)
        stats.set_gauge("num_mixed_requests", len(book.non_full))
        # The parts keep adding to this object: the report takes its counts away.
        report = HiSparseConnectorStats(data=stats.data)
        stats.reset()
        return report

    def is_idle(self) -> bool:
        """No request and no transfer open (pools should be at rest)."""
        return self.policy is not None and self.policy.is_idle() and not self.book.requests

