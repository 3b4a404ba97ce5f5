"""The state every part of :class:`~vllm_hisparse.core.policy.ResidencyPolicy` shares.

The policy builds one :class:`PolicyState` and passes it to each part (page leases,
transfer planner, transitions, host prefixes, imports, growth, hot regions). A part reads
the shared tables, pools and ledgers through ``self.state`` and keeps on itself only what it
owns; the other parts it calls are constructor arguments of their own, so a part's
signature names exactly whom it works with.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_hisparse.core.device_pool import DevicePool
from vllm_hisparse.core.host_blocks import HostBlockPool
from vllm_hisparse.core.page_table import PageTables
from vllm_hisparse.core.policy_config import PolicyConfig
from vllm_hisparse.core.request_table import RequestTable
from vllm_hisparse.core.stats import PolicyStats
from vllm_hisparse.core.step_builder import StepBuilder


@dataclass(frozen=True, eq=False)
class PolicyState:
    """The policy's shared objects (module docstring); fixed for the policy's life."""

    config: PolicyConfig
    device_pool: DevicePool
    host_pool: HostBlockPool
    tables: PageTables
    """Every request's page table (``[rows, pages]`` arrays) and per-row counters."""
    requests: RequestTable
    """The requests by id and by state row, and the row vectors it alone writes."""
    steps: StepBuilder
    """The step being planned: what the next ``build_step`` sends the worker."""
    stats: PolicyStats
    block_size: int
    """Positions per page (``config.block_size``)."""

    @classmethod
    def create(cls, config: PolicyConfig, device_pool: DevicePool, host_pool: HostBlockPool) -> PolicyState:
        """Empty tables, no request, no step planned yet, zero counters."""
        steps = StepBuilder()
        return cls(
            config=config,
            device_pool=device_pool,
            host_pool=host_pool,
            tables=PageTables(config.max_num_rows, config.max_pages_per_request, config.block_size),
            requests=RequestTable(config.max_num_rows, steps),
            steps=steps,
            stats=PolicyStats(),
            block_size=config.block_size,
        )
