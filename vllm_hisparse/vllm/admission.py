"""The scheduler role's admission gate: which waiting request vLLM may admit now.

vLLM offers each waiting request through the connector's ``get_num_new_matched_tokens``
(:meth:`AdmissionGate.offer`). The answer combines two gates and the host-prefix hit:

* **host back-pressure**: a request is admitted only when the host pool can back its
  whole length (``(None, False)`` keeps it waiting); admitted requests reserve those host
  blocks until the policy takes them (``_host_remaining`` / ``_host_outstanding``);
* **device headroom** (docs/vllm-integration.md, "Admission headroom"): admitting it must
  leave the running requests room to grow; once one request is deferred, the later offers
  of the step wait too (first come, first served);
* **host-prefix hit** (``host_prefix_cache``): published pages past vLLM's own hit are
  reported as external tokens, leased in ``update_state_after_alloc``.

A mixin of :class:`~vllm_hisparse.vllm.scheduler_side.HiSparseSchedulerRole`: it reads
the role's requests, prefilling set, device pool and policy.
"""

from __future__ import annotations

from typing import Any

from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm.config import CONNECTOR_NAME


class AdmissionGate:
    """Host back-pressure and device headroom for vLLM's admission (module docstring)."""

    def _host_pages_for(self, request: Any) -> int:
        max_tokens = getattr(request, "max_tokens", None) or 0
        total = min(request.num_prompt_tokens + max_tokens, self.max_model_len)
        return cdiv(max(total, 1), self.block_size)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Host-prefix hit past vLLM's own (``num_computed_tokens``, block aligned), as
        external tokens loaded asynchronously; ``None`` (wait) when the host pool cannot
        back the request.

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
            return None, False
        if hit_pages:  # leased until vLLM allocates (or not) for it (host_prefix_cache)
            hit_pages = self._lease_offer(request, local_pages, prefix_pages)
        # If vLLM cannot allocate its first chunk, this is unmet device demand
        # (``_note_unadmitted``): vLLM offers waiting requests in order and stops at the
        # first one it cannot allocate.
        first_chunk = min(max(request.num_tokens - num_computed_tokens, 1), self._max_chunk_tokens)
        self._offered = (rid, cdiv(first_chunk, self.block_size))
        # A hit loads asynchronously: vLLM keeps the request in WAITING_FOR_REMOTE_KVS
        # until the worker reports the load, so a failed one is reported per request.
        return hit_pages * self.block_size, hit_pages > 0

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
        return cdiv(pages * self._num_kv_groups, len(self.sparse_group_ids))

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Admitted: remember the request, lease its host-prefix hit (if vLLM took it) and
        reserve host blocks for the rest of its length."""
        rid = request.request_id
        if rid in self._requests:
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
        need = cdiv(request.num_tokens + 1, bs)
        if not self._requests and not self._let_through:
            # Nothing runs that the headroom would protect: vLLM's own allocation decides
            # (else a prompt near the pool's size would wait forever on an idle engine).
            self._let_through[request.request_id] = need
            return False
        pages = need + 1 + sum(self._let_through.values())
        requests = self._requests
        for rid in self._prefilling:
            r = requests[rid]
            pages += max(cdiv(r.num_tokens + 1, bs) - cdiv(r.num_computed_tokens, bs), 0)
        num_decoding = len(requests) - len(self._prefilling)
        num_decoding -= sum(1 for rid in self._let_through if rid in requests)
        blocks = pages * groups + max(num_decoding, 0) * (groups - len(self.sparse_group_ids))
        free = self.device_pool.block_pool.get_num_free_blocks()
        if blocks > free:
            self._require_policy().note_device_demand(cdiv(blocks - free, len(self.sparse_group_ids)))
            return True
        self._let_through[request.request_id] = need
        return False

