"""The scheduler role's admission gate: which waiting request vLLM may admit now.

vLLM offers each waiting request through the connector's ``get_num_new_matched_tokens``
(:meth:`AdmissionGate.offer`), then allocates it (:meth:`AdmissionGate.admit`, from
``update_state_after_alloc``). The answer never keeps a request waiting (``None`` would
make vLLM skip it and look up the prefix cache of every request behind it, every step;
only a P/D request that can land nowhere yet waits, ``pd/landings.py``); the gate acts
through vLLM's own allocation check instead:

* **device headroom** (docs/vllm-integration.md, "Admission headroom"): before each
  waiting request's allocation the gate sets vLLM's admission watermark
  (``KVCacheManager.watermark_blocks``, applied to WAITING and PREEMPTED requests while
  any request runs) to the headroom the running requests need, capped by the blocks
  residency spares right now. vLLM without the connector would admit the request into a
  pool without those spared blocks, so the gate never refuses what vLLM alone would admit;
  a refused allocation ends vLLM's admission pass for the step, exactly as a full pool does;
* **host backing** (:meth:`AdmissionGate.host_answer`): a request the host pool can back
  (its whole length) is managed by the policy and reserves those host blocks; one it
  cannot back runs unmanaged (vLLM's own residency: every page on the device, never
  mirrored, never demoted), so a small host pool costs concurrency nothing;
* **host-prefix hit** (``HostPrefixService``): published pages past vLLM's own hit are
  reported as external tokens, leased until vLLM allocates.

The gate owns the state of one admission pass (requests let through, the blocks residency
spares, the last offer); the request registries are the ``RequestBook``'s.
"""

from __future__ import annotations

from typing import Any

from vllm_hisparse.core.policy import ResidencyPolicy
from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.metrics import HiSparseConnectorStats
from vllm_hisparse.vllm.scheduler_side.block_pool import BlockPoolDevicePool
from vllm_hisparse.vllm.scheduler_side.geometry import SchedulerGeometry
from vllm_hisparse.vllm.scheduler_side.host_prefix import HostPrefixService
from vllm_hisparse.vllm.scheduler_side.request_book import RequestBook
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME


class AdmissionGate:
    """Device headroom, host backing and host-prefix hits for vLLM's admission.

    Verbs: :meth:`offer` (vLLM offers a waiting request), :meth:`admit` (vLLM allocated
    it), :meth:`note_offer` (an offer decided elsewhere, a P/D landing),
    :meth:`note_unadmitted` and :meth:`end_pass` (the step's admission pass is over),
    :meth:`reset_watermark`.
    """

    def __init__(self, geometry: SchedulerGeometry, book: RequestBook, host_prefix: HostPrefixService,
                 host_pool: Any, stats: HiSparseConnectorStats) -> None:
        self.geometry = geometry
        self.book = book
        self.host_prefix = host_prefix
        self.host_pool = host_pool
        self.stats = stats
        # Bound in bind (vLLM builds the KVCacheManager after the connector).
        self._policy: ResidencyPolicy | None = None
        self._kv_cache_manager: Any = None
        self._device_pool: BlockPoolDevicePool | None = None
        self._base_watermark_blocks = 0
        # Requests let through this admission pass: id -> prompt pages still to allocate.
        self._let_through: dict[str, int] = {}
        # Blocks residency spares, in vLLM blocks, computed at the first offer of a pass.
        self._spared_blocks: int | None = None
        # Unmet device demand: the last waiting request offered this step (id, pages).
        self._offered: tuple[str, int] | None = None
        # The request just offered without host backing.
        self._offered_unmanaged: str | None = None

    def bind(self, policy: ResidencyPolicy, kv_cache_manager: Any, device_pool: BlockPoolDevicePool) -> None:
        self._policy = policy
        self._kv_cache_manager = kv_cache_manager
        self._device_pool = device_pool
        self._base_watermark_blocks = compat.admission_watermark_blocks(kv_cache_manager)

    @property
    def base_watermark_blocks(self) -> int:
        """vLLM's admission watermark as configured."""
        return self._base_watermark_blocks

    # ------------------------------------------------------------------ offers
    def offer(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM offers a waiting request (the connector's ``get_num_new_matched_tokens``):
        the host-side answer (:meth:`host_answer`), after setting vLLM's admission
        watermark for its allocation (:meth:`_set_headroom`)."""
        matched = self.host_answer(request, num_computed_tokens)
        if request.request_id not in self.book.requests:
            self._set_headroom(request, num_computed_tokens)
        return matched

    def host_answer(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Host-prefix hit past vLLM's own (``num_computed_tokens``, block aligned), as
        external tokens loaded asynchronously; ``(0, False)`` without one, or when the
        host pool cannot back the request (it then runs unmanaged).

        The hit is the longest published prefix of the request's block hashes, in whole
        pages, leaving at least one token to compute; it counts only past the local hit.
        """
        rid = request.request_id
        if rid in self.book.requests:
            return 0, False
        host_prefix = self.host_prefix
        host_prefix.drop_offer(rid)  # offered before and not admitted: look again
        bs = self.geometry.block_size
        local_pages = num_computed_tokens // bs
        hit_pages = host_prefix.hit_pages(request, local_pages)
        prefix_pages = local_pages + hit_pages if hit_pages else 0
        # Hit pages need no new host block, and they may sit among the evictable ones: on
        # both sides of the comparison, so the prefix cancels out of it.
        if not self.host_backs(request):
            # The host cannot back it: vLLM runs it as it would without us.
            self._offered_unmanaged = rid
            return 0, False
        self._offered_unmanaged = None
        if hit_pages:  # leased until vLLM allocates (or not) for it
            hit_pages = host_prefix.lease_offer(request, local_pages, prefix_pages)
        # A hit loads asynchronously: vLLM keeps the request in WAITING_FOR_REMOTE_KVS
        # until the worker reports the load, so a failed one is reported per request.
        return hit_pages * bs, hit_pages > 0

    def note_offer(self, rid: str, pages: int) -> None:
        """An offer decided elsewhere (a P/D landing): if vLLM does not admit ``rid``, its
        ``pages`` (in every group) are unmet device demand (:meth:`note_unadmitted`)."""
        self._offered = (rid, pages)

    def _set_headroom(self, request: Any, num_computed_tokens: int) -> None:
        """Set vLLM's admission watermark for ``request``'s allocation and remember the
        demand it represents (:meth:`note_unadmitted`).

        vLLM admits a request as soon as its prompt fits. With the connector part of the
        pool may be free only because MIXED requests released their pages; a request
        admitted into that space can leave nothing for the others' growth, and vLLM then
        preempts it, re-admits it from its prefix-cache hits and preempts it again at the
        next page boundaries (``vllm-hisparse simulate --requests 8 --prompt-len 512
        --output-len 128 --device-blocks 160`` shows it; docs/vllm-integration.md,
        "Admission headroom"). The headroom, in vLLM blocks, is what the running requests need next:

        * the rest of the prompt of every prefilling request and of every request let
          through earlier this step, in every KV cache group (a prefilling request stays
          resident, R1);
        * one page in every group for one request crossing a page boundary (a crossing
          holds it until the policy releases the page that became non-tail);
        * one page of each decoding request in the groups the policy does not manage (the
          indexer groups): growth that no release can offset.

        The watermark is that headroom, but at most the blocks residency spares now
        (``ResidencyPolicy.num_device_blocks_saved``, in every sparse group): whatever
        vLLM alone would admit (a pool without the spared blocks) is admitted. With
        nothing spared the connector steps aside completely. On top comes the rest of the
        prompt of every request admitted with a host-prefix load that has not run yet:
        vLLM allocated only its loaded pages, and without the connector it would have
        been admitted with all of them (recomputed). vLLM applies the watermark
        only while a request runs, so an idle engine admits a prompt as large as the pool.
        Cost: O(prefilling requests) per offer.
        """
        manager = self._kv_cache_manager
        if manager is None:
            return
        geometry, book = self.geometry, self.book
        bs = geometry.block_size
        groups = geometry.num_kv_groups
        num_sparse = geometry.num_sparse_groups
        pages = 1 + sum(self._let_through.values())
        requests = book.requests
        for rid in book.prefilling:
            r = requests[rid]
            pages += max(cdiv(r.num_tokens + 1, bs) - cdiv(r.num_computed_tokens, bs), 0)
        num_decoding = len(requests) - len(book.prefilling)
        num_decoding -= sum(1 for rid in self._let_through if rid in requests)
        headroom = pages * groups + max(num_decoding, 0) * (groups - num_sparse)
        if self._spared_blocks is None:  # once per admission pass
            saved = self._require_policy().num_device_blocks_saved()
            self._spared_blocks = max(saved, 0) * num_sparse
        spared = self._spared_blocks
        # Requests resuming from a host-prefix load hold their loaded pages only; without
        # the connector they would have been admitted with every page (recomputed), so
        # the rest of theirs is reserved whatever residency spares.
        loading = sum(book.loading.values()) * groups
        watermark = self._base_watermark_blocks + min(headroom, spared) + loading
        compat.set_admission_watermark_blocks(manager, watermark)
        # If vLLM does not admit it, this much is unmet device demand: its prompt in every
        # group on top of the watermark, less what is free (at least its first chunk).
        need = cdiv(max(request.num_tokens - num_computed_tokens, 1) + 1, bs) * groups
        first_chunk = cdiv(min(max(request.num_tokens - num_computed_tokens, 1), geometry.max_chunk_tokens), bs)
        short = need + watermark - self._device_pool.block_pool.get_num_free_blocks()
        self._offered = (request.request_id, max(cdiv(max(short, 0), groups), first_chunk))

    # ------------------------------------------------------------------ end of the pass
    def note_unadmitted(self, scheduled: dict[str, int]) -> None:
        """Unmet device demand the connector can see, fed to the policy's next decision
        (``note_device_demand``, in page bundles covering every KV cache group): the last
        waiting request offered this step that vLLM did not admit."""
        offered = self._offered
        if offered is None:
            return
        self._offered = None
        rid, pages = offered
        if rid not in scheduled and rid not in self.book.requests:
            if self._let_through or self.book.requests:
                self.stats.add("num_admissions_deferred", 1)
            self._require_policy().note_device_demand(self.geometry.bundles_for_pages(pages))

    def end_pass(self) -> None:
        """The step's admission pass is over (``build_connector_meta``): requests that
        resume from a finished host load are allocated before the next offers, with the
        configured watermark."""
        self._let_through.clear()
        self._spared_blocks = None
        self.reset_watermark()

    def reset_watermark(self) -> None:
        """vLLM's configured watermark back (an offer that decided its own headroom, e.g. a
        P/D landing, must not be refused by the previous offer's)."""
        if self._kv_cache_manager is not None:
            compat.set_admission_watermark_blocks(self._kv_cache_manager, self._base_watermark_blocks)

    # ------------------------------------------------------------------ admitted
    def admit(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM allocated for ``request`` (``update_state_after_alloc``): remember it, lease
        its host-prefix hit (if vLLM took it) and reserve host blocks for the rest of its
        length; or, if the host pool could not back it, let it run unmanaged."""
        rid = request.request_id
        book = self.book
        if rid in book.requests or rid in book.unmanaged:
            return
        # The rest of its prompt is headroom for the next offers (until it first runs,
        # for a request waiting for its host-prefix load).
        rest = max(cdiv(request.num_tokens + 1, self.geometry.block_size) - compat.num_allocated_pages(blocks), 0)
        if num_external_tokens:
            book.mark_loading(rid, rest)
        else:
            self._let_through[rid] = rest
        if self._offered_unmanaged == rid:
            self._offered_unmanaged = None
            book.admit_unmanaged(rid)
            self.stats.add("num_unmanaged_admissions", 1)
            return
        prefix_pages = 0
        if num_external_tokens:
            prefix_pages = self.host_prefix.take_offer(request, num_external_tokens)
        else:
            self.host_prefix.drop_offer(rid)  # another connector loads it, or nothing is loaded
        book.admit(request, self.geometry.host_pages_for(request) - prefix_pages)

    @property
    def let_through(self) -> dict[str, int]:
        """Requests let through this admission pass: id -> prompt pages still to allocate."""
        return self._let_through

    def host_backs(self, request: Any) -> bool:
        """Whether the host pool can back ``request`` for its whole length beside the blocks
        already reserved for admitted requests (else vLLM runs it as without us)."""
        return (self.geometry.host_pages_for(request)
                <= self.host_pool.num_allocatable_blocks - self.book.host_outstanding)

    def _require_policy(self) -> ResidencyPolicy:
        if self._policy is None:
            raise RuntimeError(f"{CONNECTOR_NAME}: scheduler role used before bind_kv_cache_manager")
        return self._policy
