"""Whether the tensor-parallel ranks of a replica share one host pool (docs/worker.md,
"Tensor parallelism: one host pool per node").

Sparse-MLA KV (the latent rows) is replicated: every TP rank holds the same bytes, so one host
copy serves them all. The ranks share one pool when they are local processes of one node, i.e.
vLLM's multiprocess executor (``"mp"``) with the replica on one node; otherwise each rank keeps
a private pool. The scheduler and every worker compute this from the same ``VllmConfig`` (and
environment), so they agree on the number of host copies and thus on the host block count.

The segment name is derived without communication from what every rank of one replica knows:
vLLM's instance id (built once with the config, shipped pickled to every worker) and the
data-parallel rank.

Environment (read by the scheduler and by the workers, which inherit it):

* ``VLLM_HISPARSE_SHARED_HOST_POOL``: ``0`` / ``off`` / ``false`` forces private pools
  (TP times the host memory); default: shared where possible.
* ``VLLM_HISPARSE_SHM_DIR``: the directory to create the segment in (a tmpfs or hugetlbfs
  mount); default: every writable 2 MiB hugetlbfs mount, then ``/dev/shm``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from vllm_hisparse.vllm import compat
from vllm_hisparse.worker.host_pool import SharedSegment

logger = logging.getLogger("vllm_hisparse.vllm")

ENV_SHARED = "VLLM_HISPARSE_SHARED_HOST_POOL"
ENV_SHM_DIR = "VLLM_HISPARSE_SHM_DIR"
_OFF = ("0", "off", "false", "no", "private")
OPEN_TIMEOUT_S = 600.0  # the writer faults in and pins the whole pool before publishing it
WRITER_TP_RANK = 0


@dataclass(frozen=True)
class HostPoolSharing:
    """The decision for one replica.

    Attributes:
        shared: one pool for the replica's TP ranks (True) or one per rank.
        reason: why (logged).
        num_ranks: tensor-parallel ranks of the replica.
        segment_name: the shared segment's name (None when private).
    """

    shared: bool
    reason: str
    num_ranks: int
    segment_name: str | None = None

    @property
    def host_copies(self) -> int:
        """Physical copies of the host pool per replica (sizes ``host_pool_gib``)."""
        return 1 if self.shared else self.num_ranks

    def writes_host(self, tp_rank: int) -> bool:
        """Whether rank ``tp_rank`` copies device → host (spills, mirrors)."""
        return not self.shared or tp_rank == WRITER_TP_RANK

    def segment(self, tp_rank: int, suffix: str = "") -> SharedSegment | None:
        """The :class:`SharedSegment` rank ``tp_rank`` maps (None when private); ``suffix``
        names a second pool of the same replica (e.g. ``"-indexer"``)."""
        if not self.shared:
            return None
        shm_dir = os.environ.get(ENV_SHM_DIR) or None
        # The ranks that do not write the host pool only read it: they map it read-only.
        return SharedSegment(self.segment_name + suffix, create=tp_rank == WRITER_TP_RANK,
                             num_ranks=self.num_ranks, open_timeout_s=OPEN_TIMEOUT_S,
                             dirs=(shm_dir,) if shm_dir else None,
                             read_only=not self.writes_host(tp_rank))

    def describe(self, tp_rank: int) -> str:
        if not self.shared:
            return (f"one private host pool per tensor-parallel rank ({self.reason}); "
                    f"physical host memory = {self.num_ranks} x logical")
        role = ("creates it and writes it (spills, mirrors)" if tp_rank == WRITER_TP_RANK
                else f"maps it and only reads it; TP rank {WRITER_TP_RANK} writes")
        return (f"one host pool shared by the {self.num_ranks} tensor-parallel ranks of this "
                f"node (segment {self.segment_name}); TP rank {tp_rank} {role}")


def segment_name(vllm_config: Any) -> str:
    """The segment name of this replica: a hash of vLLM's instance id and the DP rank."""
    key = f"{compat.instance_id(vllm_config)}|dp{compat.data_parallel_rank(vllm_config)}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def plan_host_pool_sharing(vllm_config: Any) -> HostPoolSharing:
    """Decide shared vs private pools from the config (the same answer in every process)."""
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    if tp <= 1:
        return HostPoolSharing(False, "one tensor-parallel rank", tp)
    if os.environ.get(ENV_SHARED, "").strip().lower() in _OFF:
        return HostPoolSharing(False, f"{ENV_SHARED}={os.environ[ENV_SHARED]}", tp)
    backend = compat.executor_backend_name(vllm_config)
    if backend != "mp":
        return HostPoolSharing(
            False, f"executor backend {backend!r}: only vLLM's multiprocess executor ('mp') "
            "is known to run the ranks as local processes of one node", tp)
    nodes = compat.nodes_per_replica(vllm_config)
    if nodes != 1:
        return HostPoolSharing(False, f"the replica's ranks span {nodes} nodes", tp)
    if not compat.instance_id(vllm_config):
        return HostPoolSharing(False, "vLLM gave no instance id to name the segment by", tp)
    return HostPoolSharing(True, "all ranks are local processes of one node", tp,
                           segment_name(vllm_config))
