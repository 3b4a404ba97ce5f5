"""The worker role's share of the host-prefix cache: indexer pages and prefix loads.

A page is published on the host only with its indexer page (the DSA indexer's keys of
its tokens), so the worker saves the indexer pages a step completes ahead of that
step's MIRROR and loads them back next to a host-prefix RESTORE (``IndexerPageStore``,
shared by the TP ranks of a node like the sparse-MLA pool). A host-prefix load is
asynchronous for vLLM: the worker reports its request in ``finished_recving`` once the
RESTORE is decided on every sparse group, and in ``failed_recving`` too when the copy or
the indexer page load failed (``get_transfer_results``).

A mixin of :class:`~vllm_hisparse.vllm.worker_side.role.WorkerRole`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_hisparse.core.commands import StepCommand, TransferKind, WorkerAcks
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME
from vllm_hisparse.worker.indexer_pages import IndexerPageStore, page_view

logger = logging.getLogger("vllm_hisparse.vllm")


class WorkerHostPrefix:
    """Indexer page saves and loads, and host-prefix load outcomes (module docstring)."""

    def _bind_indexer_pages(self, kv_caches: dict[str, torch.Tensor], segment: Any) -> None:
        """Page views of the indexer layers and their host store (host-prefix hits); shared
        by the TP ranks of a node like the sparse-MLA pool (``segment``), saved by the
        writer rank only."""
        groups = self.kv_cache_config.kv_cache_groups
        views: list[list[torch.Tensor]] = []
        for group_id in self.indexer_group_ids:
            names = list(groups[group_id].layer_names)
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise ValueError(f"{CONNECTOR_NAME}: register_kv_caches got no tensor for "
                                 f"indexer layer {missing[0]!r} (KV cache group {group_id})")
            views.append([page_view(kv_caches[n]) for n in names])
        if views:
            self.indexer_pages = IndexerPageStore(views, self.host_num_blocks,
                                                  ops_backend=self.config.ops_backend,
                                                  huge_pages=self._huge_pages, shared=segment,
                                                  writes_host=self.writes_host)
            logger.info("%s worker: %d indexer layers, %d B pages, %.2f GiB of host indexer "
                        "pages", CONNECTOR_NAME, self.indexer_pages.num_layers,
                        self.indexer_pages.page_bytes, self.indexer_pages.host_pool.logical_gib)

    def get_transfer_results(self) -> Any:
        """Host-prefix loads decided since the last call, per request (vLLM's
        ``KVConnectorTransferResults``): every decided load in ``finished_recving``, the
        failed ones also in ``failed_recving`` (vLLM then fails or recomputes the request
        alone; block-level ``invalid_block_ids`` are refused with several KV cache
        groups). A load is decided once every sparse group's copy is (``AckVote``). P/D
        host landings (``pd/reads.py``) are reported the same way."""
        if self.lanes:
            self._poll_acks()
        finished, self._finished_loads = self._finished_loads, set()
        failed, self._failed_loads = self._failed_loads, set()
        imported, import_failed = self._poll_imports()  # P/D host landings (pd/reads.py)
        finished |= imported
        failed |= import_failed
        return compat.KVConnectorTransferResults(finished_recving=finished, failed_recving=failed)

    def _decide_prefix_loads(self, acks: WorkerAcks) -> None:
        """Host-prefix loads among the decided transfers: their requests are finished
        receiving, and failed if the RESTORE or its indexer page load failed."""
        for tids, failed in ((acks.completed, False), (acks.failed, True)):
            for tid in tids:
                rid = self._prefix_loads.pop(tid, None)
                if rid is None:
                    continue
                self._finished_loads.add(rid)
                if failed or tid in self._failed_load_ids:
                    self._failed_load_ids.discard(tid)
                    self._failed_loads.add(rid)
                    logger.warning("%s: host-prefix load %d of request %r failed; vLLM "
                                   "fails the request (kv_load_failure_policy)",
                                   CONNECTOR_NAME, tid, rid)

    def _load_indexer_pages(self, cmd: StepCommand, metadata: Any) -> None:
        """Host-prefix loads: indexer pages next to the RESTOREs the lanes just launched
        (on the compute stream, so the forward reads them)."""
        restores = {t.transfer_id: t for t in cmd.transfers
                    if TransferKind(t.kind) is TransferKind.RESTORE}
        for tid, pages in self._step_indexer_pages.items():
            if pages.to_host:
                continue
            spec = restores.get(tid)
            if spec is None:
                raise ValueError(f"{CONNECTOR_NAME}: step {cmd.step_id} carries indexer pages "
                                 f"for transfer {tid}, which is not one of its RESTOREs")
            rid = metadata.load_requests.get(tid)
            if rid is None:
                raise ValueError(f"{CONNECTOR_NAME}: step {cmd.step_id} loads host-prefix "
                                 f"transfer {tid} for no request (metadata.load_requests)")
            self._prefix_loads[tid] = rid
            try:
                if self.indexer_pages is None:
                    raise RuntimeError("no indexer page store (no indexer layer registered)")
                self.indexer_pages.load(pages.device_blocks, pages.host_blocks)
            except Exception as exc:  # reported with the RESTORE's outcome: vLLM fails it
                logger.warning("%s: indexer page load of transfer %d failed: %s",
                               CONNECTOR_NAME, tid, exc)
                self._failed_load_ids.add(tid)

    def _save_indexer_pages(self) -> None:
        """Indexer pages completed by this forward, device → host, ahead of the mirror."""
        for tid, pages in self._step_indexer_pages.items():
            if not pages.to_host:
                continue
            try:
                if self.indexer_pages is None:
                    raise RuntimeError("no indexer page store (no indexer layer registered)")
                self.indexer_pages.save(pages.device_blocks, pages.host_blocks)
            except Exception as exc:  # those pages are then never published
                logger.warning("%s: indexer page save with transfer %d failed: %s",
                               CONNECTOR_NAME, tid, exc)
                self._failed_indexer_saves.append(tid)
        self._step_indexer_pages = {}
