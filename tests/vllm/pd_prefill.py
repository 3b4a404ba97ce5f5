"""A stand-in for a prefill worker (stock vLLM + NixlConnector, ``kv_producer``), in its own
process, over real NIXL (UCX on CPU memory, 127.0.0.1).

What it shares with the real one is everything the decode side sees: a NIXL agent with one
registered region per layer (vLLM's layer-outermost registration), the handshake served on
a ZMQ side channel (``(GET_META_MSG, pp_rank, tp_rank)`` → ``[payload, clock]``), a payload
built by the parent with vLLM's own ``NixlAgentMetadata`` / ``NixlHandshakePayload`` /
``compute_nixl_compatibility_hash``, and the notifications it receives
(``"<request>:<readers>"``). The child does not import vLLM (about 30 s on the test
machine); ``test_pd_worker.test_vllm_listener_serves_what_we_decode`` runs vLLM's own
listener against our client instead.

Page contents are ``synthetic.kv_rows`` of the imported request, so the decode side can
check every byte it read.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
from dataclasses import dataclass

GET_META_MSG = b"get_meta_msg"


def page_bytes_of(serial: int, page: int, block_size: int, layer_id: int, row_bytes: int):
    """The bytes of one layer's page of the imported request (what the prefill computed)."""
    import torch

    from vllm_hisparse.worker.synthetic import kv_rows

    positions = torch.arange(page * block_size, (page + 1) * block_size)
    return kv_rows(serial, positions, layer_id, row_bytes).reshape(-1)


def _child(conn, spec: dict) -> None:
    import threading

    import msgspec
    import torch
    import zmq
    from nixl._api import nixl_agent, nixl_agent_config

    bs = spec["block_size"]
    agent = nixl_agent(spec["agent_name"], nixl_agent_config(backends=["UCX"]))
    caches = []
    for name, row_bytes, layer_id in spec["layers"]:
        cache = torch.zeros((spec["num_blocks"], bs * row_bytes), dtype=torch.uint8)
        for page, block in enumerate(spec["blocks"]):
            cache[block] = page_bytes_of(spec["serial"], page, bs, layer_id, row_bytes)
        agent.register_memory(agent.get_reg_descs([(cache.data_ptr(), cache.nbytes, 0, "")], "DRAM"))
        caches.append(cache)
    conn.send((agent.get_agent_metadata(), [c.data_ptr() for c in caches]))
    payload = conn.recv()

    stop = threading.Event()
    bound = threading.Event()

    def listen() -> None:  # the protocol of vLLM's _nixl_handshake_listener
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://127.0.0.1:{spec['port']}")
        sock.setsockopt(zmq.RCVTIMEO, 100)
        bound.set()
        while not stop.is_set():
            try:
                identity, _, msg = sock.recv_multipart()
            except zmq.Again:
                continue
            query, _pp, _tp = msgspec.msgpack.decode(msg)
            assert query == GET_META_MSG
            sock.send_multipart((identity, b"", payload, msgspec.msgpack.encode(time.perf_counter())))
        ctx.destroy(linger=0)

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    bound.wait()
    conn.send("ready")
    notifs: list[str] = []
    while True:
        for messages in agent.get_new_notifs().values():
            notifs.extend(m.decode() for m in messages)
        if conn.poll(0.002):
            command = conn.recv()
            if command == "notifs":
                conn.send(notifs)
                notifs = []
            elif command == "stop":
                break
    stop.set()
    thread.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakePrefill:
    """Parent-side handle of one prefill process."""

    process: mp.Process
    conn: object
    port: int
    engine_id: str

    @classmethod
    def start(cls, *, layers: list[tuple[str, int, int]], blocks: list[int], num_blocks: int,
              serial: int, block_size: int, vllm_config, backend_name: str = "FLASHMLA_SPARSE",
              engine_id: str = "prefill-engine-0", compat_hash: str | None = None,
              advertised_num_blocks: int | None = None) -> "FakePrefill":
        """``layers``: ``(name, row bytes, synthetic layer id)``; page ``p`` of the request
        sits in block ``blocks[p]`` of every layer. ``advertised_num_blocks``: what the
        handshake claims each region holds (a buggy prefill: more than it registers)."""
        import msgspec

        from vllm_hisparse.vllm import compat

        port = free_port()
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        spec = dict(layers=layers, blocks=blocks, num_blocks=num_blocks, serial=serial,
                    block_size=block_size, port=port, agent_name=f"{engine_id}-rank0")
        process = ctx.Process(target=_child, args=(child, spec), daemon=True)
        process.start()
        agent_metadata, bases = parent.recv()
        _, payload_type, meta_type, compute_hash = compat.nixl_handshake_types()
        page_lens = [block_size * row_bytes for _, row_bytes, _ in layers]
        advertised = num_blocks if advertised_num_blocks is None else advertised_num_blocks
        meta = meta_type(
            engine_id=engine_id, agent_metadata=agent_metadata, kv_caches_base_addr=bases,
            device_id=0, num_blocks=advertised, block_lens=page_lens, block_strides=page_lens,
            kv_cache_layout="LBHNC", block_size=block_size, ssm_sizes=(0, 0),
            attn_backend_name=backend_name, physical_blocks_per_logical_kv_block=1,
            region_num_blocks=[advertised] * len(layers), region_group_ids=[0] * len(layers),
            region_names=[name for name, _, _ in layers], region_mem_types=["DRAM"] * len(layers))
        if compat_hash is None:
            compat_hash = compute_hash(vllm_config, backend_name, transfer_mode="pull")
        payload = payload_type(compatibility_hash=compat_hash,
                               agent_metadata_bytes=msgspec.msgpack.encode(meta))
        parent.send(msgspec.msgpack.encode(payload))
        assert parent.recv() == "ready"
        return cls(process, parent, port, engine_id)

    def notifications(self, expect: int = 0, timeout_s: float = 10.0) -> list[str]:
        """Notifications received since the last call; waits up to ``timeout_s`` for at
        least ``expect`` of them (they arrive asynchronously)."""
        got: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            self.conn.send("notifs")
            got += self.conn.recv()
            if len(got) >= expect or time.monotonic() > deadline:
                return got
            time.sleep(0.01)

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def stop(self) -> None:
        if self.process.is_alive():
            self.conn.send("stop")
            self.process.join(20)
        if self.process.is_alive():
            self.kill()
