"""core.host_layout: the pool layout per geometry (issue [16])."""

import pytest

from vllm_hisparse.core.host_layout import (LAYER_MAJOR_MAX_GROUP_LAYERS, choose_host_layout)

GIB = 1 << 30


def test_an_indexer_in_every_layer_picks_layer_major():
    c = choose_host_layout("auto", [1] * 61, int(1.72e9))
    assert c.layout == "layer"
    assert c.reason == ("layer-major: an indexer in every layer, so one gather reads one "
                        "layer's rows, which lie in one slab of 1.60 GiB")


def test_small_groups_up_to_the_threshold_pick_layer_major():
    assert LAYER_MAJOR_MAX_GROUP_LAYERS == 2
    c = choose_host_layout("auto", [2, 1, 2], GIB)
    assert c.layout == "layer" and "index groups of at most 2 layers" in c.reason
    assert choose_host_layout("auto", [2, 3, 1], GIB).layout == "position"


def test_index_share_picks_position_major():
    c = choose_host_layout("auto", [4] * 19 + [2], GIB)
    assert c.layout == "position"
    assert "IndexShare groups of up to 4 layers" in c.reason


@pytest.mark.parametrize("layout", ["position", "layer"])
def test_an_explicit_layout_wins(layout):
    for groups in ([1], [4, 4]):
        c = choose_host_layout(layout, groups, GIB)
        assert c.layout == layout and c.reason.startswith(
            f"{layout}-major: host_layout={layout!r} requested")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"host_layout='page' is invalid; accepted: auto \| "
                                         r"position \| layer"):
        choose_host_layout("page", [1], GIB)
    with pytest.raises(ValueError, match="group_layers"):
        choose_host_layout("auto", [], GIB)
    with pytest.raises(ValueError, match="group_layers"):
        choose_host_layout("auto", [0, 1], GIB)
