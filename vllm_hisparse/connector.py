"""Import path vLLM's connector factory uses: ``vllm_hisparse.connector``.

A thin re-export so the public module name stays stable while the implementation
lives in ``vllm_hisparse.vllm`` (the only package that imports vllm).
"""

from vllm_hisparse.vllm.connector import HiSparseResidencyConnector

__all__ = ["HiSparseResidencyConnector"]
