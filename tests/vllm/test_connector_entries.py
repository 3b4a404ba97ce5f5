"""The one walk over a kv_transfer_config's connector entries (``connector_entries``)."""

from __future__ import annotations

import pytest

from vllm_hisparse.vllm.setup.connector_entries import connector_entries


def _multi(*children: dict) -> dict:
    return {"connectors": list(children)}


def test_entries_depth_first_with_paths_indices_and_children():
    nested = {"kv_connector": "MultiConnector",
              "kv_connector_extra_config": _multi({"kv_connector": "B", "kv_role": "kv_consumer"})}
    extra = _multi({"kv_connector": "A", "kv_connector_extra_config": {"x": 1}}, nested,
                   {"kv_connector": "C", "kv_connector_extra_config": None})
    entries = list(connector_entries("MultiConnector", extra))
    assert [(e.name, e.depth, e.index) for e in entries] == [
        ("MultiConnector", 0, None), ("A", 1, 0), ("MultiConnector", 1, 1), ("B", 2, 0), ("C", 1, 2)]
    top, a, _, b, c = entries
    assert top.extra is extra and top.child is None
    assert a.extra == {"x": 1} and c.extra == {}  # a child without extra config gets {}
    assert b.child == {"kv_connector": "B", "kv_role": "kv_consumer"}
    assert b.where == ("kv_connector_extra_config.connectors[1].kv_connector_extra_config"
                       ".connectors[0].kv_connector_extra_config")


def test_only_multiconnector_entries_are_descended():
    assert [e.name for e in connector_entries("A", _multi({"kv_connector": "B"}))] == ["A"]
    assert [e.name for e in connector_entries("MultiConnector", None)] == ["MultiConnector"]


def test_lenient_walk_skips_malformed_parts():
    extra = _multi(7, {"kv_connector": None}, {"kv_connector": "MultiConnector",
                                                "kv_connector_extra_config": {"connectors": 3}},
                   {"kv_connector": "D"})
    entries = list(connector_entries("MultiConnector", extra))
    assert [(e.name, e.index) for e in entries] == [
        ("MultiConnector", None), (None, 1), ("MultiConnector", 2), ("D", 3)]


def test_on_malformed_hears_each_problem_with_its_path():
    heard: list[tuple[str, str, str]] = []
    extra = _multi(7, {"kv_connector": "A", "kv_connector_extra_config": [1]})
    list(connector_entries("MultiConnector", extra, on_malformed=lambda *p: heard.append(p)))
    assert heard == [
        ("kv_connector_extra_config.connectors[0]", "is 7 (int)",
         'an object {"kv_connector": NAME, "kv_connector_extra_config": {...}}'),
        ("kv_connector_extra_config.connectors[1].kv_connector_extra_config", "is a list",
         "an object or null"),
    ]


def test_max_depth_bounds_multiconnector_nesting():
    extra: dict = {}
    for _ in range(3):
        extra = _multi({"kv_connector": "MultiConnector", "kv_connector_extra_config": extra})

    def fail(where: str, problem: str, accepted: str) -> None:
        raise ValueError(f"{where} {problem}")

    assert len(list(connector_entries("MultiConnector", extra, on_malformed=fail, max_depth=4))) == 4
    with pytest.raises(ValueError, match=r"connectors\[0\].kv_connector_extra_config nests "
                                         r"MultiConnector more than 3 levels deep"):
        list(connector_entries("MultiConnector", extra, on_malformed=fail, max_depth=3))
