"""Fixtures shared by the vLLM-integration tests (CPU, real vLLM 0.33 objects)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hisparse.vllm.simulation.model import write_model_dir


@pytest.fixture(scope="session", autouse=True)
def _registered() -> None:
    """What vLLM's plugin loader does in every process: call our entry point."""
    from vllm_hisparse.vllm.plugin import register

    register()


@pytest.fixture(scope="session")
def dsa_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("dsv32_tiny"))


@pytest.fixture(scope="session")
def mla_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DeepSeek-V3-style MLA model without a DSA indexer (no index_topk)."""
    return write_model_dir(tmp_path_factory.mktemp("dsv3_tiny"), with_index_topk=False)


@pytest.fixture(scope="session")
def small_topk_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DSA model with index_topk=128: hot regions of 2 pages (block 64)."""
    return write_model_dir(tmp_path_factory.mktemp("dsv32_tiny_k128"), index_topk=128)
