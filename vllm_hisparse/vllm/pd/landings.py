"""P/D decode consumer, scheduler side: where a prefill's KV lands on this decode instance.

The prefill instance runs stock vLLM with NixlConnector (``kv_producer``). A request it
prefilled arrives here with ``kv_transfer_params`` (``do_remote_prefill`` and where its
blocks are). This connector loads it itself (``pd/reads.py``, over NIXL): vLLM's own
NixlConnector cannot read into this connector's KV plan (measured: its handshake refuses
"Packed KV block rows differ between P and D", docs/vllm-integration.md, "P/D decode
consumer"). The landing is decided once, when vLLM admits the request:

* **resident**, when the whole prefix (and its first decode token) fits the free device
  pool in every KV cache group: vLLM allocates every page and the workers read them into
  those blocks; from the request's first step the policy adopts them as a FULL request
  (computed tokens, mirrored to the host like a device prefix-cache hit);
* **host**, otherwise: vLLM allocates the indexer pages and the sparse-MLA tail pages only
  (``ResidencyAwareManager`` leaves the other sparse pages null, asking
  :meth:`PDLandings.import_null_pages`), the policy hands out host blocks and a hot region
  (``ResidencyPolicy.begin_import`` with the tail blocks), and the workers read the
  sparse-MLA rows into the host pool, the tail and indexer pages into vLLM's blocks. When
  vLLM reports the request in ``finished_recving`` the policy activates it NONE at once
  (``finish_import``).

Either way the request waits in ``WAITING_FOR_REMOTE_KVS`` until every worker reported it
(``finished_recving``); a failed read (``failed_recving``) ends it as vLLM's
``kv_load_failure_policy`` says, alone.

``kv_transfer_params`` arrive with the request body: untrusted input. They are checked
when the request arrives and when it is offered (``transfer_params``); a request that
fails a check is **refused**: one WARNING names the request, the field and the problem,
vLLM admits it with at most two blocks per group (one page of external tokens, loaded
asynchronously) and the workers get a ``REFUSE`` order, which they report failed at once
without contacting anyone. vLLM then fails it (``FINISHED_ERROR``) or recomputes it here,
as ``kv_load_failure_policy`` says; nothing else is affected. While a P/D request waits here or is being read,
the prefill's lease on its blocks is renewed (:class:`~import_order.Heartbeat`); a request
aborted before admission tells the prefill to free them (``ImportAction.RELEASE``).

Composition: this connector alone (``kv_role`` ``kv_consumer``), or the first child of a
MultiConnector (``composition.py``).

A part of the scheduler role (``scheduler_side/role.py``), built only when this instance
reads P/D requests (:meth:`PDLandings.for_engine`). The role asks it first: :meth:`~PDLandings.claim`
/ :meth:`~PDLandings.offer` for a waiting request, :meth:`~PDLandings.claims_allocation` /
:meth:`~PDLandings.admit` after vLLM allocated, :meth:`~PDLandings.settle_imports` before the
acks; everything it does not claim goes to the admission gate. Each step the role takes its
orders (:meth:`~PDLandings.start_imports`, :meth:`~PDLandings.heartbeats`), and tells it of
finishes and frees (:meth:`~PDLandings.finished`, :meth:`~PDLandings.ending`,
:meth:`~PDLandings.forget`).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Callable

from vllm_hisparse.core.errors import BackPressure
from vllm_hisparse.core.request_table import RequestStatus
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES, cdiv
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.pd.composition import PDComposition, pd_composition
from vllm_hisparse.vllm.pd.import_order import Heartbeat, ImportAction, ImportOrder, RemotePrefill
from vllm_hisparse.vllm.pd.transfer_params import (
    InvalidTransferParams,
    check_import_coverage,
    parse_remote_prefill,
)
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME

logger = logging.getLogger(__name__)

#: Seconds between lease renewals of the prefill blocks of waiting or loading requests
#: (vLLM's NixlConnector: every kv_lease_duration / 6, 30 s / 6 by default).
PD_HEARTBEAT_EVERY_S = 5.0

class Landing(enum.Enum):
    RESIDENT = "resident"
    HOST = "host"


@dataclass(frozen=True)
class _Offer:
    """A landing (or a refusal) offered to vLLM and not yet admitted."""

    landing: Landing | None  # None: refused (invalid kv_transfer_params)
    num_external_tokens: int  # what this connector reported (vLLM's external tokens)
    num_tokens: int  # computed tokens once loaded (the last prompt token is recomputed)
    null_pages: int  # host landing: sparse pages vLLM leaves null
    remote: RemotePrefill | None


class PDLandings:
    """Landing decision and import bookkeeping (module docstring)."""

    def __init__(self, composition: PDComposition, backoff_tokens: int, geometry: Any, book: Any,
                 admission: Any, host_pool: Any, stats: Any) -> None:
        # geometry, book, admission: the scheduler role's SchedulerGeometry, RequestBook and
        # AdmissionGate (duck-typed: pd/ sits below scheduler_side/).
        self.composition = composition
        self.geometry = geometry
        self.book = book
        self.admission = admission
        self.host_pool = host_pool
        self.stats = stats
        # Bound in bind (vLLM builds the KVCacheManager after the connector).
        self._policy: Any = None
        self._device_pool: Any = None
        self._managers: list[Any] = []
        self._indexer_managers: list[Any] = []
        self._backoff = backoff_tokens
        self._offers: dict[str, _Offer] = {}
        self._tracking = False  # managers count the host offers' null pages
        self._claimed: list[tuple[str, _Offer]] = []  # admitted, to order next build
        self._importing: dict[str, ImportOrder] = {}
        self._releases: list[ImportOrder] = []
        self._leases: dict[str, RemotePrefill] = {}  # heartbeats: waiting or loading
        self._restarting: set[str] = set()  # failed imports vLLM frees
        # Refused requests (invalid kv_transfer_params, logged once) until admitted, and
        # admitted P/D requests until they finish: a recompute is not imported again.
        self._refused: dict[str, InvalidTransferParams] = {}
        self._settled: set[str] = set()
        self._max_blocks = cdiv(geometry.max_model_len, geometry.block_size) + 2
        self._clock = time.monotonic
        self._next_heartbeat_s = 0.0
        self.num_pd_landings = {Landing.RESIDENT: 0, Landing.HOST: 0}
        logger.info("%s: P/D decode consumer: requests from a NixlConnector prefill are read "
                    "by this connector, resident when the whole prefix fits the device pool, "
                    "else into the host tier", CONNECTOR_NAME)

    @classmethod
    def for_engine(cls, vllm_config: Any, geometry: Any, book: Any, admission: Any, host_pool: Any,
                   stats: Any) -> PDLandings | None:
        """The landings of this decode instance, or None when it reads no P/D request
        (``composition.py``). Called from the connector's constructor: the composing
        MultiConnector is on the stack."""
        composition = pd_composition(compat.composing_kv_transfer_config(vllm_config))
        if not composition.enabled:
            return None
        return cls(composition, compat.prefill_backoff_tokens(vllm_config), geometry, book,
                   admission, host_pool, stats)

    def bind(self, policy: Any, device_pool: Any, managers: list[Any], indexer_managers: list[Any]) -> None:
        self._policy = policy
        self._device_pool = device_pool
        self._managers = managers
        self._indexer_managers = indexer_managers

    def _require_policy(self) -> Any:
        if self._policy is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: scheduler role used before bind_kv_cache_manager")
        return self._policy

    def _remote(self, request: Any) -> RemotePrefill | InvalidTransferParams | None:
        """The request's remote prefill; its refusal; or None (not a P/D request, or one
        already admitted: recomputed here after a failed import)."""
        rid = request.request_id
        if rid in self._settled:
            return None
        refused = self._refused.get(rid)
        if refused is not None:
            return refused
        try:
            return parse_remote_prefill(getattr(request, "kv_transfer_params", None),
                                        max_blocks=self._max_blocks)
        except InvalidTransferParams as exc:
            self._refuse(rid, exc)
            return exc

    def _refuse(self, rid: str, exc: InvalidTransferParams) -> None:
        """Refuse a P/D request (once): no read, no lease renewal, one WARNING."""
        self._refused[rid] = exc
        self._leases.pop(rid, None)
        self.stats.add("num_pd_refused", 1)
        outcome = "recomputes it here" if self.geometry.load_failure_policy == "recompute" else "fails it"
        logger.warning("%s: P/D request %r refused: %s (kv_transfer_params are untrusted input: "
                       "nothing is read or contacted for it; vLLM %s, kv_load_failure_policy=%s)",
                       CONNECTOR_NAME, rid, exc, outcome, self.geometry.load_failure_policy)

    def on_new_request(self, request: Any) -> None:
        """A P/D request arrived: check its ``kv_transfer_params`` (a refusal is logged
        here); renew the prefill's lease on its blocks until it is read."""
        remote = self._remote(request)
        if isinstance(remote, RemotePrefill):
            self._leases[request.request_id] = remote

    # ------------------------------------------------------------------ admission
    def claim(self, request: Any) -> RemotePrefill | InvalidTransferParams | None:
        """What a waiting request offered to vLLM's admission is to the landings: its
        remote prefill, its refusal, or None (not a P/D request, or already admitted:
        the admission gate answers)."""
        remote = self._remote(request)
        if remote is None or request.request_id in self.book.requests:
            return None
        return remote

    def holds_back(self, request: Any, num_computed_tokens: int) -> bool:
        """Whether a request the landings do not claim waits a step: its next chunk would
        take the hot regions of host landings admitted earlier in this pass."""
        chunk = min(request.num_tokens - num_computed_tokens, self.geometry.max_chunk_tokens)
        return self._wait_for_hot_regions(chunk)

    def offer(self, request: Any, num_computed_tokens: int,
              remote: RemotePrefill | InvalidTransferParams) -> tuple[int | None, bool]:
        """A P/D request (``remote``, from :meth:`claim`): the decided landing, as external
        tokens loaded asynchronously (``None`` keeps the request waiting for room)."""
        rid = request.request_id
        self._drop_offer(rid)
        self.admission.reset_watermark()  # the landing decision below leaves the headroom
        if isinstance(remote, InvalidTransferParams):
            return self._offer_refusal(request, num_computed_tokens)
        prompt = request.num_prompt_tokens
        remote_tokens = prompt - self._backoff if self._backoff and prompt > self._backoff else prompt
        num_external = remote_tokens - num_computed_tokens
        if num_external <= 0:
            return 0, False
        num_tokens = num_external - 1 if num_external == request.num_tokens else num_external
        try:
            check_import_coverage(remote, num_tokens, self.geometry.block_size)
        except InvalidTransferParams as exc:
            self._refuse(rid, exc)
            return self._offer_refusal(request, num_computed_tokens)
        if not self.admission.host_backs(request):
            return None, False  # host back-pressure, as for every request
        landing, shortfall = self._decide(request, num_computed_tokens, num_external, num_tokens)
        if landing is None:
            self._require_policy().note_device_demand(cdiv(shortfall, self.geometry.num_sparse_groups))
            self.stats.add("num_admissions_deferred", 1)
            return None, False
        null_pages = max(0, cdiv(num_tokens, self.geometry.block_size) - ACTIVE_TAIL_PAGES)
        self._offers[rid] = _Offer(landing, num_external, num_tokens,
                                   null_pages if landing == Landing.HOST else 0, remote)
        self._track_offers()
        # Not admitted (vLLM could not allocate) is unmet device demand.
        pages = (cdiv(num_external + 1, self.geometry.block_size) if landing == Landing.RESIDENT
                 else ACTIVE_TAIL_PAGES + 1 + self.geometry.hot_blocks_per_request)
        self.admission.note_offer(rid, pages)
        return num_external, True

    def _hot_blocks_pending(self) -> int:
        """vLLM blocks the host landings admitted in this admission pass take at its end,
        when the policy leases their hot regions (:meth:`start_imports`)."""
        landings = sum(1 for _, offer in self._claimed if offer.landing == Landing.HOST)
        return landings * self.geometry.hot_blocks_per_request * self.geometry.num_sparse_groups

    def _wait_for_hot_regions(self, num_tokens: int) -> bool:
        """True when allocating ``num_tokens`` tokens (in every group) now would take the
        hot regions of host landings admitted earlier in this pass: the request waits a
        step (vLLM skips it), else the policy could not lease them and those landings
        would fail. vLLM's watermark cannot hold them: it applies only while a request runs."""
        pending = self._hot_blocks_pending()
        if not pending:
            return False
        need = cdiv(max(num_tokens, 1) + 1, self.geometry.block_size) * self.geometry.num_kv_groups
        return need + pending > self._device_pool.block_pool.get_num_free_blocks()

    def _offer_refusal(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """A refused request is admitted to be failed: at most one page of external tokens
        loaded asynchronously (more than a local hit's partial last page, which vLLM would
        otherwise keep instead), so vLLM holds one or two blocks per group until the
        workers report it failed."""
        num_external = min(request.num_tokens - num_computed_tokens, self.geometry.block_size)
        if num_external <= 0:  # vLLM offers at most num_tokens - 1 computed tokens
            return 0, False
        if self._wait_for_hot_regions(num_external):
            return None, False
        self._offers[request.request_id] = _Offer(None, num_external, 0, 0, None)
        return num_external, True

    def _decide(self, request: Any, num_computed_tokens: int, num_external: int,
                   num_tokens: int) -> tuple[Landing | None, int]:
        """``(landing, 0)``, or ``(None, vLLM blocks missing)`` when neither fits now.

        Blocks a landing takes now, in vLLM blocks (``G`` groups, ``S`` of them
        sparse): resident, the prompt and its first decode token in every group; host, the
        same in the non-sparse groups plus, in every sparse group, the tail pages (one
        more for the first decode token) and the hot region. Both leave the running
        requests room to grow, as the admission gate does: one page crossing in every
        group, and a page of every running request in the groups no release can offset
        (nothing to protect on an idle engine). A local prefix hit, or prompt tokens left
        to prefill after the load (R1, docs/core.md), lands resident only."""
        bs = self.geometry.block_size
        groups = self.geometry.num_kv_groups
        sparse = self.geometry.num_sparse_groups
        pages = cdiv(num_external + 1, bs)
        free = self._device_pool.block_pool.get_num_free_blocks() - self._hot_blocks_pending()
        reserve = groups + len(self.book.requests) * (groups - sparse) if self.book.requests else 0
        resident = pages * groups
        if resident + reserve <= free:
            return Landing.RESIDENT, 0
        if num_computed_tokens or request.num_tokens - num_tokens > self.geometry.max_decode_query_len:
            return None, resident + reserve - free
        tail = min(ACTIVE_TAIL_PAGES, cdiv(num_tokens, bs)) + 1
        host = pages * (groups - sparse) + (tail + self.geometry.hot_blocks_per_request) * sparse
        if host + reserve <= free:
            return Landing.HOST, 0
        return None, host + reserve - free

    def _drop_offer(self, rid: str) -> _Offer | None:
        offer = self._offers.pop(rid, None)
        if offer is not None and offer.landing == Landing.HOST:
            self._track_offers()
        return offer

    def _track_offers(self) -> None:
        """Our sparse-group managers count null pages only while a host landing is offered."""
        pending = any(o.landing == Landing.HOST for o in self._offers.values())
        if pending != self._tracking:
            self._tracking = pending
            for manager in self._managers:
                manager.track_import_offers(pending)

    def import_null_pages(self, request_id: str, num_external_tokens: int, num_local_tokens: int) -> int:
        """``ResidencyAwareManager`` asks, while vLLM allocates a waiting request: how many
        leading sparse-MLA pages to leave null (a host landing reads them into the host
        pool only). 0 for anything but a host landing this connector offered."""
        offer = self._offers.get(request_id)
        if offer is None or num_local_tokens or num_external_tokens != offer.num_external_tokens:
            return 0
        return offer.null_pages

    def claims_allocation(self, request: Any) -> bool:
        """vLLM allocated for a request the landings offered (or refused)."""
        return request.request_id in self._offers

    def admit(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated for a request the landings offered (``update_state_after_alloc``):
        the landing is ordered at the next step; the admission gate admits the request
        (it reserves host blocks; a host landing's are counted against them now)."""
        rid = request.request_id
        offer = self._drop_offer(rid)
        # Loaded (or refused) here, once: a NixlConnector sibling must neither read it nor
        # tell the prefill to free its blocks now (its "nothing to load" path), and a
        # recompute after a failure is not imported again.
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, MutableMapping):
            params["do_remote_prefill"] = False
        self._settled.add(rid)
        self._refused.pop(rid, None)
        if num_external_tokens != offer.num_external_tokens:
            offer = self._allocated_otherwise(request, offer, num_external_tokens)
            if offer is None:
                self.admission.admit(request, blocks, 0)
                return
        if offer.landing is None:  # refused: the workers report it failed
            self._claimed.append((rid, offer))
            return
        self.admission.admit(request, blocks, 0)
        if offer.landing == Landing.HOST:
            self.book.take_host_reservation(rid, cdiv(offer.num_tokens, self.geometry.block_size))
        self._claimed.append((rid, offer))
        self.num_pd_landings[offer.landing] += 1
        self.stats.add(f"num_pd_{offer.landing.value}_landings", 1)

    def _allocated_otherwise(self, request: Any, offer: _Offer,
                                num_external_tokens: int) -> _Offer | None:
        """vLLM allocated with other external tokens than offered. None (none: vLLM computes
        the request here, e.g. it skips reading any cache for prompt logprobs; the prefill is
        told to free its blocks), or a refusal (blocks for a load we did not plan; is another
        MultiConnector child listed before this one?)."""
        rid = request.request_id
        remote = self._leases.pop(rid, None)
        if num_external_tokens == 0:
            logger.info("%s: P/D request %r is computed here: vLLM loads no external tokens "
                        "for it", CONNECTOR_NAME, rid)
            if remote is not None:
                self._releases.append(ImportOrder(rid, remote, 0, 0, action=ImportAction.RELEASE))
            return None
        if offer.landing is not None:
            self._refuse(rid, InvalidTransferParams(
                "kv_transfer_params", f"vLLM allocated {num_external_tokens} external tokens for "
                f"a {offer.landing.value} landing of {offer.num_external_tokens} (is another "
                "MultiConnector child listed before this one?)"))
            self._refused.pop(rid, None)
        if remote is not None:  # its blocks are not read: the prefill may free them
            self._releases.append(ImportOrder(rid, remote, 0, 0, action=ImportAction.RELEASE))
        return _Offer(None, num_external_tokens, 0, 0, None)

    # ------------------------------------------------------------------ the step
    def has_orders(self) -> bool:
        """Landings admitted or prefills to release since the last step (:meth:`start_imports`)."""
        return bool(self._claimed or self._releases)

    def start_imports(self, new_rows: dict[str, int], add_row: Callable[[str], int]) -> list[ImportOrder]:
        """Requests admitted since the last step get their orders (host landings enter
        the policy through ``add_row``, the role's, then get host blocks, the engine's tail
        pages and a hot region); releases ride along."""
        claimed, self._claimed = self._claimed, []
        orders, self._releases = self._releases, []
        for rid, offer in claimed:
            if offer.landing is None:
                order = ImportOrder(rid, None, 0, 0, action=ImportAction.REFUSE)
                self._importing[rid] = order
                orders.append(order)
                continue
            if rid not in self.book.requests:
                continue  # freed before its first step
            if offer.landing == Landing.HOST:
                order = self._begin_host_landing(rid, offer, new_rows, add_row)
            else:
                pages = cdiv(offer.num_tokens, self.geometry.block_size)
                tables = [m.req_to_blocks[rid] for m in self._managers]
                order = ImportOrder(rid, offer.remote, offer.num_tokens, pages,
                                    device_blocks=[[t[p].block_id for t in tables] for p in range(pages)],
                                    indexer_blocks=self._indexer_blocks(rid, pages))
            self._importing[rid] = order
            orders.append(order)
        return orders

    def _indexer_blocks(self, rid: str, pages: int) -> list[list[int]]:
        return [[m.req_to_blocks[rid][p].block_id for p in range(pages)] for m in self._indexer_managers]

    def _begin_host_landing(self, rid: str, offer: _Offer, new_rows: dict[str, int],
                            add_row: Callable[[str], int]) -> ImportOrder:
        policy = self._require_policy()
        new_rows[rid] = add_row(rid)
        if self.book.end_prefill(rid):  # at most max_decode_query_len tokens left (offer)
            policy.set_prefilling(rid, False)
        pages = cdiv(offer.num_tokens, self.geometry.block_size)
        tables = [m.req_to_blocks[rid] for m in self._managers]
        tail_pages = range(pages - min(ACTIVE_TAIL_PAGES, pages), pages)
        leads = [self._device_pool.adopt([t[p] for t in tables]) for p in tail_pages]
        order = ImportOrder(rid, offer.remote, offer.num_tokens, pages,
                            device_blocks=[self._device_pool.bundle_block_ids(lead) for lead in leads],
                            indexer_blocks=self._indexer_blocks(rid, pages))
        try:
            order.host_blocks = policy.begin_import(rid, offer.num_tokens, tail_device_blocks=leads)
        except BackPressure as exc:
            logger.warning("%s: host landing of request %r refused (%s); vLLM fails or "
                           "recomputes it (kv_load_failure_policy)", CONNECTOR_NAME, rid, exc)
            order.action = ImportAction.CANCEL
        return order

    def heartbeats(self) -> list[Heartbeat]:
        """Every ``PD_HEARTBEAT_EVERY_S``: the prefill requests to keep, per engine."""
        if not self._leases:
            return []
        now = self._clock()
        if now < self._next_heartbeat_s:
            return []
        self._next_heartbeat_s = now + PD_HEARTBEAT_EVERY_S
        by_engine: dict[tuple, list[RemotePrefill]] = {}
        for remote in self._leases.values():
            by_engine.setdefault(remote.engine_key, []).append(remote)
        return [Heartbeat(group[0], tuple(r.request_id for r in group)) for group in by_engine.values()]

    # ------------------------------------------------------------------ outcomes
    def settle_imports(self, connector_output: Any) -> None:
        """Imports the workers finished (vLLM aggregates ``finished_recving`` over every
        worker; ``failed_recving`` when one failed): a host landing is activated NONE, or
        gets its host blocks and hot region back (vLLM then fails or recomputes the request
        alone)."""
        if self._importing:
            finished = connector_output.finished_recving or ()
            failed = connector_output.failed_recving or set()
            policy = self._require_policy()
            for rid in [r for r in finished if r in self._importing]:
                order = self._importing.pop(rid)
                self._leases.pop(rid, None)
                if order.action is ImportAction.REFUSE:
                    continue  # logged and counted when refused; vLLM fails or recomputes it
                ok = rid not in failed and order.action is ImportAction.READ
                self.stats.add("num_pd_imported_pages" if ok else "num_pd_import_failures",
                                order.num_pages if ok else 1)
                if not ok:
                    self._restarting.add(rid)
                    logger.warning("%s: P/D import of request %r failed; vLLM fails or "
                                   "recomputes it (kv_load_failure_policy)", CONNECTOR_NAME, rid)
                if policy.has_request(rid) and policy.status(rid) == RequestStatus.IMPORTING:
                    policy.finish_import(rid, ok)

    def finished(self, request: Any) -> None:
        """vLLM finished a request (``request_finished_all_groups``). One that never got
        admitted still holds the prefill's blocks: tell the prefill to free them."""
        rid = request.request_id
        self._settled.discard(rid)
        self._refused.pop(rid, None)
        if rid in self.book.requests or rid in self._importing:
            return  # admitted: its import ends it (and its lease renewals)
        remote = self._leases.pop(rid, None)
        if remote is not None:
            self._releases.append(ImportOrder(rid, remote, 0, 0, action=ImportAction.RELEASE))

    def ending(self, rid: str) -> None:
        """vLLM frees a request the policy holds: a failed import it frees (and may
        recompute) ends as finished, not as a preemption."""
        if rid in self._restarting:
            self._restarting.discard(rid)
            self.book.mark_finishing(rid)

    def forget(self, rid: str) -> None:
        """vLLM freed ``rid``: its offer and lease renewals end (unless its import runs)."""
        self._drop_offer(rid)
        self._restarting.discard(rid)
        if rid not in self._importing:
            self._leases.pop(rid, None)
