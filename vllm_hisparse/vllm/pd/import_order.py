"""The wire types of P/D imports (scheduler role → worker role).

A decode instance receives a prefill's KV with vLLM's NixlConnector protocol, read by this
connector's workers (``pd/reads.py``). The scheduler role (``pd/landings.py``) decides where
each request lands and sends the workers one :class:`ImportOrder` per request, and the
prefill leases to renew (:class:`Heartbeat`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RemotePrefill:
    """Where the prefill instance holds a request's KV (from its ``kv_transfer_params``).

    ``block_ids[g]`` are the prefill's blocks of its ``g``-th transfer group, page order;
    ``tp_size`` its tensor-parallel size (MLA KV is replicated over its ranks);
    ``generation`` changes when the prefill registers its KV cache again (a reader must
    then ask for its registration again); ``num_tokens`` the tokens the prefill computed
    (``remote_num_tokens``; 0 when it does not say). Built from a request's
    ``kv_transfer_params`` by :func:`~vllm_hisparse.vllm.pd.transfer_params.parse_remote_prefill`,
    which checks every field.
    """

    engine_id: str
    request_id: str
    host: str
    port: int
    tp_size: int
    block_ids: tuple[tuple[int, ...], ...]
    generation: int = 0
    num_tokens: int = 0

    @property
    def engine_key(self) -> tuple:
        """One prefill engine's side channel and registration."""
        return (self.engine_id, self.host, self.port, self.tp_size, self.generation)


class ImportAction(enum.Enum):
    READ = "read"  # read the pages, tell the prefill, report the request
    CANCEL = "cancel"  # admitted but dropped: tell the prefill, report the request failed
    RELEASE = "release"  # never admitted (aborted while waiting): tell the prefill only
    REFUSE = "refuse"  # invalid kv_transfer_params: contact nobody, report the request failed


@dataclass
class ImportOrder:
    """One request's import, for every worker.

    Attributes:
        request_id: the decode instance's request id (reported in ``finished_recving``).
        remote: the prefill's KV (None for a ``REFUSE`` order: nothing of the request's
            ``kv_transfer_params`` is used).
        num_tokens: positions imported (the request's computed tokens once loaded); page
            ``p`` covers positions ``[p * block_size, (p + 1) * block_size)``.
        num_pages: pages imported, ``cdiv(num_tokens, block_size)``.
        host_blocks: a host landing's host block of every page (read into the host pool);
            empty for a resident landing.
        device_blocks: the last ``len(device_blocks)`` pages' block in every sparse-MLA
            KV cache group (sparse group order), read to the device: every page of a
            resident landing, the tail of a host landing.
        indexer_blocks: ``indexer_blocks[g][p]`` is page ``p``'s block in the ``g``-th
            indexer KV cache group (every page is read to the device).
        action: see :class:`ImportAction`.
    """

    request_id: str
    remote: RemotePrefill | None
    num_tokens: int
    num_pages: int
    host_blocks: list[int] = field(default_factory=list)
    device_blocks: list[list[int]] = field(default_factory=list)
    indexer_blocks: list[list[int]] = field(default_factory=list)
    action: ImportAction = ImportAction.READ

    @property
    def reported(self) -> bool:
        """vLLM waits for this request in ``finished_recving``."""
        return self.action is not ImportAction.RELEASE


@dataclass(frozen=True)
class Heartbeat:
    """Prefill requests whose blocks the prefill must keep: vLLM's NixlConnector lease
    renewal (``"HB:<ids>"``), sent while they wait here or are being read."""

    remote: RemotePrefill  # any request of the engine: its side channel and size
    request_ids: tuple[str, ...]
