"""Without the CUDA extension the ops fall back to the reference twins and say so once."""

from __future__ import annotations

import logging

import pytest

from vllm_hisparse.ops import _extension


@pytest.fixture
def no_extension(monkeypatch):
    _extension.load.cache_clear()
    _extension.warn_if_unavailable.cache_clear()
    monkeypatch.setattr(_extension, "load", lambda: (None, "vllm_hisparse._C could not be "
                                                           "imported (test)"))
    yield
    _extension.warn_if_unavailable.cache_clear()


def test_fallback_is_logged_once(no_extension, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm_hisparse.ops"):
        assert _extension.warn_if_unavailable() is False
        assert _extension.warn_if_unavailable() is False
    warnings = [r for r in caplog.records if "reference ops" in r.getMessage()]
    assert len(warnings) == 1
    assert "could not be imported (test)" in warnings[0].getMessage()


def test_extension_is_importable_when_built():
    """When the build found a CUDA toolkit the module must import (no silent fallback)."""
    import shutil
    module, why = _extension.load()
    if shutil.which("nvcc") is None:
        pytest.skip("no CUDA toolkit on this machine: the pure-Python install is expected")
    assert module is not None, why


def test_extension_loader_imports_nothing_of_the_package():
    """ops/_extension.py is the bottom of the ops package: ops.cuda and the dispatch import it,
    it imports neither (the former _extension <-> cuda cycle)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(_extension.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert [m for m in imported if m and m.startswith("vllm_hisparse.ops")] == []
