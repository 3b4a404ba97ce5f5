"""The collaborators every piece of :class:`~vllm_hisparse.core.policy.ResidencyPolicy`
shares: the policy builds its parts with the same config, tables, request table, step
builder, page leases, pools and stats, and each part reads them as attributes."""

from __future__ import annotations

from vllm_hisparse.core.device_pool import DevicePool
from vllm_hisparse.core.host_blocks import HostBlockPool
from vllm_hisparse.core.page_leases import PageLeases
from vllm_hisparse.core.page_table import PageTables
from vllm_hisparse.core.policy_config import PolicyConfig
from vllm_hisparse.core.request_table import RequestTable
from vllm_hisparse.core.stats import PolicyStats
from vllm_hisparse.core.step_builder import StepBuilder


class PolicyPart:
    """Base of the policy's parts that plan transfers or imports (see module docstring)."""

    def __init__(self, config: PolicyConfig, tables: PageTables, requests: RequestTable, steps: StepBuilder,
                 leases: PageLeases, device_pool: DevicePool, host_pool: HostBlockPool, stats: PolicyStats) -> None:
        self.config = config
        self.tables = tables
        self.requests = requests
        self.steps = steps
        self.leases = leases
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.stats = stats
        self.block_size = config.block_size
