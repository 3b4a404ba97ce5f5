"""The systems the scheduler benchmarks compare, each on vLLM 0.33's real ``Scheduler`` (CPU).

One workload, one model, one HBM budget for KV (bytes, not blocks: each plan packs its own
block size), five systems:

========== =================================================================================
``stock``  plain vLLM: its default planner (one KV cache group for the sparse-MLA and the
           indexer layers), no connector. What an operator runs without us.
``intree`` vLLM's in-tree Hybrid HiSparse (``HiSparseConnector``: host source group,
           resident and hot groups), scheduler side, with a fake worker acking its
           transfers in the step they were issued.
``plan``   our KV plan (sparse-MLA groups apart from the indexer group) with vLLM's stock
           managers and no connector: what our grouping alone costs.
``noop``   our plan and a connector that does nothing: what vLLM spends because *a*
           connector is configured.
``hisparse`` our connector (scheduler role) with a worker stand-in acking its transfers in
           the step they were issued (``simulation.scheduler_driver.InStepAcks``).
========== =================================================================================

vLLM refuses the in-tree connector on a machine without CUDA (``VllmConfig`` checks the
platform when it infers ``hisparse_config``). Its scheduler side needs no GPU, so the
config is built without a connector and the in-tree switch is set on the built object,
as a CUDA host would have it; the planner then lays out vLLM's own HiSparse groups. The
per-layer resident and hot specs a worker would add (``resolve_hisparse_specs``) are
derived from vLLM's own layout function.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_hisparse.core.capacity import HostMemoryLimit
from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.setup import config as config_module
from vllm_hisparse.vllm.simulation.model import dsa_layer_specs, kv_transfer_config, make_vllm_config
from vllm_hisparse.vllm.simulation.scheduler_driver import SchedulerDriver

SYSTEMS = ("stock", "intree", "plan", "noop", "hisparse")
NOOP_CONNECTOR = "BenchNoopConnector"


class NoopConnector(compat.KVConnectorBase_V1, compat.SupportsHMA):
    """A connector that does nothing: what any configured connector costs vLLM."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return compat.KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass


class InTreeFakeWorker:
    """Acks the in-tree connector's page transfers and host copies in the step that issued
    them (what a worker whose copies finish within the forward reports)."""

    multi_index = None

    def __init__(self) -> None:
        self._meta = compat.intree_hisparse()[2]

    def on_forward(self, scheduler_output):
        meta = scheduler_output.kv_connector_metadata
        if meta is None:
            return None
        ids = [t.transfer_id for t in meta.command.page_transfers] if meta.command else []
        copies = tuple(c.dst_block_id for c in meta.host_block_copies)
        if not ids and not copies:
            return None
        counts = {i: 1 for i in ids}
        return compat.KVConnectorOutput(
            kv_connector_worker_meta=self._meta(dict(counts), dict(counts), copies))


@dataclass(frozen=True)
class Setup:
    """What every system of one comparison shares."""

    model_dir: Path
    num_layers: int
    kv_bytes: int
    """HBM given to KV (every group of the plan together)."""
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    host_pool_gib: float
    block_size: int = 64


def _in_tree_specs(vllm_config, specs: dict) -> dict:
    """The per-layer specs a CUDA worker reports with the in-tree switch on: the model's
    layers plus the resident and hot layers vLLM derives from them."""
    _, _, _, hisparse_groups, added_specs = compat.intree_hisparse()
    return specs | {name: group.kv_cache_spec for group in hisparse_groups(vllm_config, specs)
                    if isinstance(group.kv_cache_spec, added_specs)
                    for name in group.layer_names}


def _plan(vllm_config, specs: dict, kv_bytes: int):
    """vLLM's planning for ``kv_bytes`` of HBM, as the engine core does it; returns the
    scheduler's form of the config (each group collapsed to its first layer's spec)."""
    groups = compat.get_global_kv_cache_groups(vllm_config, [specs])
    (config,) = compat.get_kv_cache_configs(vllm_config, [specs], [int(kv_bytes)], groups)
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    return compat.generate_scheduler_kv_cache_config([config])


def build(system: str, setup: Setup) -> SchedulerDriver:
    """A scheduler driver of ``system`` (one of :data:`SYSTEMS`) for ``setup``."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    # The scheduler side pins no host memory (its host pool is bookkeeping), so a large
    # pool is checked against a 1 TiB host, whatever this machine has.
    config_module.host_memory_limit = lambda: HostMemoryLimit(1 << 40, None, None)
    ours = system in ("plan", "noop", "hisparse")
    vllm_config = make_vllm_config(
        setup.model_dir,
        kv_transfer=kv_transfer_config({"host_pool_gib": setup.host_pool_gib}) if ours else None,
        max_model_len=setup.max_model_len, block_size=setup.block_size,
        max_num_seqs=setup.max_num_seqs, max_num_batched_tokens=setup.max_num_batched_tokens)
    specs = dsa_layer_specs(setup.num_layers, block_size=setup.block_size)
    worker = None
    if system == "intree":
        intree_connector, HiSparseConfig, _, _, _ = compat.intree_hisparse()
        vllm_config.kv_transfer_config = compat.KVTransferConfig(
            kv_connector=intree_connector, kv_role="kv_both",
            kv_connector_extra_config={"host_pool_gib": setup.host_pool_gib})
        vllm_config.attention_config.hisparse_config = HiSparseConfig()
        specs = _in_tree_specs(vllm_config, specs)
        worker = InTreeFakeWorker()
    kv_cache_config = _plan(vllm_config, specs, setup.kv_bytes)
    if system == "plan":
        vllm_config.kv_transfer_config = None
    elif system == "noop":
        if not compat.connector_is_registered(NOOP_CONNECTOR):
            compat.KVConnectorFactory.register_connector(NOOP_CONNECTOR, __name__, NoopConnector.__name__)
        vllm_config.kv_transfer_config = compat.KVTransferConfig(kv_connector=NOOP_CONNECTOR,
                                                                 kv_role="kv_both")
    return SchedulerDriver(vllm_config, kv_cache_config, worker=worker)


# ---------------------------------------------------------------------------------------
# Child processes, timed or counted by callgrind
# ---------------------------------------------------------------------------------------

# Callgrind client requests (valgrind/callgrind.h), compiled on first use: instruction
# counts of exactly the measured region are deterministic, unlike times on a shared VM.
_CALLGRIND_SOURCE = """#include <valgrind/callgrind.h>
void hs_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void hs_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def callgrind_controls() -> tuple[Any, Any]:
    """``(start_instrumentation, toggle_collect)`` as ctypes functions (in a process that
    runs under ``valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no``)."""
    import ctypes

    out = Path(tempfile.mkdtemp()) / "libhs_callgrind.so"
    src = out.with_suffix(".c")
    src.write_text(_CALLGRIND_SOURCE)
    done = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"--instructions needs a C compiler and valgrind's callgrind.h:\n{done.stderr}")
    lib = ctypes.CDLL(str(out))
    return lib.hs_start, lib.hs_toggle


def run_child(cmd: list[str], label: str, *, callgrind: bool = False) -> tuple[dict, int | None]:
    """Run ``cmd`` (a Python child that prints one JSON line last); under callgrind also
    return the instructions it counted (None otherwise)."""
    env = None
    out_file = None
    if callgrind:
        out_file = Path(tempfile.mkdtemp()) / "callgrind.out"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={out_file}", *cmd]
        # Same string hashes in every run: dict layouts, hence instruction counts, repeat.
        env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{label} run failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if out_file is None:
        return result, None
    totals = [line for line in out_file.read_text().splitlines() if line.startswith(("totals:", "summary:"))]
    return result, int(totals[-1].split()[1])


def measured_step(harness: SchedulerDriver, toggle: Any = None, between: Any = None) -> tuple[Any, float]:
    """One scheduler step: ``schedule()`` and ``update_from_output()`` timed (and, with
    callgrind's ``toggle``, counted); the fake forward and ``between()`` (work a real engine
    does between the two) are not. Returns the ``SchedulerOutput`` and the step in ms."""
    scheduler = harness.scheduler
    if toggle:
        toggle()
    t0 = time.perf_counter()
    output = scheduler.schedule()
    t1 = time.perf_counter()
    if toggle:
        toggle()
    model_output = harness.fake_forward(output)
    if between is not None:
        between()
    if toggle:
        toggle()
    t2 = time.perf_counter()
    scheduler.update_from_output(output, model_output)
    t3 = time.perf_counter()
    if toggle:
        toggle()
    return output, ((t1 - t0) + (t3 - t2)) * 1e3


def python_child(target: str, *args: str) -> list[str]:
    """The command line that runs ``vllm-hisparse bench TARGET ARGS`` as a child."""
    return [sys.executable, "-m", "vllm_hisparse.cli.main", "bench", target, *args]
