"""P/D decode consumer, worker side: the reads of an import (``pd/landings.py``).

For each :class:`~vllm_hisparse.vllm.pd.import_order.ImportOrder`, every worker of the
decode replica:

1. loads the registration of the prefill worker it reads from (vLLM's side channel, on a
   background thread; ``prefill_agents``), once per prefill engine and registration;
2. reads into its own device memory, with one page-granular NIXL READ: the indexer pages
   into the indexer blocks vLLM allocated, and the sparse-MLA pages the order names into
   their sparse blocks (every page of a resident landing, the tail of a host landing);
3. for a host landing, the rank that writes the host pool also reads every page's
   sparse-MLA rows through a bounded **staging buffer** on the KV device: a chunk of pages
   is READ into it, then copied into the host rows by a
   :class:`~vllm_hisparse.worker.TransferEngine` spill (the policy's page copy), and its
   slots are reused once that copy completed (two chunks in flight);
4. tells the prefill it may free the blocks (``"<remote request id>:<readers>"``, vLLM's
   notification) and reports the request: ``finished_recving``, and ``failed_recving``
   too after any error or :data:`IMPORT_DEADLINE_S`. A report waits until no read or copy
   of the request is in flight, since vLLM may reuse its blocks right after (past the
   deadline, a read still in flight is aborted).

Before the first read is prepared, the request's block lists are checked against the
registration the handshake loaded (``transfer_params.check_registered_blocks``: every block
inside the prefill's region of its layer). Any error of an import, whatever raised it
(NIXL's own exception types included), ends that import alone: it is drained, its staging
slots return, it leaves this importer's tables and is reported failed; the others go on.

``CANCEL`` orders (admitted, then dropped) only notify and report failed; ``RELEASE``
orders (aborted before admission) only notify; ``REFUSE`` orders (invalid
``kv_transfer_params``) contact nobody and report failed. Rank 0 also renews the
prefill's leases (``"HB:<ids>"``) of the requests in the metadata's heartbeats.

Tensor parallelism: MLA KV is replicated over the prefill's ranks; decode rank ``r`` reads
from prefill rank ``r % p``. A prefill rank frees a request once as many readers as the
notification names have notified it; decode rank 0 also notifies the prefill ranks no one
reads from. Everything runs on the engine thread at ``submit`` / ``poll`` (every step),
except the side-channel query.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.pd.composition import pd_composition
from vllm_hisparse.vllm.pd.import_order import Heartbeat, ImportAction, ImportOrder
from vllm_hisparse.vllm.pd.nixl_transport import ImportTransferError, NixlTransport, RemoteAgent
from vllm_hisparse.vllm.pd.prefill_agents import PrefillAgents, agent_key
from vllm_hisparse.vllm.pd.transfer_params import InvalidTransferParams, check_registered_blocks
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME
from vllm_hisparse.worker import TransferEngine
from vllm_hisparse.worker.indexer_pages import page_view

logger = logging.getLogger("vllm_hisparse.vllm")

#: Pages the staging buffer holds (all sparse-MLA layers of each): DeepSeek-V3.2,
#: 32 x 61 layers x 41,984 B = 82 MB of device memory. Two chunks of half of it in flight.
IMPORT_STAGING_PAGES = 32
#: A host landing not finished after this long fails (its request fails alone).
IMPORT_DEADLINE_S = 120.0


@dataclass
class ImportTargets:
    """Where this worker puts imported pages.

    Attributes:
        sparse: per sparse-MLA layer, in host-pool order: ``(name, sparse group index,
            flat device row view, block stride in rows)``.
        indexer: per indexer KV cache group, ``(name, page view)`` of its layers.
        host_layers: the host pool's layer views (``[host rows, row_bytes]``), same order
            as ``sparse``.
        block_size: tokens per page.
    """

    sparse: list[tuple[str, int, torch.Tensor, int]]
    indexer: list[list[tuple[str, torch.Tensor]]]
    host_layers: list[torch.Tensor]
    block_size: int

    @property
    def row_bytes(self) -> int:
        return int(self.sparse[0][2].shape[1])

    @property
    def device(self) -> torch.device:
        return self.sparse[0][2].device


def readers_of(prefill_rank: int, decode_world: int, prefill_world: int) -> int:
    """Decode ranks that read from ``prefill_rank`` (rank ``r`` reads ``r % prefill_world``)."""
    return len(range(prefill_rank, decode_world, prefill_world))


def _why(exc: BaseException) -> str:
    """An import error for the log and the failure: our named errors as they are, anything
    else (NIXL's own types, a bug) with its type."""
    if isinstance(exc, (ImportTransferError, InvalidTransferParams)):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


@dataclass
class _Chunk:
    pages: list[int]
    slots: list[int]
    handle: Any = None
    spill_id: int = -1


@dataclass
class _Import:
    order: ImportOrder
    started_s: float
    agents: dict[int, RemoteAgent] = field(default_factory=dict)  # prefill rank -> agent
    device_read: Any = None
    next_page: int = 0  # next page to stage (host writer)
    chunks: list[_Chunk] = field(default_factory=list)
    error: str | None = None
    transfer_error: bool = False  # the prefill's agent may be stale: ask again next time
    started: bool = False

    @property
    def busy(self) -> bool:
        return self.device_read is not None or any(
            c.handle is not None or c.spill_id >= 0 for c in self.chunks)


class KVImporter:
    """Runs the host landings of one worker (module docstring).

    Args:
        targets: this worker's device and host destinations.
        transport: the NIXL agent (registers the staging buffer and the KV tensors).
        kv_tensors: the tensors vLLM allocated for this worker's KV cache (registered).
        rank, world_size: this worker's place in the decode replica.
        writes_host: this rank writes the (shared) host pool: it stages the sparse rows.
        ops_backend: for the staging copies.
        staging_pages: pages the staging buffer holds.
        deadline_s: per-import deadline.
        clock: seconds (tests move time).
    """

    def __init__(self, targets: ImportTargets, transport: NixlTransport, kv_tensors: list[torch.Tensor], *,
                 rank: int, world_size: int, writes_host: bool, ops_backend: str = "auto",
                 staging_pages: int = IMPORT_STAGING_PAGES, deadline_s: float = IMPORT_DEADLINE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.targets = targets
        self.transport = transport
        self.rank = int(rank)
        self.world_size = max(1, int(world_size))
        self.writes_host = bool(writes_host)
        self.deadline_s = float(deadline_s)
        self._clock = clock
        bs, row_bytes = targets.block_size, targets.row_bytes
        self._mem = NixlTransport.mem_type(targets.sparse[0][2])
        self._page_bytes = bs * row_bytes
        self.staging: torch.Tensor | None = None
        self._engine: TransferEngine | None = None
        self._free_slots: list[int] = []
        self._chunk_pages = 0
        if self.writes_host:
            num_layers = len(targets.sparse)
            self.staging = torch.empty((num_layers, staging_pages * bs, row_bytes), dtype=torch.uint8,
                                       device=targets.device)
            self._engine = TransferEngine(list(self.staging), targets.host_layers, bs,
                                          ops_backend=ops_backend)
            self._free_slots = list(range(staging_pages))
            self._chunk_pages = max(1, staging_pages // 2)
        transport.register([*kv_tensors, *([self.staging] if self.staging is not None else [])])
        self.prefills = PrefillAgents(transport)  # handshakes and loaded prefill agents
        self._imports: dict[str, _Import] = {}
        self._spills: dict[int, tuple[_Import, _Chunk]] = {}
        self._next_spill_id = 0
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self.num_pages_staged = 0

    # ------------------------------------------------------------------ the step
    def submit(self, orders: list[ImportOrder], heartbeats: list[Heartbeat] = ()) -> None:
        """Start this step's orders (side-channel queries go to the background thread);
        renew the leases of ``heartbeats`` (rank 0)."""
        now = self._clock()
        for order in orders:
            if order.request_id in self._imports:
                raise ValueError(f"{CONNECTOR_NAME}: import of request {order.request_id!r} "
                                 "ordered twice")
            self._imports[order.request_id] = _Import(order, now)
        if orders:
            self._advance_all()
        if self.rank == 0:
            for heartbeat in heartbeats:
                self._heartbeat(heartbeat)

    def poll(self) -> tuple[set[str], set[str]]:
        """Advance every import; return the requests decided since the last call:
        ``(finished, failed)`` (failed ones are in both)."""
        self._advance_all()
        finished, self._finished = self._finished, set()
        failed, self._failed = self._failed, set()
        return finished, failed

    def _advance_all(self) -> None:
        if self._engine is not None:
            self._collect_spills()
        for imp in list(self._imports.values()):
            try:
                self._advance(imp)
            except Exception as exc:  # a bug or an unexpected NIXL error: this import only
                logger.warning("%s: P/D import of request %r: unexpected error", CONNECTOR_NAME,
                               imp.order.request_id, exc_info=True)
                self._fail(imp, _why(exc))
        self.prefills.end_pass(agent_key(imp.order.remote, rank) for imp in self._imports.values()
                               if not imp.started and imp.error is None and imp.order.remote
                               for rank in self._prefill_ranks(imp.order))

    @property
    def handshake_timeout_s(self) -> float:
        return self.prefills.timeout_s

    @handshake_timeout_s.setter
    def handshake_timeout_s(self, seconds: float) -> None:
        self.prefills.timeout_s = seconds

    @property
    def num_imports(self) -> int:
        """Imports this worker has not reported yet."""
        return len(self._imports)

    def close(self) -> None:
        self.prefills.close()
        if self._engine is not None:
            self._engine.wait_all()
        self.transport.close()

    # ------------------------------------------------------------------ internals
    def _prefill_ranks(self, order: ImportOrder) -> list[int]:
        """Prefill ranks this worker talks to: the one it reads from, and on rank 0 those
        no decode rank reads from (they are only notified)."""
        p = max(1, order.remote.tp_size)
        ranks = [self.rank % p]
        if self.rank == 0:
            ranks += list(range(self.world_size, p))
        return ranks

    def _heartbeat(self, heartbeat: Heartbeat) -> None:
        """``"HB:<ids>"`` to every rank of the prefill engine (skipped while its
        registration is being loaded; a failure is only logged: the lease is the backstop)."""
        message = ("HB:" + ",".join(heartbeat.request_ids)).encode()
        for prefill_rank in range(max(1, heartbeat.remote.tp_size)):
            try:
                agent = self.prefills.get(heartbeat.remote, prefill_rank)
            except Exception as exc:
                logger.debug("%s: lease renewal for %s skipped: %s", CONNECTOR_NAME,
                             heartbeat.remote.engine_id, exc)
                continue
            if agent is not None:
                self.transport.notify(agent, message)

    def _fail(self, imp: _Import, why: str, *, transfer: bool = True) -> None:
        if imp.error is None:
            imp.error = why
            imp.transfer_error = transfer
            logger.warning("%s: P/D import of request %r failed on worker %d: %s", CONNECTOR_NAME,
                           imp.order.request_id, self.rank, why)

    def _advance(self, imp: _Import) -> None:
        order = imp.order
        if order.action is ImportAction.REFUSE:  # the scheduler logged why
            imp.error = order.action.value
            self._finish(imp)
            return
        if imp.error is None and self._past_deadline(imp):
            self._fail(imp, f"not finished after {self.deadline_s:g} s")
        if imp.error is None and not imp.started:
            ranks = self._prefill_ranks(order)
            try:
                for prefill_rank in ranks:
                    if prefill_rank not in imp.agents:
                        agent = self.prefills.get(order.remote, prefill_rank)
                        if agent is not None:
                            imp.agents[prefill_rank] = agent
            except Exception as exc:  # unreachable prefill, foreign registration, ...
                self._fail(imp, f"handshake with the prefill: {_why(exc)}", transfer=False)
            if imp.error is None and len(imp.agents) == len(ranks):
                if order.action is not ImportAction.READ:  # only tell the prefill
                    imp.error = order.action.value
                else:
                    self._start(imp)
        if imp.error is None and imp.device_read is not None:
            state = self.transport.state(imp.device_read)
            if state != "PROC":
                self.transport.release(imp.device_read)
                imp.device_read = None
                if state == "ERR":
                    self._fail(imp, "the device page read failed")
        if imp.error is None and imp.started:
            self._stage(imp)
        if imp.error is not None:
            self._drain(imp)
        if imp.busy or (imp.error is None and not self._done(imp)):
            return
        self._finish(imp)

    def _past_deadline(self, imp: _Import) -> bool:
        return self._clock() - imp.started_s > self.deadline_s

    def _check_remote(self, agent: RemoteAgent, order: ImportOrder) -> None:
        """Before any read is prepared: the prefill's geometry is ours (block size, every
        layer registered with our page size) and every block the import reads lies in the
        prefill's registered region (``check_registered_blocks``)."""
        if agent.block_size != self.targets.block_size:
            raise ImportTransferError(f"the prefill's block size is {agent.block_size}, "
                                      f"ours {self.targets.block_size}")
        layers = [(name, self._page_bytes) for name, _, _, _ in self.targets.sparse]
        layers += [(name, view.shape[1]) for group in self.targets.indexer for name, view in group]
        for name, length in layers:
            where = agent.layers.get(name)
            if where is None:
                raise ImportTransferError(f"the prefill registers no layer {name!r}")
            if where.length != length:
                raise ImportTransferError(f"layer {name!r}: the prefill's pages are "
                                          f"{where.length} B, ours {length} B")
        check_registered_blocks(order.remote, agent.layers, [n for n, _ in layers], order.num_pages)

    def _start(self, imp: _Import) -> None:
        """Check the prefill's geometry and the request's blocks against it; post the
        device read (indexer and sparse pages)."""
        imp.started = True
        order = imp.order
        agent = imp.agents[self.rank % max(1, order.remote.tp_size)]
        try:
            self._check_remote(agent, order)
            local, remote = [], []
            first_device = order.num_pages - len(order.device_blocks)
            for name, group, rows, stride in self.targets.sparse:
                for i, blocks in enumerate(order.device_blocks):
                    local.append(rows.data_ptr() + blocks[group] * stride * rows.stride(0))
                    remote.append(self._remote_page(agent, order, name, first_device + i, self._page_bytes))
            for g, layers in enumerate(self.targets.indexer):
                for name, view in layers:
                    page_bytes = view.shape[1]
                    for p in range(order.num_pages):
                        local.append(view.data_ptr() + order.indexer_blocks[g][p] * view.stride(0))
                        remote.append(self._remote_page(agent, order, name, p, page_bytes))
            if local:
                imp.device_read = self._read(agent, local, remote)
        except Exception as exc:  # ours (named) or NIXL's, any type: this import fails
            # A request's bad blocks say nothing against the prefill's registration.
            self._fail(imp, _why(exc), transfer=not isinstance(exc, InvalidTransferParams))

    @staticmethod
    def _remote_page(agent: RemoteAgent, order: ImportOrder, layer: str, page: int,
                     length: int) -> tuple[int, int]:
        """Address of ``layer``'s page ``page`` on the prefill (checked by ``_check_remote``)."""
        where = agent.layers[layer]
        return where.base + int(order.remote.block_ids[where.group][page]) * where.stride, length

    def _read(self, agent: RemoteAgent, local: list[int], remote: list[tuple[int, int]]) -> Any:
        n = len(local)
        lengths = np.fromiter((r[1] for r in remote), dtype=np.int64, count=n)
        device_id = max(self.targets.device.index or 0, 0) if self._mem == "VRAM" else 0
        local_descs = np.stack([np.asarray(local, dtype=np.int64), lengths,
                                np.full(n, device_id, dtype=np.int64)], axis=1)
        remote_descs = np.stack([np.fromiter((r[0] for r in remote), dtype=np.int64, count=n),
                                 lengths, np.zeros(n, dtype=np.int64)], axis=1)
        return self.transport.read(agent, local_descs, self._mem, remote_descs)

    def _stage(self, imp: _Import) -> None:
        """Host writer: post chunk reads into free staging slots; spill finished chunks."""
        if not self.writes_host or not imp.order.host_blocks:
            return
        order = imp.order
        agent = imp.agents[self.rank % max(1, order.remote.tp_size)]
        for chunk in imp.chunks:
            if chunk.handle is None:
                continue
            state = self.transport.state(chunk.handle)
            if state == "PROC":
                continue
            self.transport.release(chunk.handle)
            chunk.handle = None
            if state == "ERR":
                self._fail(imp, "a staged page read failed")
                self._free_slots.extend(chunk.slots)
                chunk.slots = []
                return
            spill_id = self._next_spill_id
            self._next_spill_id += 1
            try:
                self._engine.spill(spill_id, chunk.slots, [order.host_blocks[p] for p in chunk.pages])
            except Exception as exc:  # never enqueued: nothing to wait for
                self._release_chunk(chunk)
                self._fail(imp, f"staging copy into the host pool failed: {_why(exc)}")
                return
            chunk.spill_id = spill_id
            self._spills[spill_id] = (imp, chunk)
        imp.chunks = [c for c in imp.chunks if c.handle is not None or c.spill_id >= 0]
        num_host = len(order.host_blocks)
        while imp.next_page < num_host and self._free_slots:
            n = min(self._chunk_pages, num_host - imp.next_page, len(self._free_slots))
            pages = list(range(imp.next_page, imp.next_page + n))
            slots, self._free_slots = self._free_slots[:n], self._free_slots[n:]
            chunk = _Chunk(pages, slots)
            try:
                local, remote = [], []
                for layer, (name, _, _, _) in enumerate(self.targets.sparse):
                    base = self.staging[layer].data_ptr()
                    for page, slot in zip(pages, slots):
                        local.append(base + slot * self._page_bytes)
                        remote.append(self._remote_page(agent, order, name, page, self._page_bytes))
                chunk.handle = self._read(agent, local, remote)
            except Exception as exc:  # ours (named) or NIXL's, any type: this import fails
                self._free_slots.extend(slots)
                self._fail(imp, _why(exc))
                return
            imp.chunks.append(chunk)
            imp.next_page += n

    def _collect_spills(self) -> None:
        report = self._engine.poll()
        for tid, why in report.failed:
            imp, chunk = self._spills.pop(tid)
            self._release_chunk(chunk)
            self._fail(imp, f"staging copy into the host pool failed: {why}")
        for tid in report.completed:
            imp, chunk = self._spills.pop(tid)
            self.num_pages_staged += len(chunk.pages)
            self._release_chunk(chunk)

    def _release_chunk(self, chunk: _Chunk) -> None:
        self._free_slots.extend(chunk.slots)
        chunk.slots = []
        chunk.spill_id = -1

    def _drain(self, imp: _Import) -> None:
        """After an error: stop posting; wait for the reads in flight, past the deadline
        abort them (a read NIXL will not abort is waited for: it may still write)."""
        imp.next_page = len(imp.order.host_blocks)
        if imp.device_read is not None and self._settle(imp, imp.device_read):
            imp.device_read = None
        for chunk in imp.chunks:
            if chunk.handle is not None and self._settle(imp, chunk.handle):
                chunk.handle = None
                self._free_slots.extend(chunk.slots)
                chunk.slots = []
        imp.chunks = [c for c in imp.chunks if c.handle is not None or c.spill_id >= 0]

    def _settle(self, imp: _Import, handle: Any) -> bool:
        """Release a read of a failed import once it is over, or abort it past the
        deadline; True when it can no longer write."""
        if self.transport.state(handle) != "PROC":
            return self.transport.release(handle)
        return self._past_deadline(imp) and self.transport.release(handle, abort=True)

    def _done(self, imp: _Import) -> bool:
        return imp.started and (not self.writes_host or imp.next_page >= len(imp.order.host_blocks))

    def _finish(self, imp: _Import) -> None:
        order = imp.order
        for prefill_rank, agent in imp.agents.items():
            readers = readers_of(prefill_rank, self.world_size, max(1, order.remote.tp_size))
            message = f"{order.remote.request_id}:{max(readers, 1)}".encode()
            self.transport.notify(agent, message)
        del self._imports[order.request_id]
        if order.reported:
            self._finished.add(order.request_id)
            if imp.error is not None:
                self._failed.add(order.request_id)
        if imp.transfer_error:
            for prefill_rank, agent in imp.agents.items():  # ask again next time
                self.prefills.drop(order.remote, prefill_rank, agent, self._reads_from)

    def _reads_from(self, agent_name: str) -> bool:
        """An import not yet reported holds this prefill agent."""
        return any(agent.agent_name == agent_name for imp in self._imports.values()
                   for agent in imp.agents.values())


class PDReads:
    """The worker's P/D reads: a part of
    :class:`~vllm_hisparse.vllm.worker_side.role.WorkerRole`, present only when this
    instance lands P/D imports in the host tier (:func:`pd_reads_for`).

    Verbs: :meth:`bind` once the KV caches are bound (builds the :class:`KVImporter`),
    :meth:`submit` at ``start_load_kv``, :meth:`poll` with the transfer results,
    :meth:`close` at shutdown.

    Args:
        composition: the P/D composition of this instance (``pd_composition``), enabled.
    """

    def __init__(self, composition: Any) -> None:
        self.composition = composition
        self.importer: KVImporter | None = None

    def bind(self, vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, torch.Tensor],
             lanes: Sequence[Any], host_layers: Sequence[torch.Tensor], *,
             indexer_group_ids: Sequence[int], block_size: int, rank: int, writes_host: bool,
             ops_backend: str) -> None:
        """Build this worker's importer: its targets are the lanes' sparse-MLA layers
        (``worker_side.lanes.Lane``), the indexer groups' page views and the host pool's
        layers (``host_layers``, in lane order)."""
        groups = kv_cache_config.kv_cache_groups
        targets = ImportTargets(
            sparse=[(name, lane.sparse_index, view, lane.layout.block_stride_rows)
                    for lane in lanes for name, view in zip(lane.layer_names, lane.device_layers)],
            indexer=[[(name, page_view(kv_caches[name])) for name in groups[g].layer_names]
                     for g in indexer_group_ids],
            host_layers=list(host_layers), block_size=block_size)
        extra = self.composition.nixl_extra_config
        _, _, _, compat_hash = compat.nixl_handshake_types()
        enforce = bool(extra.get("enforce_handshake_compat", True))

        def check_compat(remote_hash: str, backend_name: str) -> str | None:
            ours = compat_hash(vllm_config, backend_name, transfer_mode="pull")
            if enforce and remote_hash != ours:
                return (f"NIXL compatibility hash of the prefill ({remote_hash}) differs from "
                        f"ours ({ours}): different vLLM, model, dtype or KV cache dtype")
            return None

        transport = NixlTransport(f"hisparse-import-{uuid.uuid4()}",
                                  backends=tuple(extra.get("backends", ["UCX"])),
                                  check_compat=check_compat)
        self.importer = KVImporter(
            targets, transport, list(kv_caches.values()), rank=rank,
            world_size=vllm_config.parallel_config.world_size, writes_host=writes_host,
            ops_backend=ops_backend, staging_pages=IMPORT_STAGING_PAGES)
        logger.info("%s worker: P/D imports ready (NIXL agent %s; %s)", CONNECTOR_NAME,
                    transport.name, f"{IMPORT_STAGING_PAGES} staging pages of {len(targets.sparse)} "
                    "layers" if writes_host else "device pages only: another rank writes the host pool")

    def submit(self, metadata: Any) -> None:
        """The step's import orders and lease renewals (``metadata.imports`` /
        ``heartbeats``)."""
        orders, heartbeats = _orders(metadata)
        if not orders and not heartbeats:
            return
        if self.importer is None:
            refuse_imports(metadata, "not bound")
        self.importer.submit(orders, heartbeats)

    def poll(self) -> tuple[set[str], set[str]]:
        """Imports decided since the last call: ``(finished, failed)``."""
        if self.importer is None:
            return set(), set()
        return self.importer.poll()

    def close(self) -> None:
        if self.importer is not None:
            self.importer.close()


def pd_reads_for(vllm_config: Any) -> tuple[PDReads | None, str]:
    """This worker's P/D reads part, or None when the composition lands no imports here,
    with the composition's reason (what a refused import order names). Called from the
    worker role's constructor: the composing MultiConnector is on the stack then."""
    composition = pd_composition(compat.composing_kv_transfer_config(vllm_config))
    return (PDReads(composition) if composition.enabled else None), composition.reason


def refuse_imports(metadata: Any, reason: str | None) -> None:
    """Raise when the step orders imports or lease renewals that this worker cannot run
    (no P/D reads: ``reason`` says why)."""
    orders, heartbeats = _orders(metadata)
    if orders or heartbeats:
        raise RuntimeError(
            f"{CONNECTOR_NAME}: the scheduler ordered a P/D import but this worker has no "
            f"importer ({reason or 'not bound'})")


def _orders(metadata: Any) -> tuple[list[ImportOrder], list[Heartbeat]]:
    return (getattr(metadata, "imports", None) or [],
            getattr(metadata, "heartbeats", None) or [])
