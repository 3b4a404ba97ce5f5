"""A P/D decode instance on vLLM's real Scheduler: configs, remote-prefill params, and a
fake of the two workers' load reports (NixlConnector's and ours).

Faked: the remote prefill engine and the GPUs. Real: vLLM's ``Scheduler``,
``MultiConnector``, NixlConnector's scheduler side and our scheduler role.

``PDFakeWorker`` extends the ack fake (``fake_worker.FakeWorker``): it reads each step's
metadata, and ``load_delay_steps`` steps later reports every import it saw in
``finished_recving`` (``HiSparseConnectorMetadata.imports``; a ``RELEASE`` is not reported,
a ``CANCEL`` or ``REFUSE`` is reported failed); requests in ``fail_loads`` also in ``failed_recving``, as
vLLM's ``KVOutputAggregator`` hands them over. Composed with NixlConnector, it records the
loads NixlConnector's metadata asks for (none are expected).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.config import KVTransferConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from tests.vllm.fake_worker import FakeWorker
from vllm_hisparse.vllm.simulation.model import CONNECTOR
from vllm_hisparse.vllm.pd.import_order import ImportAction

PREFILL_ENGINE = "prefill-engine-0"


def pd_kv_transfer(*, compose: str = "alone", failure_policy: str = "fail",
                   host_pool_gib: float = 1, extra_keys: dict | None = None) -> KVTransferConfig:
    """The decode instance's ``--kv-transfer-config``: our connector ``alone``
    (``kv_consumer``), or in a MultiConnector before (``"first"``) or after (``"after"``)
    NixlConnector; ``extra_keys``: further keys of our extra config."""
    extra = {"host_pool_gib": host_pool_gib, **(extra_keys or {})}
    if compose == "alone":
        return KVTransferConfig(kv_connector=CONNECTOR, kv_role="kv_consumer",
                                kv_load_failure_policy=failure_policy, kv_connector_extra_config=extra)
    ours = {"kv_connector": CONNECTOR, "kv_role": "kv_consumer", "kv_connector_extra_config": extra}
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    children = [ours, nixl] if compose == "first" else [nixl, ours]
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_consumer",
                            kv_load_failure_policy=failure_policy,
                            kv_connector_extra_config={"connectors": children})


def remote_params(num_tokens: int, block_size: int, *, first_block: int = 100,
                  engine_id: str = PREFILL_ENGINE, request_id: str = "p-req",
                  port: int = 5601, tp_size: int = 1) -> dict:
    """``kv_transfer_params`` a stock prefill (NixlConnector, one KV cache group) returns."""
    pages = -(-num_tokens // block_size)
    return dict(do_remote_prefill=True, do_remote_decode=False,
                remote_block_ids=[list(range(first_block, first_block + pages))],
                remote_engine_id=engine_id, remote_request_id=request_id,
                remote_host="127.0.0.1", remote_port=port, tp_size=tp_size, dcp_size=1,
                pp_size=1, remote_num_tokens=num_tokens, transfer_mode="pull")


def add_pd_request(harness, prompt_len: int, max_tokens: int, *, kv_params=None,
                   sampling: dict | None = None, **params):
    """A request the proxy forwards after its prefill: the prefill's ``kv_transfer_params``
    (or ``kv_params`` as given: what a client may send instead)."""
    request_id = f"req-{next(harness._ids)}"
    tokens = [(hash((request_id, i)) % 900) + 10 for i in range(prompt_len)]
    if kv_params is None:
        kv_params = remote_params(prompt_len, harness.block_size, request_id=f"p-{request_id}", **params)
    request = Request(
        request_id=request_id, prompt_token_ids=tokens, pooling_params=None,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or {}),
                                       extra_args={"kv_transfer_params": kv_params}),
        block_hasher=harness._block_hasher)
    harness.requests[request_id] = request
    harness.scheduler.add_request(request)
    return request


@dataclass
class PDFakeWorker(FakeWorker):
    nixl_index: int | None = None
    load_delay_steps: int = 2
    fail_loads: set[str] = field(default_factory=set)
    nixl_loads: dict[str, tuple] = field(default_factory=dict)  # id -> local block ids
    imports: dict[str, object] = field(default_factory=dict)  # id -> ImportOrder
    releases: list[str] = field(default_factory=list)
    heartbeats: list = field(default_factory=list)
    _loads_due: list[tuple[int, str]] = field(default_factory=list)

    def on_forward(self, scheduler_output) -> KVConnectorOutput | None:
        meta = scheduler_output.kv_connector_metadata
        if meta is not None and self.nixl_index is not None:
            for rid, req in meta.metadata[self.nixl_index].reqs_to_recv.items():
                self.nixl_loads[rid] = req.local_block_ids
        ours = self._our_metadata(scheduler_output)
        if ours is not None:
            self.heartbeats.extend(ours.heartbeats)
            for order in ours.imports:
                if order.action is ImportAction.RELEASE:
                    self.releases.append(order.request_id)
                    continue
                self.imports[order.request_id] = order
                if order.action in (ImportAction.CANCEL, ImportAction.REFUSE):  # as the real worker
                    self.fail_loads.add(order.request_id)
                self._loads_due.append((self.step + self.load_delay_steps, order.request_id))
        out = super().on_forward(scheduler_output)
        due = {rid for step, rid in self._loads_due if step <= self.step}
        self._loads_due = [(s, r) for s, r in self._loads_due if r not in due]
        if not due:
            return out
        out = out or KVConnectorOutput()
        out.finished_recving = set(out.finished_recving or ()) | due
        out.failed_recving = set(out.failed_recving or ()) | (due & self.fail_loads)
        return out

    def has_pending(self) -> bool:
        return super().has_pending() or bool(self._loads_due)
