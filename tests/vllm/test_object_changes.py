"""The object-change table (``patches.OBJECT_CHANGES``) against the installed vLLM and against
the package source.

* every record still applies to the installed vLLM (``check()``);
* only ``vllm_hisparse/vllm/compat/`` imports vLLM (statically or through ``importlib``);
* every touch of a private vLLM name, every attribute written on a vLLM object and every
  override by a subclass of a vLLM internal class that a scan of the package finds is in the
  table (or, inside ``patches/``, is a function patch's target);
* every record's sites really make the change.

Each check is run once more on a doctored table or tree, to show that it can fail.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pathlib
import re

import pytest

from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.patches import object_changes

REPO = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = REPO / "vllm_hisparse"
COMPAT = PACKAGE / "vllm" / "compat"

#: Root names that, by this package's naming, hold a vLLM object: an attribute written through
#: one of them is a write on a vLLM object even when the package has an attribute of that name.
VLLM_RECEIVERS = {"vllm_config", "kv_cache_config", "scheduler_output", "request", "kv_cache_manager",
                  "coordinator", "scheduler", "impl", "group", "layer", "attn_metadata", "compat"}
#: vLLM's public connector API: deriving from these and overriding their methods is the API.
PUBLIC_BASES = {"KVConnectorBase_V1", "SupportsHMA", "KVConnectorMetadata", "KVConnectorWorkerMetadata",
                "KVConnectorStats", "KVConnectorPromMetrics"}
_PRIVATE = re.compile(r"_[A-Za-z0-9]")  # one leading underscore, not a dunder
_DEFINED = re.compile(r"(?:\bdef\s+|\bclass\s+|\bself\.|\bcls\.|^\s*)(_?[A-Za-z]\w*)\s*(?:\(|:|=(?!=))", re.M)


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _trees(root: pathlib.Path) -> dict[str, ast.Module]:
    return {_module_name(p, root): ast.parse(p.read_text(), filename=str(p))
            for p in sorted(root.rglob("*.py"))}


@functools.lru_cache(maxsize=1)
def _vllm_defined() -> frozenset[str]:
    """Every name the installed vLLM defines (functions, classes, attributes it assigns,
    module and class level names): a regular-expression pass over its source."""
    import vllm

    names: set[str] = set()
    for path in pathlib.Path(vllm.__file__).parent.rglob("*.py"):
        names.update(_DEFINED.findall(path.read_text(errors="ignore")))
    return frozenset(names)


def _own_names(trees: dict[str, ast.Module]) -> set[str]:
    """Names the package defines itself (so that an access to them is not a vLLM touch)."""
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                own.add(node.arg)
    return own


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


# ------------------------------------------------------------------ the scans

def vllm_imports_outside_compat(root: pathlib.Path) -> list[str]:
    """Every import of vLLM under ``root`` (a ``vllm_hisparse`` tree) outside ``vllm/compat/``:
    import statements (function-level ones too) and ``importlib.import_module`` /
    ``__import__`` calls whose module is not a literal ``vllm_hisparse.`` name."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        if (root / "vllm" / "compat") in path.parents:
            continue
        where = path.relative_to(root.parent)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                bad += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                        if a.name.split(".")[0] == "vllm"]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "vllm":
                bad.append(f"{where}:{node.lineno} imports from {node.module}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                    "importlib.import_module", "import_module", "__import__"):
                arg = node.args[0] if node.args else None
                text = (arg.value if isinstance(arg, ast.Constant) else
                        arg.values[0].value if isinstance(arg, ast.JoinedStr) and arg.values
                        and isinstance(arg.values[0], ast.Constant) else "")
                if not str(text).startswith("vllm_hisparse."):
                    bad.append(f"{where}:{node.lineno} imports {ast.unparse(arg) if arg else '?'} "
                               "dynamically")
    return bad


def _scoped_nodes(tree: ast.Module, module: str):
    """``(where, node)`` for every node: ``where`` is the module, or, inside ``compat``, the
    module and the top-level function or constant the node belongs to (a compat touch is
    accounted for by the record naming that accessor)."""
    in_compat = module.startswith("vllm_hisparse.vllm.compat")
    for top in tree.body:
        name = getattr(top, "name", None)
        where = f"{module}:{name}" if in_compat and name else module
        for node in ast.walk(top):
            yield where, node


def static_touches(root: pathlib.Path) -> set[tuple[str, str]]:
    """``(where, name)`` of every touch of a private vLLM name (attribute, ``getattr``
    string, ``from vllm... import _name``) and every attribute written on (or deleted from)
    a vLLM object, found in the source under ``root`` (``where``: :func:`_scoped_nodes`)."""
    trees = _trees(root)
    defined, own = _vllm_defined(), _own_names(trees)
    touches = set()
    for module_name, tree in trees.items():
        for module, node in _scoped_nodes(tree, module_name):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "vllm":
                touches |= {(module, a.name) for a in node.names if _PRIVATE.match(a.name)}
            elif isinstance(node, ast.Attribute):
                name = node.attr
                if name not in defined:
                    continue
                if _PRIVATE.match(name) and name not in own:
                    touches.add((module, name))
                elif isinstance(node.ctx, (ast.Store, ast.Del)) and _root(node.value) not in ("self", "cls") \
                        and (name not in own or _root(node.value) in VLLM_RECEIVERS):
                    touches.add((module, name))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                name = node.args[1].value
                if name not in defined:
                    continue
                written = node.func.id in ("setattr", "delattr") and _root(node.args[0]) not in ("self", "cls")
                if (_PRIVATE.match(name) and name not in own) or (
                        written and (name not in own or _root(node.args[0]) in VLLM_RECEIVERS)):
                    touches.add((module, name))
    return touches


def _vllm_bases(cls: type) -> list[type]:
    return [c for c in cls.__mro__[1:] if c.__module__.split(".")[0] == "vllm"]


def subclass_touches(root: pathlib.Path) -> set[tuple[str, str]]:
    """``(module, name)`` of every method a package class overrides, and every ``self.<name>``
    it assigns, where its vLLM base class (a vLLM internal, not the public connector API)
    already defines ``name``."""
    touches = set()
    for module, tree in _trees(root).items():
        classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.bases]
        if not classes:
            continue
        loaded = None
        for node in classes:
            if loaded is None:
                loaded = importlib.import_module(module)
            cls = getattr(loaded, node.name, None)
            bases = _vllm_bases(cls) if isinstance(cls, type) else []
            if not bases or any(b.__name__ in PUBLIC_BASES for b in bases):
                continue
            source = "\n".join(inspect.getsource(b) for b in bases if b is not object)
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item in node.body:
                    name = item.name
                elif (isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store)
                      and isinstance(item.value, ast.Name) and item.value.id == "self"):
                    name = item.attr
                else:
                    continue
                if name.startswith("__"):
                    continue
                if any(hasattr(b, name) for b in bases) or f"self.{name}" in source:
                    touches.add((module, name))
    return touches


def _used_names(tree: ast.AST) -> set[str]:
    """Names a module's code (not its docstrings) uses: attributes, bare names, imported
    names and string constants that are identifiers (``getattr(obj, "name")``)."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            used.add(node.name)  # an override
        elif isinstance(node, ast.ImportFrom):
            used |= {a.name for a in node.names}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            used.add(node.value)
    return used


def _compat_module_of(name: str) -> str | None:
    for module in compat.MODULES:
        if name in module.__all__:
            return module.__name__
    return None


def uncovered(touches: set[tuple[str, str]], changes=patches.OBJECT_CHANGES,
              function_patches=patches.PATCHES) -> list[tuple[str, str]]:
    """The touches no record accounts for: a record covers ``(module, name)`` when ``name``
    is one of its names and ``module`` is one of its sites or the compat module of one of its
    compat names; a function patch covers a touch inside ``patches/`` whose name its target
    names."""
    left = []
    for where, name in sorted(touches):
        module, _, accessor = where.partition(":")
        covered = any(name in c.names and (module in c.sites or (accessor in c.compat and module
                                                                 == _compat_module_of(accessor)))
                      for c in changes)
        if not covered and module.startswith("vllm_hisparse.vllm.patches."):
            covered = any(re.search(rf"\b{re.escape(name)}\b", p.target) for p in function_patches)
        if not covered:
            left.append((where, name))
    return left


def site_problems(change: object_changes.ObjectChange, root: pathlib.Path = PACKAGE) -> list[str]:
    """What in ``change`` the source under ``root`` does not bear out: every site must exist
    and use one of its compat names or touch one of its names; every name must be touched at
    a site or in the compat module of one of its compat names."""
    problems = []
    texts = {}
    for site in change.sites:
        path = root.parent / pathlib.Path(*site.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        if not path.exists():
            problems.append(f"{change.name}: site {site} does not exist")
            continue
        texts[site] = used = _used_names(ast.parse(path.read_text()))
        if not used & {*change.compat, *change.names}:
            problems.append(f"{change.name}: site {site} neither calls compat.{change.compat} "
                            f"nor touches {change.names}")
    compat_used = []  # read from the source files: tests may stand in for an accessor
    for accessor in change.compat:
        module = _compat_module_of(accessor)
        if module is not None:
            tree = ast.parse(inspect.getsource(importlib.import_module(module)))
            compat_used += [_used_names(node) for node in tree.body
                            if isinstance(node, ast.FunctionDef) and node.name == accessor]
    for name in change.names:
        if not any(name in used for used in [*texts.values(), *compat_used]):
            problems.append(f"{change.name}: no site (nor compat) touches {name!r}")
    return problems


# ------------------------------------------------------------------ the tests

def test_every_record_still_applies_to_the_installed_vllm():
    assert object_changes.check() == []
    assert patches.check_object_changes is object_changes.check


def test_check_can_fail():
    record = dataclasses.replace(patches.OBJECT_CHANGES[0], compat=("no_such_accessor",),
                                 shapes=(("vllm.config.VllmConfig", "no_such_field", "field"),
                                         ("vllm.no_such_module.X", "y", "class")))
    problems = record.check()
    assert len(problems) == 3, problems
    assert any("compat has no 'no_such_accessor'" in p for p in problems)
    assert any("VllmConfig.no_such_field: no such dataclass field" in p for p in problems)


def test_the_table_is_well_formed():
    names = [c.name for c in patches.OBJECT_CHANGES]
    assert len(names) == len(set(names))
    for change in patches.OBJECT_CHANGES:
        assert change.action in object_changes.ACTIONS, change.name
        assert change.target and change.why and change.extension_point and change.shapes, change.name
        assert change.sites and change.names, change.name
        assert all(s.startswith("vllm_hisparse.") for s in change.sites), change.name
        assert patches.object_change(change.name) is change
    with pytest.raises(KeyError, match="no object change named 'nope'; known: "):
        patches.object_change("nope")
    for patch in patches.PATCHES:
        assert patch.extension_point, patch.name


def test_only_compat_imports_vllm():
    assert vllm_imports_outside_compat(PACKAGE) == []


def test_import_check_can_fail(tmp_path):
    (tmp_path / "vllm_hisparse" / "vllm" / "compat").mkdir(parents=True)
    (tmp_path / "vllm_hisparse" / "vllm" / "compat" / "ok.py").write_text("import vllm.config\n")
    (tmp_path / "vllm_hisparse" / "cli").mkdir()
    (tmp_path / "vllm_hisparse" / "cli" / "bad.py").write_text(
        "import importlib\nimport vllm\nfrom vllm.config import X\n"
        "def f():\n    import vllm.envs as envs\n"
        "    importlib.import_module('vllm.v1.core')\n"
        "    importlib.import_module(f'vllm_hisparse.cli.{f}')\n")
    bad = vllm_imports_outside_compat(tmp_path / "vllm_hisparse")
    assert len(bad) == 4, bad


def test_compat_modules_export_what_they_define():
    """Every public name of a concern module is in its ``__all__`` (so ``compat`` re-exports
    it), and no two modules export one name for different objects."""
    seen: dict[str, object] = {}
    for module in compat.MODULES:
        public = {n for n, v in vars(module).items() if not n.startswith("_")
                  and not inspect.ismodule(v) and getattr(v, "__module__", module.__name__) != "typing"
                  and n not in ("annotations", "TYPE_CHECKING", "Any", "Callable")}
        exported = {n for m in compat.MODULES for n in m.__all__}
        assert public <= exported, (module.__name__, sorted(public - exported))
        for name in module.__all__:
            assert getattr(compat, name) is getattr(module, name)
            assert seen.setdefault(name, getattr(module, name)) is getattr(module, name), name


@functools.lru_cache(maxsize=1)
def _package_touches() -> frozenset[tuple[str, str]]:
    return frozenset(static_touches(PACKAGE) | subclass_touches(PACKAGE))


def test_every_touch_the_scan_finds_is_in_the_table():
    touches = _package_touches()
    # The scan sees the known ones (a scan that finds nothing passes vacuously).
    for expected in [("vllm_hisparse.vllm.compat.connectors:connector_is_registered", "_registry"),
                     ("vllm_hisparse.vllm.compat.kv_cache_manager:set_admission_watermark_blocks",
                      "watermark_blocks"),
                     ("vllm_hisparse.vllm.compat.group_roles:residency_manager_registered",
                      "_REGISTRY_ROLE_MANAGERS"),
                     ("vllm_hisparse.vllm.compat.group_roles:assign_group_role", "role"),
                     ("vllm_hisparse.vllm.compat.scheduler:request_load_before_forward",
                      "has_sync_kv_loads"),
                     ("vllm_hisparse.vllm.scheduler_side.managers", "_partial_hit_reqs"),
                     ("vllm_hisparse.vllm.scheduler_side.managers", "get_num_blocks_to_allocate"),
                     ("vllm_hisparse.vllm.scheduler_side.managers", "retains_longer_hit"),
                     ("vllm_hisparse.vllm.setup.kv_planner", "get_kv_cache_groups"),
                     ("vllm_hisparse.vllm.patches.attention", "_convert_once")]:
        assert expected in touches, expected
    assert uncovered(set(touches)) == []


def test_removing_a_record_uncovers_its_touches():
    touches = set(_package_touches())
    found_by_scan = []
    for change in patches.OBJECT_CHANGES:
        rest = tuple(c for c in patches.OBJECT_CHANGES if c is not change)
        if uncovered(touches, rest):
            found_by_scan.append(change.name)
    # Records of reads of public-looking internals (block tables, prefix-cache geometry,
    # a layer's index group) are kept by their site check, not by the scan.
    assert {"connector_registry", "admission_watermark", "residency_group_role", "offloading_scope",
            "manager_tables", "manager_longer_hit", "manager_allocation_count", "load_before_forward",
            "planner_builder", "lockstep_internals", "residency_manager_registry",
            "v2_runner_reasons", "connector_metadata", "prom_metric_classes",
            "offline_engine_config", "request_max_tokens", "prefix_lookup_counter"} <= set(found_by_scan)


def test_the_scan_can_fail(tmp_path):
    pkg = tmp_path / "vllm_hisparse" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sneaky.py").write_text(
        "def f(kv_cache_manager, scheduler_output, factory):\n"
        "    kv_cache_manager.watermark_blocks = 3\n"
        "    scheduler_output.has_sync_kv_loads = True\n"
        "    return factory._registry, getattr(factory, '_get_connector_metadata')\n")
    touches = static_touches(tmp_path / "vllm_hisparse")
    assert touches == {("vllm_hisparse.vllm.sneaky", n) for n in
                       ("watermark_blocks", "has_sync_kv_loads", "_registry", "_get_connector_metadata")}
    assert len(uncovered(touches)) == 4


@pytest.mark.parametrize("change", patches.OBJECT_CHANGES, ids=lambda c: c.name)
def test_every_record_sites_make_the_change(change):
    assert site_problems(change) == []


def test_site_check_can_fail():
    change = object_changes.ADMISSION_WATERMARK
    moved = dataclasses.replace(change, sites=("vllm_hisparse.vllm.setup.config",))
    assert site_problems(moved) == [
        "admission_watermark: site vllm_hisparse.vllm.setup.config neither calls compat."
        "('admission_watermark_blocks', 'set_admission_watermark_blocks') nor touches "
        "('watermark_blocks',)"]
    gone = dataclasses.replace(change, sites=("vllm_hisparse.vllm.no_such",))
    assert site_problems(gone)[0] == "admission_watermark: site vllm_hisparse.vllm.no_such does not exist"
    invented = dataclasses.replace(object_changes.MANAGER_LONGER_HIT, names=("retains_longer_hit", "no_such"))
    assert site_problems(invented) == ["manager_longer_hit: no site (nor compat) touches 'no_such'"]


def _doc_section(text: str, heading: str) -> str:
    start = text.index(heading)
    level = heading.split(" ")[0]
    rest = text[start + len(heading):]
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", rest, re.M)]
    return rest[:ends[0]] if ends else rest


def test_the_integration_doc_names_every_patch_and_object_change():
    """docs/vllm-integration.md lists every record in "Runtime patches", and its "Upstream
    proposal" says for each what would make it unnecessary."""
    text = (REPO / "docs" / "vllm-integration.md").read_text()
    patches_section = _doc_section(text, "## Runtime patches")
    proposal = _doc_section(text, "### Upstream proposal")
    names = [p.name for p in patches.PATCHES] + [c.name for c in patches.OBJECT_CHANGES]
    assert [n for n in names if f"| `{n}` |" not in patches_section] == []
    assert [n for n in names if f"`{n}`" not in proposal] == []
