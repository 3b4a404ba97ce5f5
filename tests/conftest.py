"""Test-wide settings: one torch CPU thread; ``@pytest.mark.gpu`` tests are skipped on
machines without CUDA."""

from __future__ import annotations

import os

import pytest

# Before torch is first imported (and inherited by the tests' subprocesses). The suite's CPU
# tensors are small; a second OpenMP thread only spins, and on a busy 2-core machine the
# spinning costs more than the work: measured under a load average of 6, two torch threads
# took 95 s for two of the slowest worker-role tests (72 s CPU), one thread 12 s (20 s CPU
# with the imports).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
