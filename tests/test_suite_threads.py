"""The suite runs torch on one CPU thread (tests/conftest.py): on a loaded 2-core machine a
second OpenMP thread spins instead of working and made the fast tier several times slower."""

from __future__ import annotations

import os


def test_torch_runs_one_cpu_thread_here_and_in_subprocesses():
    import torch

    assert torch.get_num_threads() == 1
    assert os.environ["OMP_NUM_THREADS"] == "1"  # inherited by the tests' subprocesses
