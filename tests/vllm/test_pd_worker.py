"""P/D host landing, worker side, over real NIXL: a prefill process (``pd_prefill``: UCX on
CPU memory, 127.0.0.1) and this process's worker role (vLLM-allocated CPU KV tensors, the
real host pool, the reference ops).

The worker role reads a request's pages with NIXL: sparse-MLA rows through its staging
buffer into the host pool, indexer and tail pages into vLLM's device blocks. Every byte is
checked, then the request decodes from the host tier and every row attention reads is
checked against ground truth (``test_worker_side.Rig``). Failures (unreachable prefill,
foreign engine, deadline, a prefill lost in the middle of the staging) end with the request
in ``failed_recving``, nothing in flight and every pool whole.

Skipped when ``nixl`` is not importable.
"""

from __future__ import annotations

import time

import pytest

from tests.vllm.pd_engine import check_imported_bytes
from tests.vllm.pd_fakes import pd_kv_transfer
from tests.vllm.pd_prefill import FakePrefill
from tests.vllm.test_worker_side import BS, Rig, model_dir, shift_blocks  # noqa: F401 (fixture)
from vllm_hisparse.vllm.simulation.model import INDEXER_ROW_BYTES, MLA_ROW_BYTES
from vllm_hisparse.core import Outcome, Residency
from vllm_hisparse.vllm.pd import reads as worker_import
from vllm_hisparse.vllm.pd.import_order import Heartbeat, ImportOrder, RemotePrefill
from vllm_hisparse.vllm.metadata import HiSparseConnectorMetadata
from vllm_hisparse.vllm.pd.nixl_transport import nixl_missing

pytestmark = pytest.mark.skipif(nixl_missing() is not None, reason=str(nixl_missing()))

NUM_TOKENS = 600  # 10 pages, the last one partial
P_BLOCKS = [30 + 2 * p for p in range(10)]  # where the prefill holds them (scattered)


class PDRig(Rig):
    """The worker-side Rig with the decode instance's MultiConnector config."""

    def __init__(self, model_dir, **kwargs):
        import tests.vllm.test_worker_side as tws

        real = tws.kv_transfer_config
        tws.kv_transfer_config = lambda extra: pd_kv_transfer(
            host_pool_gib=extra["host_pool_gib"],
            extra_keys={k: v for k, v in extra.items() if k != "host_pool_gib"})
        try:
            super().__init__(model_dir, **kwargs)
        finally:
            tws.kv_transfer_config = real

    def layers(self):
        """``(name, row bytes, synthetic layer id)`` of every layer the prefill holds."""
        out = [(name, MLA_ROW_BYTES, int(name.split(".")[2]))
               for lane in self.role.lanes for name in lane.layer_names]
        for g in self.role.indexer_group_ids:
            for name in self.kv_cache_config.kv_cache_groups[g].layer_names:
                out.append((name, INDEXER_ROW_BYTES, 500 + int(name.split(".")[2])))
        return out

    def begin(self, rid: str, prefill: FakePrefill, num_tokens: int = NUM_TOKENS,
              block_ids=None) -> ImportOrder:
        """What the scheduler role does for a host landing: tail blocks, begin_import, the order."""
        self.add(rid)
        pages = -(-num_tokens // BS)
        tail = self.policy.device_pool.get_new_blocks(min(2, pages))
        host = self.policy.begin_import(rid, num_tokens, tail_device_blocks=tail)
        first_free = self.M * self.num_groups + 1  # blocks no page bundle uses
        return ImportOrder(
            request_id=rid, remote=self.remote(prefill, rid, block_ids), num_tokens=num_tokens,
            num_pages=pages, host_blocks=host,
            device_blocks=[self.bundles[self.lead(b)] for b in tail],
            indexer_blocks=[[first_free + 3 * p for p in range(pages)]
                            for _ in self.role.indexer_group_ids])

    def remote(self, prefill: FakePrefill, rid: str, block_ids=None) -> RemotePrefill:
        return RemotePrefill(prefill.engine_id, f"p-{rid}", "127.0.0.1", prefill.port, 1,
                             (tuple(block_ids or P_BLOCKS),))

    def run_import(self, order: ImportOrder, timeout_s: float = 60.0):
        """Hand the order to the worker with a step; poll its transfer results."""
        cmd = shift_blocks(self.policy.build_step(), self.lead)
        self.role.start_load_kv(HiSparseConnectorMetadata(command=cmd, bundles=self.bundles,
                                                          imports=[order]))
        self.role.wait_for_save()
        return self.run_import_results(order.request_id, timeout_s)

    def run_import_results(self, rid: str, timeout_s: float = 60.0) -> bool:
        """Poll the transfer results until ``rid`` is reported; True if it succeeded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            results = self.role.get_transfer_results()
            if rid in results.finished_recving:
                return rid not in results.failed_recving
            time.sleep(0.002)
        raise AssertionError(f"import of {rid!r} not reported in {timeout_s} s")


@pytest.fixture(scope="module")
def rig(model_dir):  # noqa: F811
    rig = PDRig(model_dir, num_blocks=200, policy_blocks=40, seed=3)
    yield rig
    rig.role.shutdown()


@pytest.fixture(scope="module")
def prefill(rig):
    serial = len(rig.serial) + 1  # the first request the rig adds
    prefill = FakePrefill.start(layers=rig.layers(), blocks=P_BLOCKS, num_blocks=64, serial=serial,
                                block_size=BS, vllm_config=rig.vllm_config)
    yield prefill
    prefill.stop()


def _check_bytes(rig: PDRig, order: ImportOrder) -> int:
    """Every imported byte: host rows of every sparse layer, tail and indexer pages."""
    return check_imported_bytes(rig.role, rig.kv, rig.kv_cache_config, order,
                                rig.serial[order.request_id])


def test_host_landing_reads_every_byte_then_decodes_from_the_host_tier(rig, prefill):
    order = rig.begin("imp", prefill, num_tokens=NUM_TOKENS - 1)  # vLLM recomputes the last
    assert rig.run_import(order)
    assert _check_bytes(rig, order) > 0
    assert prefill.notifications(expect=1) == ["p-imp:1"]  # the prefill may free its blocks
    assert rig.role.pd_reads.importer.num_pages_staged == len(order.host_blocks)
    assert rig.policy.finish_import("imp", success=True) == Outcome.OK
    assert rig.policy.residency("imp") == Residency.NONE
    rig.step({"imp": 1})  # the recomputed last prompt token
    for _ in range(6):
        rig.step({"imp": 1})
    assert rig.reads_checked > 6 * 64
    rig.policy.finish("imp")
    rig.drain()
    assert rig.policy.is_idle() and (rig.policy.host_pool.ref_counts == 0).all()
    assert sorted(rig.role.pd_reads.importer._free_slots) == list(range(worker_import.IMPORT_STAGING_PAGES))


def test_host_landing_into_a_layer_major_pool_reads_every_byte(model_dir):  # noqa: F811
    """The P/D import lands in either host layout (the module's rig is position-major: the
    test model has IndexShare units)."""
    rig = PDRig(model_dir, num_blocks=200, policy_blocks=40, seed=5,
                extra={"host_layout": "layer"})
    assert rig.role.host_pool.layout == "layer"
    prefill = FakePrefill.start(layers=rig.layers(), blocks=P_BLOCKS, num_blocks=64,
                                serial=len(rig.serial) + 1, block_size=BS,
                                vllm_config=rig.vllm_config)
    try:
        order = rig.begin("imp-l", prefill, num_tokens=NUM_TOKENS - 1)
        assert rig.run_import(order)
        assert _check_bytes(rig, order) > 0
        assert rig.policy.finish_import("imp-l", success=True) == Outcome.OK
        for _ in range(4):
            rig.step({"imp-l": 1})
        assert rig.reads_checked > 0
    finally:
        prefill.stop()
        rig.role.shutdown()


def test_resident_landing_reads_every_page_into_vllms_blocks(rig, prefill):
    """Every page of every layer straight into the device blocks (no staging, no host)."""
    rig.add("res")
    pages = 10
    leads = rig.policy.device_pool.get_new_blocks(pages)  # stand-ins for vLLM's blocks
    first_free = rig.M * rig.num_groups + 1
    order = ImportOrder("res", rig.remote(prefill, "res"), num_tokens=NUM_TOKENS, num_pages=pages,
                        device_blocks=[rig.bundles[rig.lead(b)] for b in leads],
                        indexer_blocks=[[first_free + 3 * p + 1 for p in range(pages)]
                                        for _ in rig.role.indexer_group_ids])
    staged = rig.role.pd_reads.importer.num_pages_staged
    rig.serial["res"] = 1  # the prefill holds request 1's KV
    assert rig.run_import(order)
    _check_bytes(rig, order)
    assert rig.role.pd_reads.importer.num_pages_staged == staged
    assert prefill.notifications(expect=1) == ["p-res:1"]
    rig.policy.device_pool.free_blocks(leads)
    rig.policy.abort("res")


def test_leases_are_renewed_on_every_prefill_rank(rig, prefill):
    remote = rig.remote(prefill, "hb")
    cmd = shift_blocks(rig.policy.build_step(), rig.lead)
    meta = HiSparseConnectorMetadata(command=cmd, bundles=rig.bundles,
                                     heartbeats=[Heartbeat(remote, ("p-a", "p-b"))])
    rig.role.start_load_kv(meta)  # the prefill's registration is loaded already (cached)
    rig.role.wait_for_save()
    assert prefill.notifications(expect=1) == ["HB:p-a,p-b"]


def _fail_and_check_whole(rig: PDRig, order: ImportOrder) -> None:
    assert rig.run_import(order) is False
    _end_failed(rig, order)


def _end_failed(rig: PDRig, order: ImportOrder) -> None:
    """What the scheduler role does after a failed import; then nothing may be left."""
    assert rig.policy.finish_import(order.request_id, success=False) == Outcome.RECOMPUTE
    rig.policy.device_pool.free_blocks([b - 1 for b in (blocks[0] for blocks in order.device_blocks)])
    rig.policy.abort(order.request_id)
    rig.drain()
    _check_whole(rig)


def _end_good(rig: PDRig, order: ImportOrder) -> None:
    """A successful import: every byte, then the request ends; nothing may be left."""
    _check_bytes(rig, order)
    assert rig.policy.finish_import(order.request_id, success=True) == Outcome.OK
    rig.policy.finish(order.request_id)
    rig.drain()
    _check_whole(rig)


def _check_whole(rig: PDRig) -> None:
    """Nothing of any import left: the importer's tables, NIXL transfers, staging slots,
    the policy's host pool and device pool."""
    importer = rig.role.pd_reads.importer
    assert not importer._imports and not importer._spills and not importer.prefills.handshakes
    assert importer.transport.num_open_transfers == 0
    assert sorted(importer._free_slots) == list(range(worker_import.IMPORT_STAGING_PAGES))
    assert rig.policy.is_idle() and (rig.policy.host_pool.ref_counts == 0).all()
    assert rig.policy.device_pool.get_num_free_blocks() == rig.M


def test_unreachable_prefill_fails_the_request(rig, prefill, monkeypatch):
    monkeypatch.setattr(rig.role.pd_reads.importer, "handshake_timeout_s", 0.5)
    order = rig.begin("lost", prefill)
    order.remote = RemotePrefill(prefill.engine_id, "p-lost", "127.0.0.1", prefill.port + 1, 1,
                                 order.remote.block_ids)  # nobody listens there
    _fail_and_check_whole(rig, order)


def test_a_foreign_engine_fails_the_request(rig, prefill):
    order = rig.begin("foreign", prefill)
    order.remote = RemotePrefill("another-engine", "p-foreign", "127.0.0.1", prefill.port, 1,
                                 order.remote.block_ids)
    _fail_and_check_whole(rig, order)
    assert prefill.notifications(timeout_s=0.5) == []  # never read, never told


def test_the_deadline_fails_an_import_whose_reads_are_in_flight(rig, prefill, monkeypatch):
    """The clock jumps past the deadline as soon as the reads are posted: the request is
    reported failed only once no read of it is in flight, and the prefill is told."""
    importer = rig.role.pd_reads.importer
    monkeypatch.setattr(importer, "_clock", lambda: 1e9 if any(
        i.started for i in importer._imports.values()) else 0.0)
    order = rig.begin("late", prefill)
    _fail_and_check_whole(rig, order)
    assert prefill.notifications(expect=1) == ["p-late:1"]


def test_missing_prefill_blocks_fail_before_any_read(rig, prefill):
    order = rig.begin("short", prefill, block_ids=P_BLOCKS[:4])
    _fail_and_check_whole(rig, order)


@pytest.mark.slow
def test_a_prefill_lost_in_the_middle_of_the_staging(model_dir, monkeypatch):  # noqa: F811
    """Partial transfer: one staging page per chunk, the prefill killed after the first
    chunks landed; the request fails, what was staged is dropped with its host blocks."""
    monkeypatch.setattr(worker_import, "IMPORT_STAGING_PAGES", 2)
    rig = PDRig(model_dir, num_blocks=200, policy_blocks=40, seed=4)
    prefill = FakePrefill.start(layers=rig.layers(), blocks=P_BLOCKS, num_blocks=64, serial=1,
                                block_size=BS, vllm_config=rig.vllm_config)
    try:
        order = rig.begin("cut", prefill)
        cmd = shift_blocks(rig.policy.build_step(), rig.lead)
        rig.role.start_load_kv(HiSparseConnectorMetadata(command=cmd, bundles=rig.bundles,
                                                         imports=[order]))
        rig.role.wait_for_save()
        importer = rig.role.pd_reads.importer
        deadline = time.monotonic() + 60
        while importer.num_pages_staged < 2 and time.monotonic() < deadline:
            rig.role.get_transfer_results()
            time.sleep(0.002)
        assert 2 <= importer.num_pages_staged < len(order.host_blocks)
        prefill.kill()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            results = rig.role.get_transfer_results()
            if "cut" in results.finished_recving:
                assert "cut" in results.failed_recving
                break
            time.sleep(0.002)
        else:
            raise AssertionError("the cut import was never reported")
        assert rig.policy.finish_import("cut", success=False) == Outcome.RECOMPUTE
        assert not importer._imports and not importer._spills
        assert sorted(importer._free_slots) == [0, 1]
    finally:
        prefill.stop()
        rig.role.shutdown()


def test_blocks_outside_the_prefills_region_fail_that_request_alone(rig, prefill):
    """kv_transfer_params naming a block past the prefill's registered KV region (64
    blocks). Found tried as an attacker would: NIXL's prep_xfer_dlist raised
    nixlNotFoundError out of start_load_kv, so the worker died and the import stayed in
    the importer's tables. Now refused against the handshake before any read is prepared."""
    order = rig.begin("outside", prefill, block_ids=[*P_BLOCKS[:9], 64 + 1000])
    _fail_and_check_whole(rig, order)
    got = prefill.notifications(expect=1)
    while "p-outside:1" not in got and len(got) < 4:  # an earlier test's may come first
        got += prefill.notifications(expect=1)
    assert "p-outside:1" in got  # told, as after any failure


def test_a_prefill_that_overstates_its_region_fails_that_request_alone(rig):
    """A buggy prefill advertises 1000 blocks but registers 64: the request's block 500
    passes our check and NIXL itself refuses the descriptors (nixlNotFoundError); that
    import fails alone, then a good one reads every byte."""
    liar = FakePrefill.start(layers=rig.layers(), blocks=P_BLOCKS, num_blocks=64, serial=1,
                             block_size=BS, vllm_config=rig.vllm_config, engine_id="prefill-liar",
                             advertised_num_blocks=1000)
    try:
        order = rig.begin("liar", liar, block_ids=[*P_BLOCKS[:9], 500])
        _fail_and_check_whole(rig, order)
        order = rig.begin("good", liar)
        rig.serial["good"] = 1  # the liar holds request 1's KV
        assert rig.run_import(order)
        _end_good(rig, order)
    finally:
        liar.stop()


def _nixl_error(name: str) -> type[Exception]:
    import importlib

    import nixl._api

    bindings = importlib.import_module(nixl._api.__name__.rsplit(".", 1)[0] + "._bindings")
    return getattr(bindings, name)


class _FaultyAgent:
    """The NIXL agent, with ``method`` raising ``error`` from its ``after``-th call on."""

    def __init__(self, agent, method: str, error: Exception, after: int = 0) -> None:
        self._agent, self._method, self._error, self._left = agent, method, error, after
        self.raised = 0

    def __getattr__(self, name):
        real = getattr(self._agent, name)
        if name != self._method:
            return real

        def call(*args, **kwargs):
            if self._left > 0:
                self._left -= 1
                return real(*args, **kwargs)
            self.raised += 1
            raise self._error
        return call


@pytest.mark.parametrize("method, after", [
    ("prep_xfer_dlist", 0), ("prep_xfer_dlist", 1), ("make_prepped_xfer", 0), ("transfer", 0),
    ("transfer", 1), ("check_xfer_state", 0), ("check_xfer_state", 2)])
@pytest.mark.parametrize("error", ["nixlNotFoundError", "nixlRemoteDisconnectError",
                                   "nixlBackendError", "KeyError", "OverflowError"])
def test_any_nixl_error_fails_that_import_alone(rig, prefill, monkeypatch, method, after, error):
    """Prepare, post or check raising (NIXL's own exception types or any other) at the
    first or a later call: the import is drained, reported failed, leaves nothing; the
    next import of the same prefill reads every byte."""
    transport = rig.role.pd_reads.importer.transport
    cls = _nixl_error(error) if error.startswith("nixl") else {"KeyError": KeyError,
                                                                "OverflowError": OverflowError}[error]
    faulty = _FaultyAgent(transport._agent, method, cls("injected"), after)
    monkeypatch.setattr(transport, "_agent", faulty)
    order = rig.begin("fault", prefill)
    ok = rig.run_import(order)
    # A later state check may not come (the reads were over): then the import succeeds.
    assert faulty.raised or (method == "check_xfer_state" and after)
    assert ok is not bool(faulty.raised)
    rig.serial["fault"] = 1  # the prefill holds request 1's KV
    _end_good(rig, order) if ok else _end_failed(rig, order)
    monkeypatch.setattr(transport, "_agent", faulty._agent)
    order = rig.begin("after-fault", prefill)
    rig.serial["after-fault"] = 1
    assert rig.run_import(order)
    _end_good(rig, order)
    prefill.notifications(timeout_s=0.2)  # the prefill was told after each: drop them


def test_a_release_nixl_refuses_leaves_nothing(rig, prefill, monkeypatch):
    """Releasing a finished read raises: the read is over, so it is dropped all the same;
    the import succeeds with every byte and no NIXL transfer is left open."""
    transport = rig.role.pd_reads.importer.transport
    faulty = _FaultyAgent(transport._agent, "release_xfer_handle", _nixl_error("nixlBackendError")("x"))
    monkeypatch.setattr(transport, "_agent", faulty)
    order = rig.begin("unreleased", prefill)
    rig.serial["unreleased"] = 1
    assert rig.run_import(order)
    assert faulty.raised and transport.num_open_transfers == 0
    _end_good(rig, order)
    prefill.notifications(timeout_s=0.2)


class _HoldingAgent:
    """The NIXL agent; the transfers made while ``hold`` names a request report ``PROC``
    (still in flight) until it is cleared, those made for ``fail`` report ``ERR``."""

    def __init__(self, agent, importer) -> None:
        self._agent, self._importer = agent, importer
        self.hold: str | None = None
        self.fail: str | None = None
        self._owner: dict[int, str] = {}

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def make_prepped_xfer(self, *args, **kwargs):
        handle = self._agent.make_prepped_xfer(*args, **kwargs)
        busy = [rid for rid, imp in self._importer._imports.items() if imp.started]
        self._owner[id(handle)] = busy[-1] if busy else ""
        return handle

    def check_xfer_state(self, handle):
        owner = self._owner.get(id(handle))
        if owner == self.hold:
            return "PROC"
        if owner == self.fail:
            return "ERR"
        return self._agent.check_xfer_state(handle)


def test_a_failed_import_leaves_the_agent_others_read_from(rig, prefill, monkeypatch):
    """One import's read fails (its agent may be stale, so its registration is asked for
    again) while another import of the same prefill is in flight: the NIXL agent stays
    loaded until no import reads from it; the other one is exact. (Found by test_pd_fuzz:
    the agent was removed under the other's reads, which then failed.)"""
    importer = rig.role.pd_reads.importer
    transport = importer.transport
    holding = _HoldingAgent(transport._agent, importer)
    monkeypatch.setattr(transport, "_agent", holding)
    forgotten = []
    real_forget = transport.forget
    monkeypatch.setattr(transport, "forget", lambda agent: (forgotten.append(
        {rid for rid, imp in importer._imports.items() if agent in imp.agents.values()}),
        real_forget(agent)))
    good, bad = rig.begin("held", prefill), rig.begin("broken", prefill)
    rig.serial["held"] = 1
    holding.hold, holding.fail = "held", "broken"
    cmd = shift_blocks(rig.policy.build_step(), rig.lead)
    rig.role.start_load_kv(HiSparseConnectorMetadata(command=cmd, bundles=rig.bundles, imports=[good]))
    rig.role.wait_for_save()
    deadline = time.monotonic() + 30
    while not importer._imports["held"].started and time.monotonic() < deadline:
        rig.role.get_transfer_results()  # the handshake, when no earlier test loaded it
        time.sleep(0.002)
    assert importer._imports["held"].device_read is not None
    cmd = shift_blocks(rig.policy.build_step(), rig.lead)
    rig.role.start_load_kv(HiSparseConnectorMetadata(command=cmd, bundles=rig.bundles, imports=[bad]))
    rig.role.wait_for_save()
    deadline = time.monotonic() + 30
    while "broken" in importer._imports and time.monotonic() < deadline:
        rig.role.get_transfer_results()
        time.sleep(0.002)
    assert "held" in importer._imports and forgotten == []  # its agent is still loaded
    holding.hold = None
    assert rig.run_import_results("held")
    _check_bytes(rig, good)
    assert rig.policy.finish_import("broken", success=False) == Outcome.RECOMPUTE
    rig.policy.device_pool.free_blocks([blocks[0] - 1 for blocks in bad.device_blocks])
    rig.policy.abort("broken")
    _end_good(rig, good)
    prefill.notifications(timeout_s=0.2)
