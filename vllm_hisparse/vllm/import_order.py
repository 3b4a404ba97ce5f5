"""The wire types of a P/D import into the host tier (scheduler role → worker role).

A decode instance receives a prefill's KV with vLLM's NixlConnector protocol. When the
request lands in the host tier (``kv_import``), the worker role reads it itself: the
sparse-MLA rows into the host pool (staged through a bounded device buffer), the indexer
pages and the tail pages into the device blocks vLLM allocated (``worker_import``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

#: Fields of a prefill's ``kv_transfer_params`` (vLLM's NixlConnector, pull mode) that a
#: host landing needs.
REQUIRED_PARAMS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                   "remote_port", "tp_size")


@dataclass(frozen=True)
class RemotePrefill:
    """Where the prefill instance holds a request's KV (from its ``kv_transfer_params``).

    ``block_ids[g]`` are the prefill's blocks of its ``g``-th transfer group, page order;
    ``tp_size`` its tensor-parallel size (MLA KV is replicated over its ranks);
    ``generation`` changes when the prefill registers its KV cache again (a reader must
    then ask for its registration again).
    """

    engine_id: str
    request_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[tuple[int, ...], ...]
    generation: int = 0

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> "RemotePrefill | None":
        """The remote prefill of a P/D decode request; None when ``params`` describes none
        (not ``do_remote_prefill``, a field missing, pipeline or decode-context parallel
        prefill, which a host landing does not read)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        if any(params.get(k) is None for k in REQUIRED_PARAMS):
            return None
        if int(params.get("pp_size", 1) or 1) != 1 or int(params.get("dcp_size", 1) or 1) != 1:
            return None
        blocks = params["remote_block_ids"]
        if not blocks:
            return None
        if isinstance(blocks[0], int):  # a single group, flat list (non-HMA producers)
            blocks = [blocks]
        return cls(engine_id=str(params["remote_engine_id"]),
                   request_id=str(params["remote_request_id"]),
                   host=str(params["remote_host"]), port=int(params["remote_port"]),
                   tp_size=int(params["tp_size"]),
                   block_ids=tuple(tuple(int(b) for b in group) for group in blocks),
                   generation=int(params.get("remote_registration_generation", 0) or 0))


@dataclass
class ImportOrder:
    """One request's host landing, for every worker.

    Attributes:
        request_id: the decode instance's request id (reported in ``finished_recving``).
        remote: the prefill's KV.
        num_tokens: positions read (the request's computed tokens once loaded); page ``p``
            covers positions ``[p * block_size, (p + 1) * block_size)``.
        host_blocks: host block of each page ``0 .. cdiv(num_tokens, block_size) - 1``.
        tail_blocks: for the last ``len(tail_blocks)`` pages, their block in every
            sparse-MLA KV cache group (sparse group order): read there too.
        indexer_blocks: ``indexer_blocks[g][p]`` is page ``p``'s block in the ``g``-th
            indexer KV cache group (every page is read to the device).
        cancel: the scheduler dropped the import before it started: read nothing, tell
            the prefill it may free its blocks, report the request failed.
    """

    request_id: str
    remote: RemotePrefill
    num_tokens: int
    host_blocks: list[int]
    tail_blocks: list[list[int]]
    indexer_blocks: list[list[int]]
    cancel: bool = False

    @property
    def num_pages(self) -> int:
        return len(self.host_blocks)
