"""A P/D decode instance end to end on CPU: vLLM's real Scheduler with our scheduler role,
our real worker role, real NIXL to prefill processes (``pd_prefill``: UCX, 127.0.0.1).

Real: vLLM's config, KV planning, ``Scheduler``, ``KVCacheManager`` and ``BlockPool``, its
``allocate_kv_cache`` (CPU tensors), ``HiSparseResidencyConnector`` in both roles (the
worker role built by the façade and called as vLLM's model runner calls a connector: bind
the metadata, ``start_load_kv`` with the step's inputs, ``wait_for_save``,
``get_transfer_results``, the worker metadata), NIXL, the staging copies (reference ops).
Faked: the model forward (``SchedulerHarness``: one sampled token, no KV written) and the
prefill GPU (a process holding ``synthetic.kv_rows`` pages).

Every import a worker reports finished and not failed is checked byte for byte at once
(host rows, device pages, indexer pages), before anything can overwrite them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from tests.vllm.pd_fakes import pd_kv_transfer
from tests.vllm.pd_prefill import FakePrefill
from tests.vllm.scheduler_harness import SchedulerHarness, planned_worker_kv_cache_config
from vllm_hisparse.vllm.simulation.model import (
    INDEXER_ROW_BYTES,
    MLA_ROW_BYTES,
    dsa_layer_specs,
    make_vllm_config,
)
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.pd.import_order import ImportOrder
from vllm_hisparse.worker.synthetic import kv_rows

#: The synthetic serial of the KV every prefill process holds (pages in PREFILL_BLOCKS).
PREFILL_SERIAL = 1
PREFILL_REGION_BLOCKS = 64
#: Where a prefill holds page p of every request (scattered in its 64-block region).
PREFILL_BLOCKS = [3 + 3 * p for p in range(20)]


def indexer_layer_id(name: str) -> int:
    return 500 + int(name.split(".")[2])


def check_imported_bytes(role, kv: dict[str, torch.Tensor], kv_cache_config, order: ImportOrder,
                         serial: int) -> int:
    """Every byte an import wrote (host rows of every sparse layer, the sparse pages read
    to the device, every indexer page) is the prefill's; returns the rows checked."""
    bs = role.block_size
    pages = order.num_pages
    if not pages:  # a one-token prompt: vLLM recomputes it, nothing is read
        return 0
    positions = torch.arange(pages * bs)
    written = positions < order.num_tokens
    first_device = pages - len(order.device_blocks)
    checked = 0
    layers = [(lane, name, view) for lane in role.lanes
              for name, view in zip(lane.layer_names, lane.device_layers)]
    for i, (lane, name, view) in enumerate(layers):
        want = kv_rows(serial, positions, int(name.split(".")[2]), MLA_ROW_BYTES)
        if order.host_blocks:
            rows = torch.cat([torch.arange(hb * bs, hb * bs + bs) for hb in order.host_blocks])
            assert torch.equal(role.host_pool.layers[i][rows][written], want[written]), name
            checked += int(written.sum())
        if order.device_blocks:
            starts = [b[lane.sparse_index] * lane.layout.block_stride_rows for b in order.device_blocks]
            rows = torch.cat([torch.arange(start, start + bs) for start in starts])
            tail = written[first_device * bs:]
            assert torch.equal(view[rows][tail], want[first_device * bs:][tail]), (name, "device")
            checked += int(tail.sum())
    for g, group in enumerate(role.indexer_group_ids):
        for name in kv_cache_config.kv_cache_groups[group].layer_names:
            want = kv_rows(serial, positions, indexer_layer_id(name), INDEXER_ROW_BYTES)
            got = kv[name][order.indexer_blocks[g]].reshape(pages * bs, -1).view(torch.uint8)
            assert torch.equal(got[written], want[written]), name
            checked += int(written.sum())
    return checked


@dataclass
class RealWorker:
    """``SchedulerHarness``'s worker: our worker-role connector, called per step as vLLM's
    model runner calls it. Records every import order, outcome and byte check."""

    connector: object
    kv: dict
    kv_cache_config: object
    orders: dict[str, ImportOrder] = field(default_factory=dict)
    imported: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    rows_checked: int = 0
    host_landings: set[str] = field(default_factory=set)  # imported into the host tier
    step: int = 0
    multi_index: int | None = None  # our connector alone (SchedulerHarness asks)

    @property
    def role(self):
        return self.connector.worker_role

    def on_forward(self, scheduler_output) -> KVConnectorOutput | None:
        self.step += 1
        meta = scheduler_output.kv_connector_metadata
        for order in getattr(meta, "imports", ()):
            self.orders[order.request_id] = order
        scheduled = list(scheduler_output.num_scheduled_tokens)
        inputs = dict(request_ids=scheduled, scheduler_output=scheduler_output) if scheduled else {}
        c = self.connector
        c.bind_connector_metadata(meta)
        c.start_load_kv(None, **inputs)
        c.wait_for_save()
        results = c.get_transfer_results(set())
        worker_meta = c.build_connector_worker_meta()
        c.clear_connector_metadata()
        finished, failed = set(results.finished_recving or ()), set(results.failed_recving or ())
        assert failed <= finished
        for rid in finished & set(self.orders):
            if rid in failed:
                self.failed.add(rid)
                continue
            self.imported.add(rid)
            if self.orders[rid].host_blocks:
                self.host_landings.add(rid)
            self.rows_checked += check_imported_bytes(
                self.role, self.kv, self.kv_cache_config, self.orders[rid], PREFILL_SERIAL)
        return KVConnectorOutput(finished_recving=finished or None, failed_recving=failed,
                                 kv_connector_worker_meta=worker_meta)

    def has_pending(self) -> bool:
        return False


class PDEngine:
    """The decode instance (module docstring). ``prefill(engine_id)`` starts a prefill
    process holding ``PREFILL_BLOCKS``; ``add(prompt_len, max_tokens, kv_params)`` a request."""

    def __init__(self, model_dir, *, num_blocks: int = 200, max_model_len: int = 1536,
                 host_pool_gib: float = 0.05, failure_policy: str = "fail", num_layers: int = 4,
                 async_scheduling: bool = False) -> None:
        from vllm_hisparse.connector import HiSparseResidencyConnector

        vllm_config = make_vllm_config(
            model_dir, kv_transfer=pd_kv_transfer(failure_policy=failure_policy,
                                                  host_pool_gib=host_pool_gib),
            max_model_len=max_model_len, async_scheduling=async_scheduling)
        specs = dsa_layer_specs(num_layers, block_size=vllm_config.cache_config.block_size)
        full = planned_worker_kv_cache_config(vllm_config, specs, num_blocks)
        self.vllm_config, self.kv_cache_config = vllm_config, full
        self.kv = compat.allocate_kv_cache(full, torch.device("cpu"),
                                           compat.resolved_kv_cache_layout(vllm_config))
        connector = HiSparseResidencyConnector(vllm_config, compat.KVConnectorRole.WORKER, full)
        connector.register_kv_caches(self.kv)
        self.worker = RealWorker(connector, self.kv, full)
        self.harness = SchedulerHarness(vllm_config, generate_scheduler_kv_cache_config([full]),
                                        worker=self.worker)  # what the engine core does
        self.prefills: list[FakePrefill] = []

    @property
    def role(self):
        return self.worker.role

    @property
    def importer(self):
        return self.role.pd_reads.importer

    def layers(self) -> list[tuple[str, int, int]]:
        """``(name, row bytes, synthetic layer id)`` of every layer a prefill holds."""
        out = [(name, MLA_ROW_BYTES, int(name.split(".")[2]))
               for lane in self.role.lanes for name in lane.layer_names]
        for g in self.role.indexer_group_ids:
            out += [(name, INDEXER_ROW_BYTES, indexer_layer_id(name))
                    for name in self.kv_cache_config.kv_cache_groups[g].layer_names]
        return out

    def prefill(self, engine_id: str = "prefill-engine-0") -> FakePrefill:
        prefill = FakePrefill.start(layers=self.layers(), blocks=PREFILL_BLOCKS,
                                    num_blocks=PREFILL_REGION_BLOCKS, serial=PREFILL_SERIAL,
                                    block_size=self.harness.block_size,
                                    vllm_config=self.vllm_config, engine_id=engine_id)
        self.prefills.append(prefill)
        return prefill

    def good_params(self, prefill: FakePrefill, prompt_len: int, request_id: str) -> dict:
        """What a stock prefill returns for a request of ``prompt_len`` tokens."""
        pages = -(-prompt_len // self.harness.block_size)
        return dict(do_remote_prefill=True, do_remote_decode=False,
                    remote_block_ids=[PREFILL_BLOCKS[:pages]], remote_engine_id=prefill.engine_id,
                    remote_request_id=request_id, remote_host="127.0.0.1", remote_port=prefill.port,
                    tp_size=1, dcp_size=1, pp_size=1, remote_num_tokens=prompt_len,
                    transfer_mode="pull")

    def add(self, prompt_len: int, max_tokens: int, kv_params) -> Request:
        harness = self.harness
        request_id = f"req-{next(harness._ids)}"
        tokens = [(hash((request_id, i)) % 900) + 10 for i in range(prompt_len)]
        request = Request(request_id=request_id, prompt_token_ids=tokens, pooling_params=None,
                          sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                         extra_args={"kv_transfer_params": kv_params}),
                          block_hasher=harness._block_hasher)
        harness.requests[request_id] = request
        harness.scheduler.add_request(request)
        return request

    def run(self, timeout_s: float = 120.0) -> None:
        """Step until every request finished (at most ``timeout_s``: a hang fails), then a
        few more steps for the last acks."""
        harness = self.harness
        deadline = time.monotonic() + timeout_s
        while harness.scheduler.has_requests():
            if time.monotonic() > deadline:
                left = {rid: (r.status.name, repr(self.importer._imports.get(rid)))
                        for rid, r in harness.scheduler.requests.items()}
                raise AssertionError(f"not finished after {timeout_s:g} s: {left}")
            harness.step()
        harness.drain()
        for _ in range(3):
            harness.step()
        harness.drain()
        settle = time.monotonic() + 5 * self.importer.handshake_timeout_s + 1
        while self.importer.prefills.handshakes and time.monotonic() < settle:
            time.sleep(0.05)  # a lease renewal's side-channel query still out: answered
            harness.step()    # or timed out, it leaves the table at the next step
        harness.drain()

    def assert_no_leaks(self) -> None:
        """vLLM's pool and requests, our scheduler role's tables and pools, the worker's
        importer (tables, NIXL transfers, staging slots, handshakes, cached agents)."""
        self.harness.assert_no_leaks()
        role = self.harness.residency
        landings = role.landings
        for name in ("_offers", "_claimed", "_importing", "_releases", "_leases",
                     "_restarting", "_refused", "_settled"):
            assert not getattr(landings, name), (name, getattr(landings, name))
        importer = self.importer
        assert importer.num_imports == 0 and not importer._spills
        assert not importer.prefills.handshakes
        assert importer.transport.num_open_transfers == 0
        assert sorted(importer._free_slots) == list(range(len(importer._free_slots)))
        assert len(importer._free_slots) == importer.staging.shape[1] // self.harness.block_size
        assert len(importer.prefills.agents) <= len(self.prefills)

    def close(self) -> None:
        for prefill in self.prefills:
            prefill.stop()
        self.role.shutdown()
        patches.TOPK_CONVERSION_HOOK.remove()
        patches.DIRECT_CONVERSION_ROUTING.remove()
