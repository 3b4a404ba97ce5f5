"""Worker side of the data plane, without vLLM: host pool, transfer engine, hot state.

Imports torch, :mod:`vllm_hisparse.core` and :mod:`vllm_hisparse.ops` only, so it runs on a
machine without vLLM (the GPU benchmark machine) and could serve another engine.
"""

from vllm_hisparse.worker.host_pool import HostPool
from vllm_hisparse.worker.hot_state import GroupGather, HotState, ResolveResult
from vllm_hisparse.worker.page_tables import PageTables
from vllm_hisparse.worker.step_executor import StepExecutor
from vllm_hisparse.worker.transfer import TransferEngine, TransferKind, TransferReport

__all__ = ["GroupGather", "HostPool", "HotState", "PageTables", "ResolveResult", "StepExecutor",
           "TransferEngine", "TransferKind", "TransferReport"]
