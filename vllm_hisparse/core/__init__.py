"""Engine-agnostic residency core (standard library + numpy only; no torch, no vllm).

Public API:

* pools: :class:`HostBlockPool`, :class:`DevicePool` (protocol), :class:`InMemoryDevicePool`
* page tables: :class:`PageTables`, :class:`PageTable`; :data:`ACTIVE_TAIL_PAGES` (from ``units``)
* policy: :class:`ResidencyPolicy`, :class:`PolicyConfig`, :class:`Outcome`,
  :class:`RequestStatus`, :class:`AddResult`, :class:`PolicyStats`
* wire format: :class:`StepCommand`, :class:`TransferSpec`, :class:`HotLease`,
  :class:`ResidencyChange`, :class:`WorkerAcks`, :class:`TransferKind`, :class:`Residency`
* capacity: :class:`ModelGeometry`, :class:`EngineLayout`, :func:`concurrency_report` (the one function
  behind the startup table and ``plan``), :func:`layout_for_geometry`, :func:`critical_path_layers`,
  presets ``DEEPSEEK_V32_FP8`` / ``DEEPSEEK_V32_BF16``
* KV cache groups: :func:`choose_split` (``kv_layout``)
* errors: :class:`BackPressure`, :class:`HostPoolExhausted`, :class:`DevicePoolExhausted`,
  :class:`ProtocolError`
"""

from vllm_hisparse.core.capacity import (
    DEEPSEEK_V32_BF16,
    DEEPSEEK_V32_FP8,
    GLM_51_FP8,
    GLM_52_FP8,
    GLM_53_FP8,
    INDEXER_ROW_BYTES,
    PREFETCH_FIRST_LAUNCH_LAYERS,
    PRESETS,
    ROW_BYTES_BF16,
    ROW_BYTES_FP8_DS_MLA,
    CapacityReport,
    EngineLayout,
    ModelGeometry,
    concurrency_report,
    critical_path_layers,
    default_device_buffer_size_rows,
    layout_for_geometry,
)
from vllm_hisparse.core.commands import (
    HotLease,
    Residency,
    ResidencyChange,
    StepCommand,
    TransferKind,
    TransferSpec,
    WorkerAcks,
)
from vllm_hisparse.core.device_pool import DevicePool, InMemoryDevicePool
from vllm_hisparse.core.errors import (
    BackPressure,
    DevicePoolExhausted,
    HiSparseCoreError,
    HostPoolExhausted,
    ProtocolError,
)
from vllm_hisparse.core.host_blocks import HostBlockPool
from vllm_hisparse.core.kv_layout import MAX_SPLIT_GROUPS, SplitChoice, choose_split
from vllm_hisparse.core.page_table import PageTable, PageTables
from vllm_hisparse.core.outcome import AddResult, Outcome
from vllm_hisparse.core.policy import ResidencyPolicy
from vllm_hisparse.core.policy_config import PolicyConfig
from vllm_hisparse.core.request_table import RequestStatus
from vllm_hisparse.core.stats import PolicyStats
from vllm_hisparse.core.units import ACTIVE_TAIL_PAGES

__all__ = [
    "ACTIVE_TAIL_PAGES",
    "AddResult",
    "BackPressure",
    "CapacityReport",
    "DEEPSEEK_V32_BF16",
    "DEEPSEEK_V32_FP8",
    "DevicePool",
    "GLM_51_FP8",
    "GLM_52_FP8",
    "GLM_53_FP8",
    "PRESETS",
    "PREFETCH_FIRST_LAUNCH_LAYERS",
    "DevicePoolExhausted",
    "EngineLayout",
    "HiSparseCoreError",
    "HostBlockPool",
    "HostPoolExhausted",
    "HotLease",
    "INDEXER_ROW_BYTES",
    "InMemoryDevicePool",
    "MAX_SPLIT_GROUPS",
    "ModelGeometry",
    "Outcome",
    "PageTable",
    "PageTables",
    "PolicyConfig",
    "PolicyStats",
    "ProtocolError",
    "ROW_BYTES_BF16",
    "ROW_BYTES_FP8_DS_MLA",
    "RequestStatus",
    "Residency",
    "ResidencyChange",
    "ResidencyPolicy",
    "SplitChoice",
    "StepCommand",
    "TransferKind",
    "TransferSpec",
    "WorkerAcks",
    "choose_split",
    "concurrency_report",
    "critical_path_layers",
    "default_device_buffer_size_rows",
    "layout_for_geometry",
]
