"""Imports go downwards only: core ← ops ← worker ← vllm ← cli (DESIGN.md §2).

Two checks: a static one over every module's import statements, and a dynamic one that
imports the lower layers in a fresh interpreter where vllm (and, for core, torch) cannot be
imported at all.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "vllm_hisparse"
LAYERS = ["core", "ops", "worker", "vllm", "cli"]
THIRD_PARTY = {
    "core": {"numpy"},
    "ops": {"numpy", "torch"},
    "worker": {"numpy", "torch"},
    "vllm": {"numpy", "torch", "vllm", "msgspec", "prometheus_client", "zmq", "nixl"},
    "cli": None,  # the top: anything installed
}


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _violations(layer: str) -> list[str]:
    allowed_own = {f"vllm_hisparse.{below}" for below in LAYERS[:LAYERS.index(layer) + 1]}
    allowed_third = THIRD_PARTY[layer]
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for lineno, name in _imports(path):
            top = name.split(".")[0]
            where = f"{path.relative_to(PACKAGE.parent)}:{lineno} imports {name}"
            if top == "vllm_hisparse":
                if name == "vllm_hisparse" or name == "vllm_hisparse._C":
                    continue
                if not any(name == a or name.startswith(a + ".") for a in allowed_own):
                    bad.append(where)
            elif top in sys.stdlib_module_names or top == "__future__":
                continue
            elif allowed_third is not None and top not in allowed_third:
                bad.append(where)
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_static_imports_respect_layers(layer):
    assert _violations(layer) == []


def test_static_check_can_fail(tmp_path, monkeypatch):
    """The checker itself flags an upward import."""
    fake = tmp_path / "vllm_hisparse" / "core"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text("import torch\nfrom vllm_hisparse.ops import resolve\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "vllm_hisparse")
    assert len(_violations("core")) == 2


def _run_blocked(code: str, blocked: list[str]) -> subprocess.CompletedProcess:
    prelude = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked)
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                          cwd=str(PACKAGE.parent))


def test_core_imports_without_torch_and_vllm():
    result = _run_blocked("import vllm_hisparse.core\n", ["torch", "vllm"])
    assert result.returncode == 0, result.stderr


def test_lower_layers_import_without_vllm():
    """One interpreter for the three (each starts torch, seconds on a loaded machine): with
    vLLM blocked, an import that reaches it fails, and the traceback names the module."""
    modules = ["vllm_hisparse.ops", "vllm_hisparse.ops.reference", "vllm_hisparse.worker"]
    result = _run_blocked("".join(f"import {m}\n" for m in modules) + "print('ok')\n", ["vllm"])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_blocking_really_blocks():
    result = _run_blocked("import torch\n", ["torch"])
    assert result.returncode != 0
