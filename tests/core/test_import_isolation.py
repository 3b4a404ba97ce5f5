"""``vllm_hisparse.core`` must import with neither torch nor vllm available."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
sys.modules['torch'] = None   # any 'import torch' now raises ImportError
sys.modules['vllm'] = None
import vllm_hisparse.core as core
from vllm_hisparse.core import capacity, commands, device_pool, errors, host_blocks, page_table, policy, transactions
loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm') and sys.modules[m] is not None)
assert not loaded, loaded
print('ok', len(core.__all__))
"""


def test_core_imports_without_torch_and_vllm():
    """Run in a fresh interpreter so nothing imported by other tests can mask a dependency."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok ")


def test_core_sources_name_no_forbidden_module():
    """A cheap static guard as well: no core source file imports torch or vllm."""
    core_dir = REPO_ROOT / "vllm_hisparse" / "core"
    for path in core_dir.rglob("*.py"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import ", "from ")):
                first = stripped.split()[1].split(".")[0]
                assert first not in ("torch", "vllm"), f"{path.name}: {stripped}"
