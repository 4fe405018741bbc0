"""The domains of a layout's fields (``kvplane.layout_fields``), and their re-export from
``kvplane.layout``, where every caller imports them."""

from __future__ import annotations

import pytest

from kvplane import layout
from kvplane import layout_fields as fields
from kvplane.errors import InvalidArgumentError, LayoutError
from kvplane.layout_fields import (
    BLOCK_MAJOR,
    HEAD_MAJOR,
    LAYER_MAJOR,
    Axis,
    check_head_range,
    check_layer_ids,
    check_order,
    check_windows,
    layer_ids_of,
)


def test_layout_re_exports_the_same_objects() -> None:
    shared = set(layout.__all__) - {"KVLayout", "MAX_POOL_BYTES"}
    assert len(shared) == 11 and shared <= set(dir(fields))
    for name in shared:
        assert getattr(layout, name) is getattr(fields, name), name


def test_orders_are_permutations_with_dim_last() -> None:
    assert check_order(list(LAYER_MAJOR)) == LAYER_MAJOR
    assert check_order(HEAD_MAJOR) == HEAD_MAJOR != BLOCK_MAJOR
    with pytest.raises(LayoutError, match="must be a sequence of Axis, got 'BLOCK'"):
        check_order("BLOCK")
    with pytest.raises(LayoutError, match="must permute all six axes with DIM last"):
        check_order((Axis.DIM, *BLOCK_MAJOR[:-1]))
    with pytest.raises(LayoutError, match="must permute all six axes"):
        check_order((*BLOCK_MAJOR[:-2], Axis.DIM))


def test_windows_are_one_value_or_the_models_map() -> None:
    assert check_windows((0, 1), 8, (), whole_only=False) == (8, ())
    assert check_windows((0, 2), None, [4, None, 4], whole_only=False) == (None, (4, None, 4))
    assert check_windows((1,), None, (16, 16), whole_only=False) == (16, ())  # one value
    with pytest.raises(LayoutError, match=r"layer_windows \(4,\) must give the window or None "
                       r"of every layer id up to 2"):  # fmt: skip
        check_windows((0, 2), None, (4,), whole_only=False)
    with pytest.raises(LayoutError, match="must give"):
        check_windows((0,), 8, (4,), whole_only=False)
    with pytest.raises(LayoutError, match="a STATE layout has no sliding window"):
        check_windows((0,), 8, (), whole_only=True)
    with pytest.raises(LayoutError, match=r"layer_windows\[1\]"):
        check_windows((0, 1), None, (4, 0), whole_only=False)


def test_layer_ids_of_a_constructor_and_their_rule() -> None:
    assert layer_ids_of(3, None) == (0, 1, 2)
    assert layer_ids_of(None, (4, 7)) == layer_ids_of(2, (4, 7)) == (4, 7)
    with pytest.raises(LayoutError, match=r"num_layers=3 disagrees with layer_ids=\(4, 7\)"):
        layer_ids_of(3, (4, 7))
    with pytest.raises(LayoutError, match="give num_layers or layer_ids"):
        layer_ids_of(None, None)
    with pytest.raises(InvalidArgumentError, match=r"ids has duplicates: \(1, 1\)"):
        check_layer_ids("ids", [1, 1], error=InvalidArgumentError)


def test_head_ranges_are_non_empty_inside_the_heads() -> None:
    assert check_head_range((0, 0), 8) == (0, 8)  # all
    assert check_head_range([2, 6], 8) == (2, 6)
    with pytest.raises(LayoutError, match=r"head_range \(6, 2\) must satisfy 0 <= start < end <= "
                       "total_heads=8"):  # fmt: skip
        check_head_range((6, 2), 8)
    with pytest.raises(LayoutError, match=r"head_range must hold 2 ints, got \(1,\)"):
        check_head_range((1,), 8)
    with pytest.raises(LayoutError, match=r"head_range\[1\]"):
        check_head_range((0, True), 8)
