"""Real ``vllm.config`` objects for a tiny offline DSA model (no Hub access, no GPU).

The generator lives in the package (``vllm_hisparse.vllm.simulation.model``) because
``vllm-hisparse simulate`` needs it too; this module re-exports it for the tests.
"""

from __future__ import annotations

from vllm.config import SpeculativeConfig  # noqa: F401  (re-exported for tests that need it)

from vllm_hisparse.vllm.simulation.model import (  # noqa: F401  (re-exports)
    CONNECTOR,
    DSV32_TINY,
    kv_transfer_config,
    make_vllm_config,
    write_model_dir,
)
