"""The ``vllm.general_plugins`` entry point: registration, the planner hook, inertness."""

from __future__ import annotations

import ast
import logging
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma
from vllm.platforms.interface import Platform

from vllm_hisparse.vllm.simulation.model import kv_transfer_config, make_vllm_config
import vllm_hisparse
from vllm_hisparse.vllm import compat, patches, plugin
from vllm_hisparse.vllm.setup.config import HiSparseConfigError
from vllm_hisparse.vllm.setup.config import BUILDER_QUALNAME
from vllm_hisparse.vllm.setup.kv_planner import select_builder
from vllm_hisparse.vllm.plugin import register

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_entry_point_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = project["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"hisparse_residency": "vllm_hisparse.vllm.plugin:register"}


def test_register_is_idempotent_and_resolves_the_name():
    register()
    register()  # a second process-level call must not raise "already registered"
    cls = KVConnectorFactory.get_connector_class_by_name("HiSparseResidencyConnector")
    from vllm_hisparse.connector import HiSparseResidencyConnector

    assert cls is HiSparseResidencyConnector
    assert supports_hma(cls)
    assert cls.get_required_kvcache_layout(None) == "BLHNC"
    assert patches.PLANNER_HOOK.installed()


def test_nothing_is_named_like_the_in_tree_switch():
    """The literal name HiSparseConnector turns on vLLM's in-tree HiSparse."""
    package = ROOT / "vllm_hisparse"
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.Name)):
                assert getattr(node, "name", getattr(node, "id", None)) != "HiSparseConnector", path
            if isinstance(node, ast.Constant):
                assert node.value != "HiSparseConnector", path
    assert "HiSparseConnector" in KVConnectorFactory._registry  # vLLM's own, untouched


def test_vllm_config_accepts_the_connector(dsa_model_dir):
    """VllmConfig resolves the class by name while validating (HMA support check)."""
    for multi in (False, True):
        vllm_config = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config(under_multi=multi))
        assert KVConnectorFactory.supports_hma_config(vllm_config.kv_transfer_config) or multi


def test_planner_hook_is_inert_unless_configured(dsa_model_dir):
    plain = make_vllm_config(dsa_model_dir)
    other = make_vllm_config(dsa_model_dir)
    other.kv_transfer_config = None
    ours = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    assert select_builder(plain) is None and select_builder(other) is None
    assert Platform.get_kv_cache_config_builder_cls(plain) == compat.DEFAULT_BUILDER_QUALNAME
    assert Platform.get_kv_cache_config_builder_cls(ours) == BUILDER_QUALNAME


def test_planner_hook_refuses_to_replace_a_vendor_builder(dsa_model_dir, monkeypatch):
    ours = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    assert patches.PLANNER_HOOK.remove()
    try:
        monkeypatch.setattr(
            Platform, "get_kv_cache_config_builder_cls", classmethod(lambda cls, cfg: "vendor.Builder")
        )
        assert patches.PLANNER_HOOK.install(select_builder)
        assert not patches.PLANNER_HOOK.install(select_builder)  # idempotent
        with pytest.raises(ValueError, match="selects the KV cache config builder 'vendor.Builder'"):
            Platform.get_kv_cache_config_builder_cls(ours)
    finally:
        patches.PLANNER_HOOK.remove()
        monkeypatch.undo()
        assert patches.PLANNER_HOOK.install(select_builder)
    assert Platform.get_kv_cache_config_builder_cls(ours) == BUILDER_QUALNAME


def test_connector_construction_is_honest(dsa_model_dir):
    """Config errors first; a missing KV cache config is a clear error, in both roles."""
    from vllm_hisparse.connector import HiSparseResidencyConnector

    bad = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    # Changed after the VllmConfig check (which would have refused it): the connector
    # still checks in its own process.
    bad.kv_transfer_config.kv_connector_extra_config["host_pool_gib"] = 0
    with pytest.raises(HiSparseConfigError, match="host_pool_gib=0"):
        HiSparseResidencyConnector(bad, KVConnectorRole.SCHEDULER, None)
    good = make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match="needs the engine's KV cache config"):
            HiSparseResidencyConnector(good, role, None)


def test_register_logs_name_and_version_once(monkeypatch, caplog, dsa_model_dir):
    monkeypatch.setattr(plugin, "_announced", False)
    with caplog.at_level(logging.INFO, logger="vllm_hisparse.vllm.plugin"):
        register()
        register()
        make_vllm_config(dsa_model_dir, kv_transfer=kv_transfer_config())
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm_hisparse.vllm.plugin"
             and r.levelno == logging.INFO]
    assert lines == [f"vllm_hisparse {vllm_hisparse.__version__}: plugin hisparse_residency "
                     "registered the KV connector HiSparseResidencyConnector"]
    assert patches.CONFIG_CHECK.installed()


@pytest.mark.slow  # a fresh interpreter importing vLLM: 9-12 s on 2 cores
def test_plugin_lines_reach_vllms_log_output(dsa_model_dir):
    """A process set up like ``vllm serve``: vLLM loads the entry point, then configures its
    logging, then builds the config. Our lines are printed through vLLM's handler."""
    code = (
        "import logging, pathlib\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "load_general_plugins()\n"
        "configure_logging(LoggingConfig())\n"
        "from vllm_hisparse.vllm.simulation.model import kv_transfer_config, make_vllm_config\n"
        f"make_vllm_config(pathlib.Path({str(dsa_model_dir)!r}), kv_transfer=kv_transfer_config())\n"
        "logging.getLogger('vllm_hisparse.vllm.scheduler_side.role').info('capacity table')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_PLUGINS="hisparse_residency")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert output.count(f"vllm_hisparse {vllm_hisparse.__version__}: plugin hisparse_residency") == 1, output
    assert "capacity table" in output


@pytest.mark.slow
def test_hand_built_config_needs_the_plugin_loaded(dsa_model_dir):
    """What docs/troubleshooting.md says: without register() (load_general_plugins), vLLM
    cannot resolve the connector name while it builds the VllmConfig."""
    code = (
        "from vllm_hisparse.vllm.simulation.model import kv_transfer_config, make_vllm_config\n"
        "import pathlib, sys\n"
        "try:\n"
        f"    make_vllm_config(pathlib.Path({str(dsa_model_dir)!r}), kv_transfer=kv_transfer_config())\n"
        "except Exception as e:\n"
        "    print('ERROR', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_PLUGINS="")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert "Unsupported connector type: HiSparseResidencyConnector" in run.stdout, run.stdout + run.stderr
