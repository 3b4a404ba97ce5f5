"""P/D decode consumer, scheduler side: where a prefill's KV lands on this decode instance.

Composition (docs/vllm-integration.md, "P/D decode consumer")::

    MultiConnector[HiSparseResidencyConnector, NixlConnector (kv_consumer)]

The prefill instance runs stock vLLM with NixlConnector (``kv_producer``). A request it
prefilled arrives here with ``kv_transfer_params`` (``do_remote_prefill`` and where its
blocks are). Decided once, when vLLM admits the request:

* **resident**, when the whole prefix (and its first decode token) fits the free device
  pool in every KV cache group: this connector reports no tokens, NixlConnector loads
  the pages into the blocks vLLM allocated, and from the request's first step the
  policy adopts them as a FULL request (computed tokens, mirrored to the host like a
  device prefix-cache hit);
* **host**, otherwise: this connector reports the tokens and loads them itself
  (``worker_import``): vLLM allocates the indexer pages and the sparse-MLA tail pages
  only (``ResidencyAwareManager`` leaves the other sparse pages null, asking
  :meth:`PDImports.import_null_pages`), the policy hands out host blocks and a hot
  region (``ResidencyPolicy.begin_import`` with the tail blocks), and every worker reads
  its share with NIXL. When vLLM reports the request in ``finished_recving`` the policy
  activates it NONE at once (``finish_import``); a failed read (``failed_recving``)
  ends it as vLLM's ``kv_load_failure_policy`` says, alone.

A host landing needs this connector to be the first MultiConnector child (vLLM lets the
first child that reports tokens load a request) and NixlConnector after it; with any
other order imports land resident only (logged at startup). The NixlConnector child
still tracks the request (its heartbeats keep the prefill's lease alive while the
request waits); at admission ``do_remote_prefill`` is cleared so that it does not also
read, or tell the prefill to free the blocks before our read.

A mixin of :class:`~vllm_hisparse.vllm.scheduler_side.HiSparseSchedulerRole`, first in
its bases: ``offer``, ``update_state_after_alloc`` and ``update_connector_output`` see
P/D requests first and hand everything else to the admission gate and ack intake; the
role calls ``_start_imports`` in ``build_connector_meta`` and ``_pd_ending`` /
``_pd_forget`` when a request ends.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

from vllm_hisparse.core.errors import BackPressure
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, cdiv
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.config import CONNECTOR_NAME
from vllm_hisparse.vllm.import_order import ImportOrder, RemotePrefill

logger = logging.getLogger(__name__)


class Landing(enum.Enum):
    RESIDENT = "resident"
    HOST = "host"


@dataclass(frozen=True)
class PDComposition:
    """Whether a NixlConnector consumer is composed with us, whether imports can land in
    the host tier, and why not; the NixlConnector child's extra config."""

    has_nixl: bool
    host_landing: bool
    reason: str
    nixl_extra_config: dict


def pd_composition(kv: Any) -> PDComposition:
    """Read the composing ``kv_transfer_config`` (``compat.composing_kv_transfer_config``:
    a MultiConnector child sees only its own entry): host landing needs this connector as
    the first MultiConnector child and a pull-mode NixlConnector consumer after it."""
    if kv is None or kv.kv_connector != "MultiConnector":
        return PDComposition(False, False, "no MultiConnector with NixlConnector", {})
    children = list((kv.kv_connector_extra_config or {}).get("connectors") or [])
    names = [c.get("kv_connector") for c in children]
    nixl = [i for i, (name, c) in enumerate(zip(names, children))
            if name in compat.NIXL_PULL_CONNECTORS
            and c.get("kv_role", kv.kv_role) in ("kv_consumer", "kv_both")]
    if not nixl:
        return PDComposition(False, False, "no NixlConnector consumer in MultiConnector", {})
    extra = dict(children[nixl[0]].get("kv_connector_extra_config") or {})
    if names.index(CONNECTOR_NAME) != 0:
        return PDComposition(
            True, False, f"{CONNECTOR_NAME} is not the first MultiConnector child (vLLM lets the first "
            "child that reports tokens load a request); list it first to land long contexts "
            "in the host tier", extra)
    return PDComposition(True, True, "", extra)


@dataclass(frozen=True)
class _Offer:
    """A host landing offered to vLLM and not yet admitted."""

    num_external_tokens: int  # what this connector reported (vLLM's external tokens)
    num_tokens: int  # computed tokens once loaded (the last prompt token is recomputed)
    null_pages: int  # sparse pages vLLM leaves null (read into the host pool only)
    remote: RemotePrefill


class PDImports:
    """Landing decision and host-landing bookkeeping (module docstring)."""

    def _init_pd_imports(self, vllm_config: Any) -> None:
        # Called from the constructor: the composing MultiConnector is on the stack.
        self.pd = pd_composition(compat.composing_kv_transfer_config(vllm_config))
        self._pd_backoff = compat.prefill_backoff_tokens(vllm_config)
        self._pd_offers: dict[str, _Offer] = {}
        self._pd_tracking = False  # managers count the offers' null pages
        self._pd_resident: set[str] = set()  # resident landings offered, not yet admitted
        self._pd_claimed: list[tuple[str, _Offer]] = []  # admitted, to begin next build
        self._pd_importing: dict[str, ImportOrder] = {}
        self._pd_orders: list[ImportOrder] = []  # for the next metadata
        self._pd_restarting: set[str] = set()  # failed imports vLLM recomputes
        self.num_pd_landings = {Landing.RESIDENT: 0, Landing.HOST: 0}
        if self.pd.host_landing:
            logger.info("%s: P/D imports land resident when the whole prefix fits the device "
                        "pool, else in the host tier (read by this connector over NIXL)",
                        CONNECTOR_NAME)
        elif self.pd.has_nixl:
            logger.warning("%s: P/D imports land resident only: %s", CONNECTOR_NAME, self.pd.reason)

    # ------------------------------------------------------------------ admission
    def _pd_remote(self, request: Any) -> RemotePrefill | None:
        return RemotePrefill.from_params(getattr(request, "kv_transfer_params", None))

    def offer(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """P/D requests: decide the landing (``None`` keeps the request waiting for
        room); every other request goes to the admission gate."""
        remote = self._pd_remote(request)
        rid = request.request_id
        if remote is None or rid in self._requests:
            return super().offer(request, num_computed_tokens)
        if self._pd_offers.pop(rid, None) is not None:
            self._pd_track_offers()
        self._pd_resident.discard(rid)
        if self.host_pool.num_allocatable_blocks - self._host_outstanding < self._host_pages_for(request):
            return None, False  # host back-pressure, as for every request
        prompt = request.num_prompt_tokens
        remote_tokens = prompt - self._pd_backoff if self._pd_backoff and prompt > self._pd_backoff else prompt
        num_external = remote_tokens - num_computed_tokens
        if num_external <= 0:
            return 0, False
        landing, shortfall = self._pd_decide(request, num_computed_tokens, num_external)
        if landing is None:
            self._require_policy().note_device_demand(cdiv(shortfall, len(self.sparse_group_ids)))
            self._stats.add("num_admissions_deferred", 1)
            return None, False
        if landing == Landing.RESIDENT:
            # NixlConnector reports the tokens; a refused allocation is unmet demand.
            self._offered = (rid, cdiv(num_external + 1, self.block_size))
            self._pd_resident.add(rid)
            return 0, False
        num_tokens = num_external - 1 if num_external == request.num_tokens else num_external
        pages = cdiv(num_tokens, self.block_size)
        self._pd_offers[rid] = _Offer(num_external, num_tokens, max(0, pages - ACTIVE_TAIL_PAGES), remote)
        self._pd_track_offers()
        return num_external, True

    def _pd_track_offers(self) -> None:
        """Our sparse-group managers count null pages only while a host landing is offered."""
        pending = bool(self._pd_offers)
        if pending != self._pd_tracking:
            self._pd_tracking = pending
            for manager in self._managers:
                manager.track_import_offers(pending)

    def _pd_decide(self, request: Any, num_computed_tokens: int,
                   num_external: int) -> tuple[Landing | None, int]:
        """``(landing, 0)``, or ``(None, vLLM blocks missing)`` when neither fits now.

        Blocks a landing takes now, in vLLM blocks (``G`` groups, ``S`` of them
        sparse): resident, the prompt and its first decode token in every group; host, the
        same in the non-sparse groups plus, in every sparse group, the tail pages (one
        more for the first decode token) and the hot region. Both leave the running
        requests room to grow, as the admission gate does: one page crossing in every
        group, and a page of every running request in the groups no release can offset
        (nothing to protect on an idle engine)."""
        bs = self.block_size
        groups = self._num_kv_groups
        sparse = len(self.sparse_group_ids)
        pages = cdiv(num_external + 1, bs)
        free = self.device_pool.block_pool.get_num_free_blocks()
        reserve = groups + len(self._requests) * (groups - sparse) if self._requests else 0
        resident = pages * groups
        if resident + reserve <= free:
            return Landing.RESIDENT, 0
        num_tokens = num_external - 1 if num_external == request.num_tokens else num_external
        if (not self.pd.host_landing or num_computed_tokens
                or request.num_tokens - num_tokens > self.max_decode_query_len):
            # A local prefix hit, or prompt tokens left to prefill (R1), lands resident.
            return None, resident + reserve - free
        tail = min(ACTIVE_TAIL_PAGES, cdiv(num_tokens, bs)) + 1
        host = pages * (groups - sparse) + (tail + self.hisparse_config.hot_blocks_per_request) * sparse
        if host + reserve <= free:
            return Landing.HOST, 0
        return None, host + reserve - free

    def import_null_pages(self, request_id: str, num_external_tokens: int, num_local_tokens: int) -> int:
        """``ResidencyAwareManager`` asks, while vLLM allocates a waiting request: how many
        leading sparse-MLA pages to leave null (a host landing reads them into the host
        pool only). 0 for anything but the host landing this connector offered."""
        offer = self._pd_offers.get(request_id)
        if offer is None or num_local_tokens or num_external_tokens != offer.num_external_tokens:
            return 0
        return offer.null_pages

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        offer = self._pd_offers.pop(rid, None)
        if offer is not None:
            self._pd_track_offers()
        if offer is None:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            if rid in self._pd_resident:
                self._pd_resident.discard(rid)
                self.num_pd_landings[Landing.RESIDENT] += 1
            return
        if num_external_tokens != offer.num_external_tokens:
            raise RuntimeError(
                f"{CONNECTOR_NAME}: request {rid!r} was offered a host landing of "
                f"{offer.num_external_tokens} tokens but allocated with {num_external_tokens} "
                "external tokens (is another MultiConnector child listed before this one?)")
        # The NixlConnector child sees the request after us: it must neither read it nor
        # tell the prefill to free its blocks now (its "nothing to load" path).
        request.kv_transfer_params["do_remote_prefill"] = False
        super().update_state_after_alloc(request, blocks, 0)
        pages = cdiv(offer.num_tokens, self.block_size)
        taken = min(pages, self._host_remaining.get(rid, 0))
        self._host_remaining[rid] -= taken
        self._host_outstanding -= taken
        self._pd_claimed.append((rid, offer))
        self.num_pd_landings[Landing.HOST] += 1

    # ------------------------------------------------------------------ the step
    def _start_imports(self, new_rows: dict[str, int]) -> list[ImportOrder]:
        """Host landings admitted since the last step: the policy takes them (host blocks,
        the engine's tail pages, a hot region) and the workers get their orders."""
        claimed, self._pd_claimed = self._pd_claimed, []
        policy = self._require_policy()
        bs = self.block_size
        for rid, offer in claimed:
            if rid not in self._requests:
                continue  # freed before its first step
            new_rows[rid] = self._add_request(rid)
            self._adopted_tokens = 0  # not scheduled this step
            if rid in self._prefilling:  # at most max_decode_query_len tokens left (offer)
                self._prefilling.discard(rid)
                policy.set_prefilling(rid, False)
            pages = cdiv(offer.num_tokens, bs)
            tables = [m.req_to_blocks[rid] for m in self._managers]
            tail_pages = range(pages - min(ACTIVE_TAIL_PAGES, pages), pages)
            leads = [self.device_pool.adopt([t[p] for t in tables]) for p in tail_pages]
            order = ImportOrder(
                request_id=rid, remote=offer.remote, num_tokens=offer.num_tokens, host_blocks=[],
                tail_blocks=[self.device_pool.bundle_block_ids(lead) for lead in leads],
                indexer_blocks=[[m.req_to_blocks[rid][p].block_id for p in range(pages)]
                                for m in self._indexer_managers])
            try:
                order.host_blocks = policy.begin_import(rid, offer.num_tokens, tail_device_blocks=leads)
            except BackPressure as exc:
                logger.warning("%s: host landing of request %r refused (%s); vLLM fails or "
                               "recomputes it (kv_load_failure_policy)", CONNECTOR_NAME, rid, exc)
                order.cancel = True
                self._pd_restarting.add(rid)
            self._pd_importing[rid] = order
            self._pd_orders.append(order)
        orders, self._pd_orders = self._pd_orders, []
        return orders

    # ------------------------------------------------------------------ outcomes
    def update_connector_output(self, connector_output: Any) -> None:
        """Host landings the workers finished (vLLM aggregates ``finished_recving`` over
        every worker; ``failed_recving`` when one failed): the policy activates the
        request NONE, or returns its host blocks and hot region (vLLM then fails or
        recomputes it alone). Then the acks."""
        if self._pd_importing:
            finished = connector_output.finished_recving or ()
            failed = connector_output.failed_recving or set()
            policy = self._require_policy()
            for rid in [r for r in finished if r in self._pd_importing]:
                order = self._pd_importing.pop(rid)
                ok = rid not in failed and not order.cancel
                self._stats.add("num_pd_imported_pages" if ok else "num_pd_import_failures",
                                order.num_pages if ok else 1)
                if not ok:
                    self._pd_restarting.add(rid)
                    logger.warning("%s: host landing of request %r failed; vLLM fails or "
                                   "recomputes it (kv_load_failure_policy)", CONNECTOR_NAME, rid)
                if policy.has_request(rid) and policy.status(rid).name == "IMPORTING":
                    policy.finish_import(rid, ok)
        super().update_connector_output(connector_output)

    def _pd_ending(self, rid: str) -> None:
        """vLLM frees a request (``_end_request``): a failed import it frees (and may
        recompute) ends as finished, not as a preemption."""
        if rid in self._pd_restarting:
            self._pd_restarting.discard(rid)
            self._finishing.add(rid)

    def _pd_forget(self, rid: str) -> None:
        self._pd_resident.discard(rid)
        if self._pd_offers.pop(rid, None) is not None:
            self._pd_track_offers()
        self._pd_restarting.discard(rid)
