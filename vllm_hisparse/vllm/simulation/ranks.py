"""The simulator's tensor-parallel ranks (``simulate --tensor-parallel-size N``).

vLLM's multiprocess executor runs one worker process per tensor-parallel rank. Each holds a
model runner and the connector's worker role over its own device KV, receives the same
``SchedulerOutput`` (serialized), and the engine core folds the ranks' ``ModelRunnerOutput``
with ``KVOutputAggregator`` before the scheduler sees them. :class:`RankThreads` does the
same inside one process:

* rank r gets its own copy of the ``VllmConfig`` (pickled, ``parallel_config.rank = r``, as
  vLLM ships the config to each worker), its own KV tensors on ``cuda:r`` (``cpu`` on a CPU
  run), synthetic model (ground truth, top-k generators) and worker role. The host-pool
  sharing decision (``vllm/setup/host_sharing.py``) is taken from that config: the ranks map ONE
  named shared segment, rank 0 creates and writes it, the others map it read-only
  (``VLLM_HISPARSE_SHARED_HOST_POOL=0``: one private pool per rank);
* each rank runs in a thread of its own, so its current CUDA device, vLLM's current stream
  (thread-local) and the attention hook's context variable are its own, and the ranks' steps
  run concurrently (on GPUs, their copies and gathers overlap in time);
* every step, each rank unpickles its own copy of the scheduler output (what crosses vLLM's
  process boundary: the connector metadata must survive it), runs the step and checks every
  row it reads against the ground truth; its output is pickled back, the outputs are
  aggregated by vLLM's ``KVOutputAggregator`` and go to rank 0's scheduler, whose connector
  votes the acks per (transfer, worker) (``core.ack_vote``): a host copy becomes valid only
  once every rank completed its part, i.e. once the writing rank's copy is complete.

After the run every rank must have resolved exactly the same selections (replicated KV,
replicated decisions); each rank's counters and its measured host memory
(``HostPool.memory_usage``) are kept in ``RunResult.ranks``.
"""

from __future__ import annotations

import pickle
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.simulation.ground_truth import SimulationFailure, SimulationMismatch
from vllm_hisparse.vllm.simulation.spec import SimulationSpec

#: ``make_runner(rank, device, vllm_config, leader)``: rank 0 gets ``leader=None`` and builds
#: the scheduler; rank r > 0 shares it (``engine._Run``).
MakeRunner = Callable[[int, torch.device, Any, Any], Any]


def rank_config(vllm_config: Any, rank: int) -> Any:
    """The config worker ``rank`` receives: a pickled copy with ``parallel_config.rank``
    set (the instance id, hence the shared segment's name, travels with it)."""
    config = pickle.loads(pickle.dumps(vllm_config))
    config.parallel_config.rank = rank
    return config


class RankThreads:
    """The ranks of one run; ``execute()`` and ``close()`` as ``engine._Run`` offers them.

    Args:
        spec: the simulation (``tensor_parallel_size`` ranks on ``spec.rank_devices``).
        vllm_config: rank 0's config (the scheduler's); the others get pickled copies.
        make_runner: builds one rank's ``_Run`` (called in that rank's thread).
    """

    def __init__(self, spec: SimulationSpec, vllm_config: Any, make_runner: MakeRunner):
        self.spec = spec
        devices = [torch.device(d) for d in spec.rank_devices]
        # Copies first: building rank 0 fills its config's static forward context.
        configs = [vllm_config] + [rank_config(vllm_config, r) for r in range(1, len(devices))]
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sim-tp{r}")
                         for r in range(len(devices))]
        self.runners: list[Any] = []
        try:
            # One after the other: rank 0 publishes the shared segment the others open.
            for rank, (device, config) in enumerate(zip(devices, configs)):
                leader = self.runners[0] if self.runners else None
                self.runners.append(self._threads[rank].submit(
                    _start_rank, make_runner, rank, device, config, leader).result())
        except BaseException:
            self.close()
            raise
        self.leader = self.runners[0]
        self.leader.model_runners = list(self.runners)
        self.leader.execute_model = self._execute_model
        self._aggregator = None
        if self.leader.worker is not None:
            self._aggregator = compat.KVOutputAggregator.from_connector(
                self.leader.worker, len(self.runners))

    # ------------------------------------------------------------------ one step

    def _execute_model(self, scheduler_output: Any) -> Any:
        """Every rank runs the step on its own copy of the scheduler output; their outputs
        are aggregated as vLLM's executor does (rank 0's output, every rank's acks)."""
        payload = pickle.dumps(scheduler_output)
        step = self.leader.step
        futures = []
        for thread, runner in zip(self._threads, self.runners):
            runner.step = step
            futures.append(thread.submit(_run_step, runner, payload))
        outputs: list[Any] = []
        failure: SimulationFailure | None = None
        for runner, future in zip(self.runners, futures):  # wait for all: none left running
            try:
                outputs.append(pickle.loads(future.result()))
            except Exception as exc:  # noqa: BLE001 - named by rank, the first one raised
                failure = failure or _rank_failure(runner, step, exc)
        if failure is not None:
            raise failure
        if self._aggregator is None:
            return outputs[0]
        return self._aggregator.aggregate(outputs, output_rank=0)

    # ------------------------------------------------------------------ the run

    def execute(self) -> Any:
        """The run (rank 0's loop drives every rank); then the ranks' figures are compared
        and kept in ``result.ranks``."""
        result = self.leader.execute()
        summaries = [self._threads[r].submit(_summary, runner).result()
                     for r, runner in enumerate(self.runners)]
        first = summaries[0]
        for other in summaries[1:]:
            mine = tuple(other[k] for k in ("resident", "hot_hits", "misses"))
            theirs = tuple(first[k] for k in ("resident", "hot_hits", "misses"))
            if mine != theirs:
                raise SimulationFailure(
                    f"{self.leader.label}: TP rank {other['rank']} resolved (resident, hot "
                    f"hit, miss) = {mine}, rank 0 {theirs}: the ranks must take the same "
                    "decisions on the same commands")
        result.rows_checked = sum(s["rows_checked"] for s in summaries)
        result.ranks = summaries
        return result

    def close(self) -> None:
        """Close every rank in its thread, readers before the writer (the creator of the
        shared segment unlinks it), then stop the threads. The first error is raised."""
        error = None
        for rank in reversed(range(len(self.runners))):
            try:
                self._threads[rank].submit(self.runners[rank].close).result()
            except Exception as exc:  # noqa: BLE001 - close every rank, then raise
                error = error or exc
        for thread in self._threads:
            thread.shutdown(wait=True)
        self.runners = []
        if error is not None:
            raise error


def _start_rank(make_runner: MakeRunner, rank: int, device: torch.device, config: Any,
                leader: Any) -> Any:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread's current device, for good
    return make_runner(rank, device, config, leader)


def _run_step(runner: Any, payload: bytes) -> bytes:
    return pickle.dumps(runner._forward(pickle.loads(payload)))


def _rank_failure(runner: Any, step: int, exc: Exception) -> SimulationFailure:
    """``exc`` of one rank as the run's failure, naming the rank."""
    prefix = f"TP rank {runner.rank}: "
    if isinstance(exc, SimulationMismatch):
        failure: SimulationFailure = SimulationMismatch(
            prefix + str(exc), request=exc.request, step=exc.step, layer=exc.layer,
            position=exc.position)
    elif isinstance(exc, SimulationFailure):
        failure = SimulationFailure(prefix + str(exc))
    else:
        failure = SimulationFailure(f"{prefix}{runner.label}, step {step}: "
                                    f"{type(exc).__name__}: {exc}")
    failure.__cause__ = exc
    return failure


def _summary(runner: Any) -> dict[str, Any]:
    """One rank's figures and the host memory its pool holds (measured before close)."""
    r = runner.result
    out: dict[str, Any] = {
        "rank": runner.rank, "device": str(runner.device), "rows_checked": r.rows_checked,
        "resident": r.resident, "hot_hits": r.hot_hits, "misses": r.misses,
        "bytes_h2d": r.bytes_h2d, "bytes_d2h": r.bytes_d2h, "gather_bytes": r.gather_bytes,
        "restore_bytes": r.restore_bytes, "writes_host": None, "host_pool": None}
    if runner.worker is not None:
        role = runner.worker.worker_role
        out["writes_host"] = role.writes_host
        out["host_pool"] = dict(role.host_pool.memory_usage(),
                                segment=role.host_pool.segment_path,
                                page_mode=role.host_pool.page_mode)
    return out


def host_memory_line(ranks: list[dict[str, Any]]) -> str | None:
    """One line on the ranks' host memory: what each addresses, what they hold together
    (the sum of their proportional shares, in copies of one rank's pool: 1 when shared, one
    per rank when private) and the shared segment's pages (a 2 MiB header and the data
    rounded up to 2 MiB: visible on tiny pools only)."""
    pools = [r["host_pool"] for r in ranks if r.get("host_pool")]
    if not pools:
        return None
    gib = 1 << 30
    logical = sum(p["logical_bytes"] for p in pools)
    held = sum(p["pss_bytes"] for p in pools)
    per_rank = pools[0]["logical_bytes"]
    kind = ("one shared segment" if pools[0]["shared"]
            else f"{len(pools)} private pools")
    line = (f"host memory: {len(pools)} ranks address {logical / gib:.3f} GiB "
            f"({per_rank / gib:.3f} GiB each) in {kind}; held: {held / gib:.3f} GiB "
            f"(sum of the ranks' Pss) = {held / max(1, per_rank):.2f} copies of a rank's pool")
    if pools[0]["shared"]:
        line += f", segment file pages {pools[0]['segment_bytes'] / gib:.3f} GiB"
    return line
