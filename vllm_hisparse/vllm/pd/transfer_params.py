"""A P/D request's ``kv_transfer_params``: untrusted input, checked before anything uses it.

The decode instance learns where a prefill holds a request's KV from the request body: the
proxy forwards what the prefill returned, and any client can send its own. Everything the
decode side uses from it is therefore checked, in two places:

* **at arrival** (scheduler role, :func:`parse_remote_prefill` when vLLM adds the request and
  offers it, :func:`check_import_coverage` once the imported token count is known): types,
  ranges, required keys, identifiers that go on the wire (engine and request ids, host,
  port), block lists (flat or per group, no duplicates, no null block, not longer than a
  ``max_model_len`` request), the block count against the tokens imported, the parallel and
  transfer modes this reader handles;
* **after the handshake** (worker role, :func:`check_registered_blocks`, before any NIXL
  descriptor is prepared): every block the import reads lies inside the prefill's registered
  region of its layer, and every layer's group has a block list.

A failed check raises :class:`InvalidTransferParams` naming the field and the problem; the
request is then refused alone (``pd/landings.py``: a ``REFUSE`` order, reported in
``failed_recving``, so vLLM fails or recomputes it as ``kv_load_failure_policy`` says), and
nothing is contacted on its behalf.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_hisparse.core.units import cdiv
from vllm_hisparse.vllm.pd.import_order import RemotePrefill

#: The fields an import needs (vLLM's NixlConnector, pull mode, puts them in the params).
REQUIRED_PARAMS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                   "remote_port", "tp_size")
#: Largest prefill tensor-parallel size accepted: rank 0 queries and notifies every prefill
#: rank, so this bounds the side-channel work one request can cause.
MAX_TP_SIZE = 64
#: Most KV cache groups (block lists) a prefill may name.
MAX_BLOCK_GROUPS = 16
#: Block ids are int32 on both sides.
MAX_BLOCK_ID = (1 << 31) - 1
#: vLLM's null block (``BlockPool`` block 0): a page the prefill does not hold.
NULL_BLOCK_ID = 0
MAX_ENGINE_ID_CHARS = 256
MAX_REQUEST_ID_CHARS = 1024
MAX_HOST_CHARS = 253
#: The only transfer mode this reader speaks (NixlConnector's ``_TRANSFER_MODE``).
PULL_MODE = "pull"

# Printable ASCII without space. Request ids also exclude "," (the "HB:<ids>" lease
# renewal joins them with commas: one id must not renew another's lease).
_ID = re.compile(r"[\x21-\x7e]+")
_REQUEST_ID = re.compile(r"[\x21-\x2b\x2d-\x7e]+")
# Host names, IPv4 and (bare) IPv6 addresses with an optional zone.
_HOST = re.compile(r"[A-Za-z0-9._:%-]+")


class InvalidTransferParams(ValueError):
    """A request's ``kv_transfer_params`` cannot be imported: ``field`` names the key (or
    ``"kv_transfer_params"`` itself), ``problem`` what is wrong with it."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        self.problem = problem
        name = field if field == "kv_transfer_params" else f"kv_transfer_params.{field}"
        super().__init__(f"{name}: {problem}")


def _shown(value: Any) -> str:
    """A value for a message: short, and typed (``'5' (str)``)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _integer(params: Mapping, key: str, low: int, high: int) -> int:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTransferParams(key, f"{_shown(value)} is not an integer")
    if not low <= value <= high:
        raise InvalidTransferParams(key, f"{value} is outside {low}..{high}")
    return value


def _optional_integer(params: Mapping, key: str, default: int, low: int, high: int) -> int:
    if params.get(key) is None:
        return default
    return _integer(params, key, low, high)


def _identifier(params: Mapping, key: str, pattern: re.Pattern, max_chars: int, what: str) -> str:
    value = params[key]
    if not isinstance(value, str):
        raise InvalidTransferParams(key, f"{_shown(value)} is not a string")
    if not value or len(value) > max_chars:
        raise InvalidTransferParams(key, f"has {len(value)} characters; accepted: 1..{max_chars}")
    if not pattern.fullmatch(value):
        raise InvalidTransferParams(key, f"{_shown(value)} is not {what}")
    return value


def _block_groups(value: Any, max_blocks: int) -> tuple[tuple[int, ...], ...]:
    """``remote_block_ids``: a flat list (one group) or a list of per-group lists."""
    key = "remote_block_ids"
    if not isinstance(value, (list, tuple)):
        raise InvalidTransferParams(key, f"{_shown(value)} is not a list")
    if not value:
        raise InvalidTransferParams(key, "is empty: the prefill names no block")
    flat = all(isinstance(b, int) and not isinstance(b, bool) for b in value)
    groups = [value] if flat else value
    if len(groups) > MAX_BLOCK_GROUPS:
        raise InvalidTransferParams(key, f"names {len(groups)} block groups; accepted: at most "
                                    f"{MAX_BLOCK_GROUPS}")
    out = []
    for g, group in enumerate(groups):
        where = "" if flat else f"[{g}]"
        if not isinstance(group, (list, tuple)):
            raise InvalidTransferParams(key, f"group{where} {_shown(group)} is not a list of "
                                        "block ids (a flat list or a list of lists)")
        if len(group) > max_blocks:
            raise InvalidTransferParams(key, f"group{where} names {len(group)} blocks, more "
                                        f"than a max_model_len request holds ({max_blocks})")
        for block in group:
            if isinstance(block, bool) or not isinstance(block, int):
                raise InvalidTransferParams(key, f"group{where} holds {_shown(block)}, not a "
                                            "block id")
            if not NULL_BLOCK_ID < block <= MAX_BLOCK_ID:
                what = "vLLM's null block" if block == NULL_BLOCK_ID else "outside 1..2^31-1"
                raise InvalidTransferParams(key, f"group{where} holds block {block} ({what})")
        if len(set(group)) != len(group):
            seen: set[int] = set()
            for block in group:
                if block in seen:
                    raise InvalidTransferParams(key, f"group{where} names block {block} twice")
                seen.add(block)
        out.append(tuple(group))
    if not any(out):
        raise InvalidTransferParams(key, "every group is empty: the prefill names no block")
    return tuple(out)


def parse_remote_prefill(params: Any, *, max_blocks: int) -> RemotePrefill | None:
    """The remote prefill a request names, or None when it asks for none (no params, or
    ``do_remote_prefill`` absent or false: the request is computed here).

    ``max_blocks``: the most blocks one group may name (a ``max_model_len`` request's
    pages, plus slack for the prefill's sampled token). Raises
    :class:`InvalidTransferParams` for anything else this reader cannot import safely."""
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise InvalidTransferParams("kv_transfer_params", f"{_shown(params)} is not an object")
    flag = params.get("do_remote_prefill")
    if flag is None or flag is False:
        return None
    if flag is not True:
        raise InvalidTransferParams("do_remote_prefill", f"{_shown(flag)} is not a boolean")
    missing = [k for k in REQUIRED_PARAMS if params.get(k) is None]
    if missing:
        raise InvalidTransferParams(missing[0], "is missing (a remote prefill needs "
                                    f"{', '.join(REQUIRED_PARAMS)})")
    mode = params.get("transfer_mode")
    if mode is not None and mode != PULL_MODE:
        raise InvalidTransferParams("transfer_mode", f"{_shown(mode)}: only {PULL_MODE!r} "
                                    "(NixlConnector's pull mode) prefills are read")
    for key, what in (("pp_size", "pipeline"), ("dcp_size", "decode-context")):
        if _optional_integer(params, key, 1, 1, 1 << 16) != 1:
            raise InvalidTransferParams(key, f"{params[key]}: {what}-parallel prefills are not read")
    engine_id = _identifier(params, "remote_engine_id", _ID, MAX_ENGINE_ID_CHARS,
                            "an engine id (printable ASCII, no space)")
    request_id = _identifier(params, "remote_request_id", _REQUEST_ID, MAX_REQUEST_ID_CHARS,
                             "a request id (printable ASCII, no space or comma)")
    host = _identifier(params, "remote_host", _HOST, MAX_HOST_CHARS,
                       "a host name or IP address")
    port = _integer(params, "remote_port", 1, 65535)
    tp_size = _integer(params, "tp_size", 1, MAX_TP_SIZE)
    num_tokens = _optional_integer(params, "remote_num_tokens", 0, 0, MAX_BLOCK_ID)
    generation = _optional_integer(params, "remote_registration_generation", 0, 0, (1 << 63) - 1)
    return RemotePrefill(engine_id=engine_id, request_id=request_id, host=host, port=port,
                         tp_size=tp_size, block_ids=_block_groups(params["remote_block_ids"], max_blocks),
                         generation=generation, num_tokens=num_tokens)


def check_import_coverage(remote: RemotePrefill, num_tokens: int, block_size: int) -> None:
    """The prefill holds what an import of ``num_tokens`` positions reads: every non-empty
    block group covers its pages, and the prefill computed at least that many tokens (when
    it says, ``remote_num_tokens``). Raises :class:`InvalidTransferParams`."""
    pages = cdiv(num_tokens, block_size)
    for g, blocks in enumerate(remote.block_ids):
        if blocks and len(blocks) < pages:
            raise InvalidTransferParams(
                "remote_block_ids", f"group [{g}] names {len(blocks)} blocks; importing "
                f"{num_tokens} tokens reads {pages} pages of {block_size}")
    if remote.num_tokens and remote.num_tokens < num_tokens:
        raise InvalidTransferParams(
            "remote_num_tokens", f"the prefill computed {remote.num_tokens} tokens; this "
            f"request imports {num_tokens}")


def check_registered_blocks(remote: RemotePrefill, registration: Mapping[str, Any],
                            layers: Iterable[str], num_pages: int) -> None:
    """Worker side, after the handshake and before any read is prepared: for every layer
    the import reads, the prefill registers it (``registration[layer]`` has ``group`` and
    ``num_blocks``, ``nixl_transport.RemotePage``), the request names a block list for its
    group that covers ``num_pages``, and each of those blocks lies inside the registered
    region. Raises :class:`InvalidTransferParams` (the import fails alone)."""
    checked: set[tuple[int, int]] = set()
    for layer in layers:
        where = registration.get(layer)
        if where is None:
            continue  # the layout check names it (nixl_transport: "registers no layer")
        group = where.group
        if (group, where.num_blocks) in checked:
            continue
        if not 0 <= group < len(remote.block_ids):
            raise InvalidTransferParams(
                "remote_block_ids", f"names {len(remote.block_ids)} block groups; the prefill "
                f"holds layer {layer!r} in group {group}")
        blocks = remote.block_ids[group][:num_pages]
        if len(blocks) < num_pages:
            raise InvalidTransferParams(
                "remote_block_ids", f"group [{group}] names {len(remote.block_ids[group])} "
                f"blocks; the import reads {num_pages} pages")
        outside = [b for b in blocks if not 0 <= b < where.num_blocks]
        if outside:
            raise InvalidTransferParams(
                "remote_block_ids", f"group [{group}] names block {outside[0]}, outside the "
                f"prefill's registered region of {where.num_blocks} blocks")
        checked.add((group, where.num_blocks))
