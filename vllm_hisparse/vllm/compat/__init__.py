"""Every access this package makes to a vLLM 0.33 internal, in one place.

The rule: no module of the package outside this one imports vLLM, and every touch of a vLLM
internal (an import, a private name, an attribute of a vLLM object read or written) goes
through one small named function or constant here. vLLM's connector API is public, but
planning, scheduling and the factory registry are internal and move between releases, so an
upgrade touches this package only, and ``tests/vllm/test_compat.py`` /
``tests/vllm/test_compat_worker.py`` (which check every name and signature relied on here)
say exactly what moved. ``tests/vllm/test_object_changes.py`` enforces the rule.

One module per concern; callers use the names re-exported here
(``from vllm_hisparse.vllm import compat; compat.foo(...)``):

* ``connectors``: the connector API, the factory registry, MultiConnector composition;
* ``kv_planning``: the KV-cache config builder, spec and layout classes, the capacity line,
  the worker's KV allocation;
* ``group_roles``: the group role that selects our manager, the offloading scope;
* ``kv_cache_manager``: block pool, blocks, coordinator, per-group managers, the watermark;
* ``scheduler``: the scheduler classes, requests and scheduler outputs;
* ``attention``: the sparse-MLA read path (index group, indexer top-k, direct conversions);
* ``engine_config``: ``VllmConfig`` and what config time and the parallel layout read;
* ``simulator``: the engine pieces the CPU simulator drives;
* ``nixl``: the P/D decode consumer's side of NixlConnector;
* ``intree``: vLLM's in-tree HiSparse, for the comparison benchmarks;
* ``objects``: vLLM objects by dotted path, for the object-change table's shape checks.

Only accessors live here. The runtime patches this package applies to vLLM's functions are
the ``Patch`` records of ``vllm_hisparse/vllm/patches/`` (``patches.PATCHES``); every other
change it makes to vLLM's objects (attribute writes, overrides, private reads) is an
``ObjectChange`` record of ``patches.OBJECT_CHANGES``. docs/vllm-integration.md ("Runtime
patches") lists both tables.
"""

from __future__ import annotations

from vllm_hisparse.vllm.compat import (attention, connectors, engine_config, group_roles, intree,
                                       kv_cache_manager, kv_planning, nixl, objects, scheduler,
                                       simulator)
from vllm_hisparse.vllm.compat.attention import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.connectors import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.engine_config import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.group_roles import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.intree import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.kv_cache_manager import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.kv_planning import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.nixl import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.objects import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.scheduler import *  # noqa: F401,F403
from vllm_hisparse.vllm.compat.simulator import *  # noqa: F401,F403

#: The concern modules, in the order above.
MODULES = (connectors, kv_planning, group_roles, kv_cache_manager, scheduler, attention,
           engine_config, simulator, nixl, intree, objects)

__all__ = sorted({name for module in MODULES for name in module.__all__})
