"""Whether this decode instance reads P/D requests itself: the composition check of the
``kv_transfer_config`` (this connector alone as ``kv_consumer``, or the first child of a
MultiConnector). A NixlConnector consumer listed before it would claim P/D requests and fail
to load them: refused at startup."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_hisparse.vllm import compat
from vllm_hisparse.vllm.setup.config import CONNECTOR_NAME, HiSparseConfigError
from vllm_hisparse.vllm.setup.connector_entries import MULTI_CONNECTOR, connector_entries

#: ``kv_role`` of our entry that makes this instance a P/D decode consumer (``kv_both``, the
#: colocated default, does not: it would need NIXL on every instance).
_CONSUMER_ROLES = ("kv_consumer",)



@dataclass(frozen=True)
class PDComposition:
    """Whether this connector reads P/D requests, why not, and the settings of a
    NixlConnector child (``backends``, ``enforce_handshake_compat``), if one is composed."""

    enabled: bool
    reason: str
    nixl_extra_config: dict


def pd_composition(kv: Any) -> PDComposition:
    """Read the composing ``kv_transfer_config`` (``compat.composing_kv_transfer_config``:
    a MultiConnector child sees only its own entry). Raises :class:`HiSparseConfigError`
    when a NixlConnector consumer is listed before this connector."""
    if kv is None:
        return PDComposition(False, "no kv_transfer_config", {})
    if kv.kv_connector == CONNECTOR_NAME:
        if kv.kv_role not in _CONSUMER_ROLES:
            return PDComposition(False, f"kv_role={kv.kv_role!r} is not a consumer", {})
        return PDComposition(True, "", {})
    if kv.kv_connector != MULTI_CONNECTOR:
        return PDComposition(False, f"kv_connector={kv.kv_connector!r}", {})
    children = [entry for entry in connector_entries(kv.kv_connector, kv.kv_connector_extra_config)
                if entry.depth == 1]
    ours = next((entry for entry in children if entry.name == CONNECTOR_NAME), None)
    if ours is None:
        return PDComposition(False, "nested MultiConnector", {})
    nixl = [entry for entry in children if entry.name in compat.NIXL_PULL_CONNECTORS
            and entry.child.get("kv_role", kv.kv_role) in ("kv_consumer", "kv_both")]
    extra = dict(nixl[0].extra) if nixl else {}
    if nixl and nixl[0].index < ours.index:
        raise HiSparseConfigError(
            f"kv_transfer_config lists {nixl[0].name} (kv_consumer) before {CONNECTOR_NAME}: "
            "vLLM lets the first child that reports tokens load a request, and NixlConnector "
            f"cannot read into {CONNECTOR_NAME}'s KV plan (it refuses: packed KV block rows "
            f"differ between P and D); accepted: {CONNECTOR_NAME} first, which reads P/D "
            "requests itself (NixlConnector is then not needed on the decode instance)")
    role = ours.child.get("kv_role", kv.kv_role)
    if role not in _CONSUMER_ROLES:
        return PDComposition(False, f"kv_role={role!r} is not a consumer", extra)
    if ours.index != 0:
        return PDComposition(False, f"{CONNECTOR_NAME} is not the first MultiConnector child "
                             "(the first child that reports tokens loads a request)", extra)
    return PDComposition(True, "", extra)
