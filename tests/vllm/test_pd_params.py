"""``kv_transfer_params`` are untrusted input: every field the decode side uses is checked
(``vllm_hisparse.vllm.pd.transfer_params``), and each refusal names the field and the problem.

At arrival (``parse_remote_prefill``), once the imported token count is known
(``check_import_coverage``) and, on the worker, against the prefill's registration before
any read is prepared (``check_registered_blocks``). The requests these refusals end, alone,
on vLLM's real Scheduler: tests/vllm/test_pd_scheduler.py; through real NIXL:
tests/vllm/test_pd_fuzz.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.vllm.pd_fakes import remote_params
from vllm_hisparse.vllm.pd.transfer_params import (
    MAX_BLOCK_GROUPS,
    MAX_TP_SIZE,
    InvalidTransferParams,
    check_import_coverage,
    check_registered_blocks,
    parse_remote_prefill,
)

MAX_BLOCKS = 20
GOOD = remote_params(600, 64)  # 10 pages in blocks 100..109


def _refusal(params) -> InvalidTransferParams:
    with pytest.raises(InvalidTransferParams) as info:
        parse_remote_prefill(params, max_blocks=MAX_BLOCKS)
    return info.value


@pytest.mark.parametrize("change, field, problem", [
    # the flag and the params themselves
    ({"do_remote_prefill": "yes"}, "do_remote_prefill", "'yes' (str) is not a boolean"),
    ({"do_remote_prefill": 1}, "do_remote_prefill", "1 (int) is not a boolean"),
    # required keys
    ({"remote_engine_id": None}, "remote_engine_id", "is missing"),
    ({"remote_block_ids": None}, "remote_block_ids", "is missing"),
    ({"tp_size": None}, "tp_size", "is missing"),
    # identifiers that go on the wire
    ({"remote_engine_id": 7}, "remote_engine_id", "7 (int) is not a string"),
    ({"remote_engine_id": ""}, "remote_engine_id", "has 0 characters"),
    ({"remote_engine_id": "e" * 300}, "remote_engine_id", "has 300 characters"),
    ({"remote_engine_id": "a b"}, "remote_engine_id", "is not an engine id"),
    ({"remote_request_id": "a,b"}, "remote_request_id", "no space or comma"),
    ({"remote_request_id": "a\nHB:x"}, "remote_request_id", "is not a request id"),
    ({"remote_request_id": ["x"]}, "remote_request_id", "is not a string"),
    ({"remote_host": "10.0.0.1/evil"}, "remote_host", "is not a host name"),
    ({"remote_host": "h" * 300}, "remote_host", "has 300 characters"),
    ({"remote_port": "5601"}, "remote_port", "'5601' (str) is not an integer"),
    ({"remote_port": 5601.0}, "remote_port", "(float) is not an integer"),
    ({"remote_port": True}, "remote_port", "(bool) is not an integer"),
    ({"remote_port": 0}, "remote_port", "0 is outside 1..65535"),
    ({"remote_port": 1 << 70}, "remote_port", "is outside 1..65535"),
    ({"tp_size": 0}, "tp_size", "outside 1..64"),
    ({"tp_size": 10**9}, "tp_size", f"outside 1..{MAX_TP_SIZE}"),
    ({"tp_size": float("nan")}, "tp_size", "(float) is not an integer"),
    # modes this reader does not handle
    ({"pp_size": 2}, "pp_size", "pipeline-parallel prefills are not read"),
    ({"dcp_size": 4}, "dcp_size", "decode-context-parallel prefills are not read"),
    ({"pp_size": "1"}, "pp_size", "is not an integer"),
    ({"transfer_mode": "push"}, "transfer_mode", "only 'pull'"),
    # counts and generations
    ({"remote_num_tokens": -1}, "remote_num_tokens", "-1 is outside"),
    ({"remote_num_tokens": "600"}, "remote_num_tokens", "is not an integer"),
    ({"remote_registration_generation": -3}, "remote_registration_generation", "outside"),
    # block lists
    ({"remote_block_ids": "100,101"}, "remote_block_ids", "is not a list"),
    ({"remote_block_ids": {"0": [1]}}, "remote_block_ids", "is not a list"),
    ({"remote_block_ids": []}, "remote_block_ids", "is empty"),
    ({"remote_block_ids": [[]]}, "remote_block_ids", "every group is empty"),
    ({"remote_block_ids": [[1, 2], 3]}, "remote_block_ids", "group[1] 3 (int) is not a list"),
    ({"remote_block_ids": [-1, 2]}, "remote_block_ids", "block -1 (outside 1..2^31-1)"),
    ({"remote_block_ids": [0, 2]}, "remote_block_ids", "block 0 (vLLM's null block)"),
    ({"remote_block_ids": [[1, 1 << 40]]}, "remote_block_ids", "group[0] holds block 1099511627776"),
    ({"remote_block_ids": [1, 2, 1]}, "remote_block_ids", "names block 1 twice"),
    ({"remote_block_ids": [[1, 2.5]]}, "remote_block_ids", "holds 2.5 (float), not a block id"),
    ({"remote_block_ids": [[1, True]]}, "remote_block_ids", "holds True (bool), not a block id"),
    ({"remote_block_ids": [[1, None]]}, "remote_block_ids", "holds None (NoneType)"),
    ({"remote_block_ids": list(range(1, 30))}, "remote_block_ids", "names 29 blocks, more than"),
    ({"remote_block_ids": [[1]] * (MAX_BLOCK_GROUPS + 1)}, "remote_block_ids",
     f"names {MAX_BLOCK_GROUPS + 1} block groups"),
])
def test_a_bad_field_is_named(change, field, problem):
    error = _refusal({**GOOD, **change})
    assert error.field == field and problem in error.problem, error
    assert str(error).startswith(f"kv_transfer_params.{field}: ")


def test_params_that_are_not_an_object():
    error = _refusal([("do_remote_prefill", True)])
    assert error.field == "kv_transfer_params" and "(list) is not an object" in str(error)


def test_good_params_and_their_defaults():
    remote = parse_remote_prefill(GOOD, max_blocks=MAX_BLOCKS)
    assert remote.block_ids == (tuple(range(100, 110)),) and remote.num_tokens == 600
    lean = {k: GOOD[k] for k in ("do_remote_prefill", "remote_block_ids", "remote_engine_id",
                                 "remote_request_id", "remote_host", "remote_port", "tp_size")}
    remote = parse_remote_prefill(lean, max_blocks=MAX_BLOCKS)
    assert (remote.num_tokens, remote.generation) == (0, 0)
    for host in ("prefill-0.example.com", "::1", "fe80::1%eth0", "10.1.2.3"):
        assert parse_remote_prefill({**GOOD, "remote_host": host}, max_blocks=MAX_BLOCKS).host == host
    groups = parse_remote_prefill({**GOOD, "remote_block_ids": [[1, 2], [], [3, 4]]}, max_blocks=MAX_BLOCKS)
    assert groups.block_ids == ((1, 2), (), (3, 4))  # an empty group is one this reader never reads


def test_coverage_of_the_imported_tokens():
    remote = parse_remote_prefill(GOOD, max_blocks=MAX_BLOCKS)
    check_import_coverage(remote, 599, 64)  # 10 pages
    with pytest.raises(InvalidTransferParams, match=r"group \[0\] names 10 blocks; importing 641 "
                                                    r"tokens reads 11 pages"):
        check_import_coverage(remote, 641, 64)
    short = parse_remote_prefill({**GOOD, "remote_num_tokens": 300}, max_blocks=MAX_BLOCKS)
    with pytest.raises(InvalidTransferParams, match="remote_num_tokens: the prefill computed 300 "
                                                    "tokens; this request imports 599"):
        check_import_coverage(short, 599, 64)


def _page(group: int, num_blocks: int) -> SimpleNamespace:
    """What the handshake says of one layer (``nixl_transport.RemotePage``'s fields used)."""
    return SimpleNamespace(group=group, num_blocks=num_blocks)


def test_blocks_against_the_prefills_registration():
    remote = parse_remote_prefill({**GOOD, "remote_block_ids": [[1, 2, 3], [7, 8, 90]]},
                                  max_blocks=MAX_BLOCKS)
    registration = {"mla": _page(0, 10), "idx": _page(1, 100)}
    check_registered_blocks(remote, registration, ["mla", "idx"], 3)
    with pytest.raises(InvalidTransferParams, match=r"group \[1\] names block 90, outside the "
                                                    "prefill's registered region of 50 blocks"):
        check_registered_blocks(remote, {**registration, "idx": _page(1, 50)},
                                ["mla", "idx"], 3)
    with pytest.raises(InvalidTransferParams, match="names 2 block groups; the prefill holds "
                                                    "layer 'x' in group 2"):
        check_registered_blocks(remote, {"x": _page(2, 50)}, ["x"], 3)
    with pytest.raises(InvalidTransferParams, match=r"group \[0\] names 3 blocks; the import reads 4"):
        check_registered_blocks(remote, registration, ["mla"], 4)
