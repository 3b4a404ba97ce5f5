"""Imports go downwards only: core ← ops ← worker ← vllm ← cli (docs/design.md, "Layers"), and inside
the vllm layer by side (``VLLM_RANKS``).

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


# ---------------------------------------------------------------- inside the vllm layer

#: The vLLM layer's folders (and root modules) by side, top to bottom: a module imports only
#: what sits below it or in its own folder. The two roles' folders share a rank and import
#: nothing from each other.
VLLM_RANKS = {
    "simulation": 7,
    "connector": 6, "plugin": 6,
    "scheduler_side": 5, "worker_side": 5,
    "metadata": 4,
    "pd": 3,
    "setup": 2,
    "metrics": 1, "patches": 1,
    "compat": 0,
}
VLLM = PACKAGE / "vllm"


def _vllm_modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted name under ``vllm_hisparse.vllm`` (``pd.reads``, ``metrics``) -> file."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name:
            found[name] = path
    return found


def _vllm_arrows(root: pathlib.Path) -> set[tuple[str, str]]:
    """Every import between two modules of the vllm layer, function-level ones included."""
    modules = _vllm_modules(root)
    arrows = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                own = target.removeprefix("vllm_hisparse.vllm.")
                if target.startswith("vllm_hisparse.vllm.") and own in modules and own != name:
                    arrows.add((name, own))
    return arrows


def _vllm_layer_violations(root: pathlib.Path) -> list[str]:
    modules = _vllm_modules(root)
    bad = [f"{name}: not placed in VLLM_RANKS" for name in modules
           if name.split(".")[0] not in VLLM_RANKS]
    arrows = _vllm_arrows(root)
    for source, target in sorted(arrows):
        src, dst = source.split(".")[0], target.split(".")[0]
        if src in VLLM_RANKS and dst in VLLM_RANKS and src != dst \
                and VLLM_RANKS[src] <= VLLM_RANKS[dst]:
            bad.append(f"{source} imports {target}: {src} does not sit above {dst}")
    graph: dict[str, set[str]] = {}
    for source, target in arrows:
        graph.setdefault(source, set()).add(target)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                bad.append("import circle: " + " -> ".join(path[path.index(nxt):] + [node, nxt]))
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return bad


def test_vllm_layer_folders_point_down_without_a_circle():
    assert _vllm_layer_violations(VLLM) == []


def test_vllm_layer_check_can_fail(tmp_path):
    """A worker-side module importing the scheduler side, an arrow back up from setup, and
    a circle hidden behind a function-level import are each flagged."""
    root = tmp_path / "vllm"
    for folder in ("setup", "scheduler_side", "worker_side"):
        (root / folder).mkdir(parents=True)
    (root / "compat.py").write_text("")
    (root / "worker_side" / "role.py").write_text(
        "from vllm_hisparse.vllm.scheduler_side import role\n")
    (root / "scheduler_side" / "role.py").write_text("")
    (root / "setup" / "config.py").write_text(
        "from vllm_hisparse.vllm.scheduler_side.role import X\n")
    (root / "setup" / "a.py").write_text("from vllm_hisparse.vllm.setup import b\n")
    (root / "setup" / "b.py").write_text("def f():\n    from vllm_hisparse.vllm.setup import a\n")
    (root / "stray.py").write_text("")
    bad = _vllm_layer_violations(root)
    assert any(b.startswith("worker_side.role imports scheduler_side.role") for b in bad)
    assert any(b.startswith("setup.config imports scheduler_side.role") for b in bad)
    assert any(b.startswith("import circle: setup.a -> setup.b -> setup.a") for b in bad)
    assert "stray: not placed in VLLM_RANKS" in bad
    assert len(bad) == 4


# ---------------------------------------------------------------------------------------
# Package and test code apart: nothing outside tests/ imports it
# ---------------------------------------------------------------------------------------

#: What ships or runs outside the test suite: the package and the repository's benchmarks/
#: (results only today), scripts/ and examples/.
NOT_TESTS = [PACKAGE, PACKAGE.parent / "benchmarks", PACKAGE.parent / "scripts",
             PACKAGE.parent / "examples"]


def _test_imports(root: pathlib.Path) -> list[str]:
    """Every import of the ``tests`` package (or a module in it) under ``root``."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        for lineno, name in _imports(path):
            if name.split(".")[0] == "tests":
                bad.append(f"{path.relative_to(root.parent)}:{lineno} imports {name}")
    return bad


@pytest.mark.parametrize("root", NOT_TESTS, ids=lambda p: p.name)
def test_nothing_outside_tests_imports_tests(root):
    assert _test_imports(root) == []


def test_tests_import_check_can_fail(tmp_path):
    (tmp_path / "bench.py").write_text(
        "import tests.vllm.fake_worker\nfrom tests.vllm.scheduler_harness import X\n"
        "def f():\n    from tests import conftest\n")
    assert len(_test_imports(tmp_path)) == 3
