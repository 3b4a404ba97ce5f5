"""Packaging metadata (issue 18 item 5): the version is written once, the license is an SPDX
expression, the project URLs are set. ``pyproject.toml`` only, no build (a build compiles the
CUDA extension where ``nvcc`` is found)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import vllm_hisparse

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_version_is_written_once_in_the_package():
    project, build = PYPROJECT["project"], PYPROJECT["tool"]["scikit-build"]
    assert "version" not in project and "version" in project["dynamic"]
    source = build["metadata"]["version"]
    assert source["provider"] == "scikit_build_core.metadata.regex"
    text = (ROOT / source["input"]).read_text()
    # scikit-build-core's default regex: the assignment to __version__.
    (written,) = re.findall(r'(?m)^__version__\s*=\s*"([^"]+)"', text)
    assert written == vllm_hisparse.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?", written)


def test_spdx_license_and_a_build_backend_that_accepts_it():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    (backend,) = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("scikit-build")]
    minimum = tuple(int(x) for x in re.search(r">=([\d.]+)", backend).group(1).split("."))
    assert minimum >= (0, 11)  # 0.10 refuses a string license (PEP 639): measured


def test_project_urls():
    urls = PYPROJECT["project"]["urls"]
    assert {"Source", "Documentation", "Issues", "Changelog"} <= set(urls)
    assert all(url.startswith("https://") for url in urls.values())
