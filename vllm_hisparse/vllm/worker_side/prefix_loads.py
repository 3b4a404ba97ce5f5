"""The worker's share of the host-prefix cache: indexer pages and prefix loads.

A page is published on the host only with its indexer page (the DSA indexer's keys of
its tokens), so the worker saves the indexer pages a step completes ahead of that
step's MIRROR and loads them back next to a host-prefix RESTORE (``IndexerPageStore``,
shared by the TP ranks of a node like the sparse-MLA pool). A host-prefix load is
asynchronous for vLLM: the worker reports its request in ``finished_recving`` once the
RESTORE is decided on every sparse group, and in ``failed_recving`` too when the copy or
the indexer page load failed (the worker role's ``get_transfer_results``).

A part of :class:`~vllm_hisparse.vllm.worker_side.role.WorkerRole`.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from vllm_hisparse.core.commands import StepCommand, TransferKind, WorkerAcks
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME
from vllm_hisparse.worker.indexer_pages import IndexerPageStore, page_view

logger = logging.getLogger("vllm_hisparse.vllm")


class PrefixLoads:
    """Indexer page saves and loads, and host-prefix load outcomes (module docstring).

    Verbs, in step order: :meth:`bind` (once, with the KV caches), :meth:`begin_step`
    (``start_load_kv``, after the lanes launched the step's RESTOREs), :meth:`after_forward`
    (``wait_for_save``, before the lanes' mirrors), :meth:`decide` (every voted ack batch),
    :meth:`take_decided` and :meth:`take_failed_saves` (the worker's reports).
    """

    def __init__(self) -> None:
        #: The host store of the indexer pages; None until bound or without indexer layers.
        self.indexer_pages: IndexerPageStore | None = None
        # This step's indexer page copies (metadata), by the transfer they ride with.
        self._step_pages: dict[int, Any] = {}
        # Loads in flight: RESTORE id -> the request it loads (vLLM waits for it in
        # WAITING_FOR_REMOTE_KVS), and which of them failed (indexer pages).
        self._loads: dict[int, str] = {}
        self._failed_load_ids: set[int] = set()
        # Loads decided since the last take_decided: finished / failed requests.
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._failed_saves: list[int] = []

    def bind(self, kv_caches: dict[str, torch.Tensor], kv_cache_config: Any,
             indexer_group_ids: Sequence[int], *, host_num_blocks: int, ops_backend: str,
             huge_pages: str, segment: Any, writes_host: bool) -> None:
        """Page views of the indexer layers and their host store (host-prefix hits); shared
        by the TP ranks of a node like the sparse-MLA pool (``segment``), saved by the
        writer rank only (``writes_host``)."""
        groups = kv_cache_config.kv_cache_groups
        views: list[list[torch.Tensor]] = []
        for group_id in indexer_group_ids:
            names = list(groups[group_id].layer_names)
            missing = [n for n in names if n not in kv_caches]
            if missing:
                raise ValueError(f"{CONNECTOR_NAME}: register_kv_caches got no tensor for "
                                 f"indexer layer {missing[0]!r} (KV cache group {group_id})")
            views.append([page_view(kv_caches[n]) for n in names])
        if views:
            self.indexer_pages = IndexerPageStore(views, host_num_blocks,
                                                  ops_backend=ops_backend,
                                                  huge_pages=huge_pages, shared=segment,
                                                  writes_host=writes_host)
            logger.info("%s worker: %d indexer layers, %d B pages, %.2f GiB of host indexer "
                        "pages", CONNECTOR_NAME, self.indexer_pages.num_layers,
                        self.indexer_pages.page_bytes, self.indexer_pages.host_pool.logical_gib)

    def begin_step(self, cmd: StepCommand, metadata: Any) -> None:
        """Take the step's indexer page copies; start the loads among them (host-prefix
        hits) next to the RESTOREs the lanes just launched, on the compute stream, so the
        forward reads them."""
        self._step_pages = getattr(metadata, "indexer_pages", None) or {}
        if not self._step_pages:
            return
        restores = {t.transfer_id: t for t in cmd.transfers
                    if TransferKind(t.kind) is TransferKind.RESTORE}
        for tid, pages in self._step_pages.items():
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
            self._loads[tid] = rid
            try:
                if self.indexer_pages is None:
                    raise RuntimeError("no indexer page store (no indexer layer registered)")
                self.indexer_pages.load(pages.device_blocks, pages.host_blocks)
            except Exception as exc:  # reported with the RESTORE's outcome: vLLM fails it
                logger.warning("%s: indexer page load of transfer %d failed: %s",
                               CONNECTOR_NAME, tid, exc)
                self._failed_load_ids.add(tid)

    def after_forward(self) -> None:
        """Indexer pages completed by this forward, device → host. Called before the lanes
        launch their mirrors: a mirror's completion then implies its pages' saves."""
        if not self._step_pages:
            return
        for tid, pages in self._step_pages.items():
            if not pages.to_host:
                continue
            try:
                if self.indexer_pages is None:
                    raise RuntimeError("no indexer page store (no indexer layer registered)")
                self.indexer_pages.save(pages.device_blocks, pages.host_blocks)
            except Exception as exc:  # those pages are then never published
                logger.warning("%s: indexer page save with transfer %d failed: %s",
                               CONNECTOR_NAME, tid, exc)
                self._failed_saves.append(tid)
        self._step_pages = {}

    def decide(self, acks: WorkerAcks) -> None:
        """Host-prefix loads among the decided transfers: their requests are finished
        receiving, and failed if the RESTORE or its indexer page load failed."""
        if not self._loads:
            return
        for tids, failed in ((acks.completed, False), (acks.failed, True)):
            for tid in tids:
                rid = self._loads.pop(tid, None)
                if rid is None:
                    continue
                self._finished.add(rid)
                if failed or tid in self._failed_load_ids:
                    self._failed_load_ids.discard(tid)
                    self._failed.add(rid)
                    logger.warning("%s: host-prefix load %d of request %r failed; vLLM "
                                   "fails the request (kv_load_failure_policy)",
                                   CONNECTOR_NAME, tid, rid)

    def take_decided(self) -> tuple[set[str], set[str]]:
        """Requests whose load was decided since the last call: ``(finished, failed)``
        (failed ones are in both)."""
        finished, self._finished = self._finished, set()
        failed, self._failed = self._failed, set()
        return finished, failed

    def take_failed_saves(self) -> list[int]:
        """Transfers whose indexer page save failed since the last call (never published)."""
        failed, self._failed_saves = self._failed_saves, []
        return failed

    def close(self) -> None:
        if self.indexer_pages is not None:
            self.indexer_pages.close()
