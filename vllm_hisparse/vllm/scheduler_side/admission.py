"""The scheduler role's admission gate: which waiting request vLLM may admit now.

vLLM offers each waiting request through the connector's ``get_num_new_matched_tokens``
(:meth:`AdmissionGate.offer`), then allocates it. The answer never keeps a request waiting
(``None`` would make vLLM skip it and look up the prefix cache of every request behind it,
every step; only a P/D request that can land nowhere yet waits, ``pd/landings.py.PDLandings.offer``);
the gate acts through vLLM's own allocation check instead:

* **device headroom** (docs/vllm-integration.md, "Admission headroom"): before each
  waiting request's allocation the gate sets vLLM's admission watermark
  (``KVCacheManager.watermark_blocks``, applied to WAITING and PREEMPTED requests while
  any request runs) to the headroom the running requests need, capped by the blocks
  residency spares right now. vLLM without the connector would admit the request into a
  pool without those spared blocks, so the gate never refuses what vLLM alone would admit;
  a refused allocation ends vLLM's admission pass for the step, exactly as a full pool does;
* **host backing**: a request the host pool can back (its whole length) is managed by the
  policy and reserves those host blocks; one it cannot back runs unmanaged (vLLM's own
  residency: every page on the device, never mirrored, never demoted), so a small host
  pool costs concurrency nothing;
* **host-prefix hit** (``host_prefix_cache``): published pages past vLLM's own hit are
  reported as external tokens, leased in ``update_state_after_alloc``.

A mixin of :class:`~vllm_hisparse.vllm.scheduler_side.role.SchedulerRole`: it reads
the role's requests, prefilling set, device pool and policy.
"""

from __future__ import annotations

from typing import Any

from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm import compat


class AdmissionGate:
    """Device headroom, host backing and host-prefix hits for vLLM's admission."""

    def _host_pages_for(self, request: Any) -> int:
        max_tokens = getattr(request, "max_tokens", None) or 0
        total = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        return cdiv(max(total, 1), self.block_size)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Host-prefix hit past vLLM's own (``num_computed_tokens``, block aligned), as
        external tokens loaded asynchronously; ``(0, False)`` without one, or when the
        host pool cannot back the request (it then runs unmanaged).

        The hit is the longest published prefix of the request's block hashes, in whole
        pages, leaving at least one token to compute; it counts only past the local hit.
        """
        rid = request.request_id
        if rid in self._requests:
            return 0, False
        self._drop_offer(rid)  # offered before and not admitted: look again
        local_pages = num_computed_tokens // self.block_size
        hit_pages = self._host_hit_pages(request, local_pages)
        prefix_pages = local_pages + hit_pages if hit_pages else 0
        # Hit pages need no new host block; they may sit among the evictable ones.
        available = self.host_pool.num_allocatable_blocks - self._host_outstanding - prefix_pages
        if self._host_pages_for(request) - prefix_pages > available:
            # The host cannot back it: vLLM runs it as it would without us.
            self._offered_unmanaged = rid
            return 0, False
        self._offered_unmanaged = None
        if hit_pages:  # leased until vLLM allocates (or not) for it (host_prefix_cache)
            hit_pages = self._lease_offer(request, local_pages, prefix_pages)
        # A hit loads asynchronously: vLLM keeps the request in WAITING_FOR_REMOTE_KVS
        # until the worker reports the load, so a failed one is reported per request.
        return hit_pages * self.block_size, hit_pages > 0

    def offer(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM offers a waiting request (the connector's ``get_num_new_matched_tokens``):
        the host-side answer (:meth:`get_num_new_matched_tokens`), after setting vLLM's
        admission watermark for its allocation (:meth:`_set_admission_headroom`)."""
        matched = self.get_num_new_matched_tokens(request, num_computed_tokens)
        if request.request_id not in self._requests:
            self._set_admission_headroom(request, num_computed_tokens)
        return matched

    def _set_admission_headroom(self, request: Any, num_computed_tokens: int) -> None:
        """Set vLLM's admission watermark for ``request``'s allocation and remember the
        demand it represents (``_note_unadmitted``).

        vLLM admits a request as soon as its prompt fits. With the connector part of the
        pool may be free only because MIXED requests released their pages; a request
        admitted into that space can leave nothing for the others' growth, and vLLM then
        preempts it, re-admits it from its prefix-cache hits and preempts it again at the
        next page boundaries (``vllm-hisparse simulate --requests 8 --prompt-len 512
        --output-len 128 --device-blocks 160``: 3 preemptions against 1 without the
        connector). The headroom, in vLLM blocks, is what the running requests need next:

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
        bs = self.block_size
        groups = self._num_kv_groups
        pages = 1 + sum(self._let_through.values())
        requests = self._requests
        for rid in self._prefilling:
            r = requests[rid]
            pages += max(cdiv(r.num_tokens + 1, bs) - cdiv(r.num_computed_tokens, bs), 0)
        num_decoding = len(requests) - len(self._prefilling)
        num_decoding -= sum(1 for rid in self._let_through if rid in requests)
        headroom = pages * groups + max(num_decoding, 0) * (groups - len(self.sparse_group_ids))
        if self._spared_blocks is None:  # once per admission pass
            saved = self._require_policy().num_device_blocks_saved()
            self._spared_blocks = max(saved, 0) * len(self.sparse_group_ids)
        spared = self._spared_blocks
        # Requests resuming from a host-prefix load hold their loaded pages only; without
        # the connector they would have been admitted with every page (recomputed), so
        # the rest of theirs is reserved whatever residency spares.
        loading = sum(self._loading.values()) * groups
        watermark = self._base_watermark_blocks + min(headroom, spared) + loading
        compat.set_admission_watermark_blocks(manager, watermark)
        # If vLLM does not admit it, this much is unmet device demand: its prompt in every
        # group on top of the watermark, less what is free (at least its first chunk).
        need = cdiv(max(request.num_tokens - num_computed_tokens, 1) + 1, bs) * groups
        first_chunk = cdiv(min(max(request.num_tokens - num_computed_tokens, 1), self._max_chunk_tokens), bs)
        short = need + watermark - self.device_pool.block_pool.get_num_free_blocks()
        self._offered = (request.request_id, max(cdiv(max(short, 0), groups), first_chunk))

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
            if self._let_through or self._requests:
                self._stats.add("num_admissions_deferred", 1)
            self._require_policy().note_device_demand(self._bundles_for_pages(pages))

    def _end_admission_pass(self) -> None:
        """The step's admission pass is over (``build_connector_meta``): requests that
        resume from a finished host load are allocated before the next offers, with the
        configured watermark."""
        self._let_through.clear()
        self._spared_blocks = None
        self._reset_admission_watermark()

    def _reset_admission_watermark(self) -> None:
        """vLLM's configured watermark back (an offer that decided its own headroom, e.g. a
        P/D landing, must not be refused by the previous offer's)."""
        if self._kv_cache_manager is not None:
            compat.set_admission_watermark_blocks(self._kv_cache_manager, self._base_watermark_blocks)

    def _bundles_for_pages(self, pages: int) -> int:
        """Policy blocks (page bundles of the sparse groups) that free the vLLM blocks
        ``pages`` pages need in every KV cache group."""
        return cdiv(pages * self._num_kv_groups, len(self.sparse_group_ids))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Admitted: remember the request, lease its host-prefix hit (if vLLM took it) and
        reserve host blocks for the rest of its length; or, if the host pool could not
        back it, let it run unmanaged."""
        rid = request.request_id
        if rid in self._requests or rid in self._unmanaged:
            return
        # The rest of its prompt is headroom for the next offers (until it first runs,
        # for a request waiting for its host-prefix load).
        rest = max(cdiv(request.num_tokens + 1, self.block_size) - compat.num_allocated_pages(blocks), 0)
        if num_external_tokens:
            self._loading[rid] = rest
        else:
            self._let_through[rid] = rest
        if self._offered_unmanaged == rid:
            self._offered_unmanaged = None
            self._unmanaged.add(rid)
            self._stats.add("num_unmanaged_admissions", 1)
            return
        prefix_pages = 0
        if num_external_tokens:
            prefix_pages = self._take_offer(request, num_external_tokens)
            self._loads_to_start.append(rid)
        else:
            self._drop_offer(rid)  # another connector loads it, or nothing is loaded
        self._requests[rid] = request
        need = self._host_pages_for(request) - prefix_pages
        self._host_remaining[rid] = need
        self._host_outstanding += need
