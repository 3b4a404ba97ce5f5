"""NIXL for P/D imports: one agent per worker, the handshake with a stock vLLM prefill,
page reads, notifications. The only module that imports ``nixl``.

The prefill side is vLLM's NixlConnector (``kv_producer``), unchanged. It serves its
registration on a ZMQ side channel (``remote_host:remote_port`` of the request's
``kv_transfer_params``): a ``(GET_META_MSG, pp_rank, tp_rank)`` query is answered with a
``NixlHandshakePayload`` (a compatibility hash and an encoded ``NixlAgentMetadata``) and the
prefill's clock. It holds a request's blocks until a reader notifies
``"<remote request id>:<readers>"`` (or its lease expires) and extends the lease on
``"HB:<ids>"`` heartbeats. Those message formats and types are vLLM's
(``compat.nixl_handshake_types``); everything else here is ours.

Reads are page-granular: one descriptor per (layer, page). Reading straight into the
position-major host pool would take one 656 B descriptor per (layer, row), measured
~30x slower (docs/vllm-integration.md, "P/D decode consumer"), so the worker stages pages
in a bounded device buffer and copies them into host rows with its own page copy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from vllm_hisparse.vllm import compat

logger = logging.getLogger("vllm_hisparse.vllm")

#: Seconds the handshake waits for the prefill's side channel to answer.
HANDSHAKE_TIMEOUT_S = 5.0


def nixl_missing() -> str | None:
    """None when the ``nixl`` package imports here, else why not (for skips and errors)."""
    try:
        import nixl._api  # noqa: F401
    except Exception as exc:  # ImportError, or a backend that fails to load
        return f"nixl is not importable: {type(exc).__name__}: {exc}"
    return None


class ImportTransferError(RuntimeError):
    """A NIXL handshake or read for a P/D import failed (the request fails alone)."""


@dataclass(frozen=True)
class RemotePage:
    """How the prefill addresses one layer's page: block ``b`` is
    ``[base + b * stride, base + b * stride + length)`` in its ``group``-th transfer group;
    its registered region holds blocks ``0 .. num_blocks - 1``."""

    base: int
    length: int
    stride: int
    group: int
    num_blocks: int


@dataclass
class RemoteAgent:
    """A prefill worker this agent may read from (after a handshake)."""

    agent_name: str
    engine_id: str
    tp_rank: int
    block_size: int
    mem_type: str
    layers: dict[str, RemotePage]


def remote_layer_pages(meta: Any) -> dict[str, RemotePage]:
    """Per layer name, where its pages live on the prefill, from a ``NixlAgentMetadata``.

    Two registrations are understood: one region per layer (``region_names``; layer-
    outermost layouts), and block-outermost rows where one region's block holds every
    layer's page (``packed_member_layouts``: layer → (offset in the row, page bytes)).
    Raises :class:`ImportTransferError` for anything else (no region names, a packed row
    shared by several groups)."""
    names = getattr(meta, "region_names", None)
    if not names or len(names) != len(meta.kv_caches_base_addr):
        raise ImportTransferError(
            "the prefill's NIXL registration names no layers (region_names); this reader "
            "needs vLLM's NixlConnector of the same release on both sides")
    groups = getattr(meta, "region_group_ids", None) or [0] * len(names)
    members = getattr(meta, "region_members", None) or [[] for _ in names]
    packed = dict(getattr(meta, "packed_member_layouts", None) or {})
    counts = getattr(meta, "region_num_blocks", None) or [meta.num_blocks] * len(names)
    if not len(groups) == len(members) == len(counts) == len(names):
        raise ImportTransferError("the prefill's NIXL registration lists regions of different "
                                  "lengths (names, groups, members, block counts)")
    out: dict[str, RemotePage] = {}
    for i, name in enumerate(names):
        base, length, stride = (int(meta.kv_caches_base_addr[i]), int(meta.block_lens[i]),
                                int(meta.block_strides[i]))
        group, num_blocks = int(groups[i]), int(counts[i])
        in_row = [n for n in [name, *members[i]] if n in packed]
        if in_row:
            if group < 0:
                raise ImportTransferError(
                    "the prefill packs several KV cache groups into one block row; a host "
                    "landing reads per-layer pages of one group")
            for layer in (n for n in packed if n not in out):
                offset, page = (int(v) for v in packed[layer])
                if offset < 0 or page <= 0 or offset + page > stride:
                    raise ImportTransferError(
                        f"the prefill packs layer {layer!r} at bytes {offset}..{offset + page} "
                        f"of a {stride} B block row")
                out[layer] = RemotePage(base + offset, page, stride, group, num_blocks)
            continue
        if length <= 0 or length > stride:
            raise ImportTransferError(f"the prefill registers region {name!r} with {length} B "
                                      f"pages {stride} B apart")
        for layer in [name, *members[i]]:
            out.setdefault(layer, RemotePage(base, length, stride, group, num_blocks))
    return out


def _zmq_path(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def query_prefill(host: str, port: int, tp_rank: int, *, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> bytes:
    """Ask a prefill's side channel for rank ``tp_rank``'s registration; the raw
    ``NixlHandshakePayload`` bytes. Blocking (run it off the engine thread)."""
    import msgspec
    import zmq

    get_meta, _, _, _ = compat.nixl_handshake_types()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        sock.connect(_zmq_path(host, port))
        sock.send(msgspec.msgpack.encode((get_meta, 0, int(tp_rank))))
        try:
            parts = sock.recv_multipart()
        except zmq.Again as exc:
            raise ImportTransferError(f"the prefill at {host}:{port} did not answer the NIXL "
                                      f"handshake within {timeout_s:g} s") from exc
        return parts[0]
    finally:
        ctx.destroy(linger=0)


class NixlTransport:
    """One NIXL agent: registered local memory, known prefill agents, READs.

    Every NIXL call happens on the caller's thread (the agent is not assumed thread-safe);
    only :func:`query_prefill` (ZMQ) may run on another.

    Args:
        name: agent name, unique per process.
        backends: NIXL backends (vLLM's NixlConnector default: UCX).
        check_compat: ``(payload hash, prefill attention backend) -> error or None``:
            the compatibility check of vLLM's handshake (same vLLM, model, dtypes).
    """

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",),
                 check_compat: Callable[[str, str], str | None] | None = None) -> None:
        missing = nixl_missing()
        if missing:
            raise RuntimeError(f"a P/D decode consumer (kv_role kv_consumer) reads the prefill's KV "
                               f"with NIXL: {missing}; install it (pip install nixl)")
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(backends=list(backends)))
        self._check_compat = check_compat
        self._registered: list[Any] = []
        self._ranges: set[tuple[int, int]] = set()
        self._dlists: dict[int, tuple[Any, Any]] = {}

    @staticmethod
    def mem_type(tensor: torch.Tensor) -> str:
        return "VRAM" if tensor.device.type == "cuda" else "DRAM"

    def register(self, tensors: Sequence[torch.Tensor]) -> None:
        """Register the storage of each tensor once (whole allocations, deduplicated)."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key in self._ranges or key[1] == 0:
                continue
            self._ranges.add(key)
            device = max(tensor.get_device(), 0) if tensor.device.type == "cuda" else 0
            descs = self._agent.get_reg_descs([(key[0], key[1], device, "")], self.mem_type(tensor))
            self._agent.register_memory(descs)
            self._registered.append(descs)

    def add_prefill(self, payload: bytes, *, expected_engine_id: str, tp_rank: int) -> RemoteAgent:
        """Load a prefill worker's registration (``query_prefill``'s answer)."""
        import msgspec

        _, payload_type, meta_type, _ = compat.nixl_handshake_types()
        try:
            wrapped = msgspec.msgpack.Decoder(payload_type).decode(payload)
            meta = msgspec.msgpack.Decoder(meta_type).decode(wrapped.agent_metadata_bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ImportTransferError(f"undecodable NIXL handshake from the prefill: {exc}") from exc
        if self._check_compat is not None:
            problem = self._check_compat(wrapped.compatibility_hash, meta.attn_backend_name)
            if problem:
                raise ImportTransferError(problem)
        if meta.engine_id != expected_engine_id:
            raise ImportTransferError(f"the prefill answered as engine {meta.engine_id!r}, "
                                      f"expected {expected_engine_id!r}")
        kinds = set(getattr(meta, "region_mem_types", None) or ["VRAM"])
        if len(kinds) != 1:
            raise ImportTransferError(f"the prefill registers mixed memory kinds {sorted(kinds)}")
        if int(meta.physical_blocks_per_logical_kv_block) != 1:
            raise ImportTransferError(
                f"the prefill splits each block into {meta.physical_blocks_per_logical_kv_block} "
                "physical blocks (a different kernel block size); this reader reads whole blocks")
        layers = remote_layer_pages(meta)  # before the agent is added: nothing to undo
        try:
            name = self._agent.add_remote_agent(meta.agent_metadata)
        except Exception as exc:  # nixl's own errors, any type
            raise ImportTransferError(f"NIXL refused the prefill's agent metadata: "
                                      f"{type(exc).__name__}: {exc}") from exc
        if isinstance(name, bytes):
            name = name.decode()
        return RemoteAgent(agent_name=name, engine_id=meta.engine_id, tp_rank=int(tp_rank),
                           block_size=int(meta.block_size), mem_type=kinds.pop(), layers=layers)

    def read(self, agent: RemoteAgent, local: np.ndarray, local_mem: str, remote: np.ndarray) -> Any:
        """Post one READ: ``remote[i]`` → ``local[i]`` (``[N, 3]`` int64: address, bytes,
        device id). Returns the transfer handle (``state`` / ``release``).

        Raises :class:`ImportTransferError` for every failure, whatever NIXL raised
        (``nixlNotFoundError`` for descriptors outside the peer's registration, ...); what
        was prepared is released first, so a failed read leaves nothing behind."""
        if local.shape != remote.shape or local.ndim != 2 or local.shape[1] != 3:
            raise ImportTransferError(f"descriptor arrays {local.shape} and {remote.shape} differ")
        if not np.array_equal(local[:, 1], remote[:, 1]):
            raise ImportTransferError("local and remote page lengths differ")
        n = local.shape[0]
        prepared: list[Any] = []
        handle = None
        try:
            prepared.append(self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, local_mem))
            prepared.append(self._agent.prep_xfer_dlist(agent.agent_name, remote, agent.mem_type))
            index = np.arange(n, dtype=np.int64)
            handle = self._agent.make_prepped_xfer("READ", prepared[0], index, prepared[1], index)
            state = self._agent.transfer(handle)
        except Exception as exc:  # nixl raises its own types (and others): any of them
            if handle is not None:  # made, not posted
                self._release_handle(handle)
            self._release_dlists(prepared)
            raise ImportTransferError(f"NIXL read from {agent.agent_name} failed to start: "
                                      f"{type(exc).__name__}: {exc}") from exc
        self._dlists[id(handle)] = tuple(prepared)
        if state == "ERR":
            self.release(handle)
            raise ImportTransferError(f"NIXL read from {agent.agent_name} failed to start")
        return handle

    def state(self, handle: Any) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"`` (a lost peer raises inside NIXL: ``ERR``)."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:  # nixlRemoteDisconnectError and friends
            logger.warning("NIXL transfer state: %s: %s", type(exc).__name__, exc)
            return "ERR"
        return state if state in ("DONE", "PROC") else "ERR"

    def release(self, handle: Any, *, abort: bool = False) -> bool:
        """Release a transfer. One that is over (``state`` is not ``PROC``) is always
        released: if NIXL raises, it is dropped all the same (it writes nothing more).
        With ``abort`` the transfer may still be in flight and NIXL is asked to abort it:
        False when it refused (the transfer may still write its destination, so the
        caller keeps waiting and asks again later)."""
        if not self._release_handle(handle) and abort:
            return False
        self._release_dlists(self._dlists.pop(id(handle), ()))
        return True

    @property
    def num_open_transfers(self) -> int:
        """Transfers posted and not yet released (0 when nothing is in flight or leaked)."""
        return len(self._dlists)

    def _release_handle(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.warning("NIXL could not release a transfer: %s: %s", type(exc).__name__, exc)
            return False
        return True

    def _release_dlists(self, dlists) -> None:
        for dlist in dlists:
            try:
                self._agent.release_dlist_handle(dlist)
            except Exception as exc:  # nothing to recover: NIXL keeps or frees it
                logger.warning("NIXL could not release a descriptor list: %s: %s",
                               type(exc).__name__, exc)

    def forget(self, agent: RemoteAgent) -> None:
        """Drop a prefill agent (after a failure: the next import asks again)."""
        try:
            self._agent.remove_remote_agent(agent.agent_name)
        except Exception as exc:
            logger.debug("NIXL remove_remote_agent(%s): %s", agent.agent_name, exc)

    def notify(self, agent: RemoteAgent, message: bytes) -> None:
        """Send ``message`` to a prefill worker (errors are logged: the prefill's lease
        frees the blocks eventually)."""
        try:
            self._agent.send_notif(agent.agent_name, notif_msg=message)
        except Exception as exc:
            logger.warning("NIXL notification to %s failed: %s", agent.agent_name, exc)

    def close(self) -> None:
        for descs in self._registered:
            try:
                self._agent.deregister_memory(descs)
            except Exception as exc:  # shutting down: nothing to recover
                logger.debug("NIXL deregister: %s", exc)
        self._registered = []
        self._ranges = set()
