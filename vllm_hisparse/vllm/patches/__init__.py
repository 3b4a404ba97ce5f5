"""Every runtime patch this package applies to vLLM 0.33, in one table (:data:`PATCHES`), and
every other change it makes to vLLM's objects, in a second (:data:`OBJECT_CHANGES`,
``object_changes.py``: attribute writes, overrides of vLLM internals, private reads).

A patch replaces one vLLM attribute with a wrapper (or, in the CPU simulator, a pure-torch
twin). Each is a :class:`Patch` record with the same three verbs:

* ``install(...)`` puts the replacement in place and returns True; False when it is
  already there (idempotent: a marker attribute on the replacement says so);
* ``installed(...)`` says whether it is in place;
* ``remove(...)`` puts vLLM's original back and returns True; False when nothing was
  installed.

Class- and module-level patches take no object argument; per-object patches
(``layer_forward_context``, ``cpu_group_conversion``, ``lockstep_coordinator``) take the
object first. Nothing is
installed at import. ``tests/vllm/test_patches.py`` checks each patch against the installed
vLLM: it installs, is seen installed, is reached through vLLM's own entry point, and its
removal restores vLLM's original object.

Who installs what: the plugin's ``register()`` the planner hook, the config check and the
capacity line; the scheduler role, when it binds the KV cache manager, the lockstep
coordinator; the worker role, when it
binds the KV caches, the top-k conversion hook, the direct conversion routing and (per bound
layer) the layer forward context; the CPU simulator, for one run, the two CPU twins.
"""

from __future__ import annotations

from vllm_hisparse.vllm.patches.attention import (CPU_DIRECT_CONVERSION, CPU_GROUP_CONVERSION,
                                                  DIRECT_CONVERSION_ROUTING, INDEXER_SCORES,
                                                  LAYER_FORWARD_CONTEXT, TOPK_CONVERSION_HOOK,
                                                  current_sparse_layer, sparse_layer_context)
from vllm_hisparse.vllm.patches.engine import (CAPACITY_LINE, CONFIG_CHECK,
                                               LOCKSTEP_COORDINATOR, PLANNER_HOOK)
from vllm_hisparse.vllm.patches.object_changes import OBJECT_CHANGES, ObjectChange, object_change
from vllm_hisparse.vllm.patches.object_changes import check as check_object_changes
from vllm_hisparse.vllm.patches.record import Patch

#: Every runtime patch of vLLM this package applies.
PATCHES: tuple[Patch, ...] = (PLANNER_HOOK, TOPK_CONVERSION_HOOK, DIRECT_CONVERSION_ROUTING,
                              LAYER_FORWARD_CONTEXT, INDEXER_SCORES, CPU_DIRECT_CONVERSION,
                              CPU_GROUP_CONVERSION, CONFIG_CHECK, CAPACITY_LINE,
                              LOCKSTEP_COORDINATOR)

def by_name(name: str) -> Patch:
    """The patch called ``name``; ``KeyError`` naming the known ones otherwise."""
    for patch in PATCHES:
        if patch.name == name:
            return patch
    raise KeyError(f"no vLLM patch named {name!r}; known: {[p.name for p in PATCHES]}")
