"""The prefill workers one decode worker knows: side-channel handshakes and the NIXL agents
they load (P/D imports, ``pd/reads.py``).

A prefill rank's registration is asked for on its side channel (``query_prefill``, on a
background thread: it blocks up to the handshake timeout) and loaded into the NIXL agent
(``NixlTransport.add_prefill``). Loaded agents are cached per prefill engine and rank
(engine id, side channel, tensor-parallel size, rank) with the registration generation
they were asked for: a request naming a newer generation asks again and replaces the
entry, an older one uses it. So the table cannot grow with what requests name: only prefill
engines that answer the handshake as the engine the request names get an entry, and a
query whose answer no import waits for is settled at the end of the pass (loaded, or its
error dropped). A failed query fails every import waiting for it in that pass, instead of
each asking again (a timeout each).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME
from vllm_hisparse.vllm.pd.import_order import RemotePrefill
from vllm_hisparse.vllm.pd.nixl_transport import (
    HANDSHAKE_TIMEOUT_S,
    NixlTransport,
    RemoteAgent,
    query_prefill,
)

logger = logging.getLogger("vllm_hisparse.vllm")


def agent_key(remote: RemotePrefill, prefill_rank: int) -> tuple:
    """One prefill engine's rank, whatever registration generation a request names."""
    return (remote.engine_id, remote.host, remote.port, remote.tp_size, prefill_rank)


class PrefillAgents:
    """Handshakes and loaded prefill agents of one decode worker (module docstring).

    Every NIXL call stays on the caller's (engine) thread; only ``query_prefill`` runs on
    the background thread."""

    def __init__(self, transport: NixlTransport, timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hisparse-pd-handshake")
        self.agents: dict[tuple, tuple[int, RemoteAgent]] = {}  # key -> (generation, agent)
        self.handshakes: dict[tuple, tuple[int, Future]] = {}  # queries in flight
        self._failed: dict[tuple, Exception] = {}  # failed in this pass

    def get(self, remote: RemotePrefill, prefill_rank: int) -> RemoteAgent | None:
        """The prefill rank's agent: loaded (for this registration generation or a newer
        one), else its side channel is queried (None until it answers). Raises when the
        query or the registration failed."""
        key = agent_key(remote, prefill_rank)
        cached = self.agents.get(key)
        if cached is not None and cached[0] >= remote.generation:
            return cached[1]
        failure = self._failed.get(key)
        if failure is not None:
            raise failure
        pending = self.handshakes.get(key)
        if pending is None:
            future = self._pool.submit(query_prefill, remote.host, remote.port, prefill_rank,
                                       timeout_s=self.timeout_s)
            self.handshakes[key] = (remote.generation, future)
            return None
        generation, future = pending
        if not future.done():
            return None
        del self.handshakes[key]
        try:
            agent = self._load(key, future)
        except Exception as exc:
            self._failed[key] = exc
            raise
        self.agents[key] = (generation, agent)
        return agent

    def _load(self, key: tuple, future: Future) -> RemoteAgent:
        return self.transport.add_prefill(future.result(), expected_engine_id=key[0],
                                          tp_rank=key[-1])

    def end_pass(self, waiting: Iterable[tuple]) -> None:
        """After a pass over the imports: answers no import (``waiting``: their keys) waits
        for are loaded into the cache or dropped; this pass's failures are forgotten."""
        waiting = set(waiting)
        for key, (generation, future) in list(self.handshakes.items()):
            if key in waiting or not future.done():
                continue
            del self.handshakes[key]
            try:
                self.agents[key] = (generation, self._load(key, future))
            except Exception as exc:
                logger.debug("%s: handshake with %s dropped: %s", CONNECTOR_NAME, key[:3], exc)
        self._failed.clear()

    def drop(self, remote: RemotePrefill, prefill_rank: int, agent: RemoteAgent,
             in_use: Callable[[str], bool]) -> None:
        """After a failed transfer the registration may be stale: the next import asks
        again. The NIXL agent itself is removed only once nothing reads from it
        (``in_use(agent name)``: other imports in flight), else their reads would fail."""
        key = agent_key(remote, prefill_rank)
        cached = self.agents.get(key)
        if cached is not None and cached[1] is agent:
            del self.agents[key]
        if not in_use(agent.agent_name) and not any(
                a.agent_name == agent.agent_name for _, a in self.agents.values()):
            self.transport.forget(agent)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
