"""The ``vllm.general_plugins`` entry point: ``hisparse_residency``.

vLLM calls ``register()`` in every process it starts (API server, engine core,
workers) before any ``VllmConfig`` exists, so this function cannot know whether the
connector will be used. It therefore only does things that are inert unless a
config names ``HiSparseResidencyConnector``:

1. registers the connector class with vLLM's ``KVConnectorFactory`` under that name
   (lazy: the module is imported only when a config asks for it);
2. installs the planner hook (``patches.PLANNER_HOOK``), whose callback returns
   our KV-cache config builder only for configs that name the connector;
3. installs the config check (``patches.CONFIG_CHECK``): every ``VllmConfig`` built from then
   on validates our ``kv_connector_extra_config`` (top level or MultiConnector child) and
   refuses every engine option the connector cannot run under (``engine_checks.py``), so
   ``vllm serve`` stops in the API-server process, before any weights load;
4. installs the capacity line (``patches.CAPACITY_LINE``): for configs that name the
   connector, vLLM's startup "Maximum concurrency" line reports the startup capacity
   report's steady-state figure (hybrid residency) instead of full residency's;
5. sends this package's log records to vLLM's log handler (vLLM configures only its own
   ``vllm`` logger; without this, our INFO lines, e.g. the startup capacity table, would
   not be printed).

It logs one INFO line (package and version) per process. Calling ``register()`` again
is a no-op.

A ``VllmConfig`` built by hand (a script, a test) before vLLM loaded its plugins has no
connector registered under our name and no config check: call
``vllm.plugins.load_general_plugins()`` first (``vllm serve``, ``LLM(...)`` and
``EngineArgs`` do it themselves), see docs/troubleshooting.md.
"""

from __future__ import annotations

import logging

import vllm_hisparse
from vllm_hisparse.vllm import compat, patches
from vllm_hisparse.vllm.setup.config import (
    CONNECTOR_MODULE,
    CONNECTOR_NAME,
    is_connector_configured,
)
from vllm_hisparse.vllm.setup.capacity_report import engine_capacity_report
from vllm_hisparse.vllm.setup.engine_checks import check_after_vllm, check_before_vllm, resolve_config
from vllm_hisparse.vllm.setup.kv_planner import select_builder

logger = logging.getLogger(__name__)

#: The entry point's name in pyproject.toml.
PLUGIN_NAME = "hisparse_residency"

#: The logger every module of the package logs under.
PACKAGE_LOGGER = "vllm_hisparse"

_announced = False


class _ToVllmHandlers(logging.Handler):
    """Hands our records to the handlers of vLLM's ``vllm`` logger, whatever they are when
    the record is emitted: ``vllm serve`` configures its logging only after it loaded the
    plugins, and each engine process configures it again."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _route_logs_to_vllm() -> None:
    """Print the package's records through vLLM's log output, unless the application
    configured logging itself (a handler or level on our logger or on the root).

    Records still propagate, so pytest's caplog and root handlers added later see them."""
    ours = logging.getLogger(PACKAGE_LOGGER)
    if ours.handlers or ours.level != logging.NOTSET or logging.getLogger().handlers:
        return
    ours.addHandler(_ToVllmHandlers())
    ours.setLevel(logging.INFO)


def _vllm_logging_configured() -> bool:
    return bool(logging.getLogger("vllm").handlers)


def _announce() -> None:
    """The one INFO line per process: package, version, what it registered."""
    global _announced
    if not _announced:
        _announced = True
        logger.info("vllm_hisparse %s: plugin %s registered the KV connector %s",
                    vllm_hisparse.__version__, PLUGIN_NAME, CONNECTOR_NAME)


def _check_config(vllm_config) -> None:
    # vllm serve configures logging after loading plugins: the first config built
    # afterwards announces the plugin, so the line is printed in the API server too.
    _announce()
    check_before_vllm(vllm_config)


def _max_concurrency(vllm_config, kv_cache_config) -> float | None:
    """What vLLM's "Maximum concurrency" line reports for our configs: the startup
    capacity report's steady state (``capacity_report.engine_capacity_report``); None keeps
    vLLM's figure for every other config."""
    if not is_connector_configured(vllm_config):
        return None
    report = engine_capacity_report(vllm_config, kv_cache_config, resolve_config(vllm_config))
    logger.info("%s: vLLM's maximum concurrency line reports hybrid residency in steady "
                "state: %d requests of %d tokens (full residency: %d, at admission: %d)",
                CONNECTOR_NAME, report.max_concurrency_steady, vllm_config.model_config.max_model_len,
                report.max_concurrency_without_residency, report.max_concurrency_at_admission)
    return float(report.max_concurrency_steady)


def register() -> None:
    """Register the connector, hook KV planning and config validation; idempotent."""
    if compat.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME):
        logger.debug("registered %s from %s", CONNECTOR_NAME, CONNECTOR_MODULE)
    if patches.PLANNER_HOOK.install(select_builder):
        logger.debug("installed the vllm_hisparse KV planner hook")
    if patches.CONFIG_CHECK.install(_check_config, check_after_vllm):
        logger.debug("installed the vllm_hisparse VllmConfig check")
        _route_logs_to_vllm()
    if patches.CAPACITY_LINE.install(_max_concurrency):
        logger.debug("installed the vllm_hisparse capacity line")
    if _vllm_logging_configured():
        _announce()
