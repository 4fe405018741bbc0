"""Per-layer windows of a KV layout (``KVLayout.layer_windows``): one form (all equal is the
uniform ``sliding_window``), each layer's window, the one clipping rule per layer set, and the
fingerprints that make PD peers (and pipeline stages) agree on them (#33)."""

from __future__ import annotations

import pytest
import torch

from kvplane.errors import LayoutError
from kvplane.layout import KVLayout

MIXED = (8, None, 8, 4)
"""Layers 0 and 2 slide over 8 positions, layer 1 is full, layer 3 slides over 4."""


def gqa(**kw: object) -> KVLayout:
    args: dict[str, object] = dict(
        num_blocks=4, block_size=4, num_layers=4, kv_heads=2, head_dim=8, dtype=torch.float16
    )
    return KVLayout.gqa(**(args | kw))  # type: ignore[arg-type]


def test_each_layer_has_its_window_and_equal_windows_are_the_uniform_form() -> None:
    mixed = gqa(layer_windows=MIXED)
    assert mixed.sliding_window is None and mixed.layer_windows == MIXED
    assert [mixed.window_of(i) for i in range(4)] == list(MIXED)
    uniform = gqa(layer_windows=[6, 6, 6, 6])
    assert uniform == gqa(sliding_window=6) and uniform.layer_windows == ()
    assert gqa(layer_windows=(None,) * 4) == gqa()
    assert gqa(sliding_window=6).window_of(3) == 6
    with pytest.raises(LayoutError, match="layer 7 is not in the window map"):
        mixed.window_of(7)


def test_window_start_is_per_layer_set_and_a_full_layer_keeps_everything() -> None:
    """After 20 positions the next step computes position 20, whose query sees ``(20 - W, 20]``:
    a window of 8 reads from 13 on, a window of 4 from 17 on (not from ``20 - W``: that
    position is read by no later step)."""
    mixed = gqa(layer_windows=MIXED)
    assert [mixed.window_start(20, (i,)) for i in range(4)] == [13, 0, 13, 17]
    assert mixed.window_start(20, (0, 2)) == 13 and mixed.window_start(20, (0, 3)) == 13
    assert mixed.window_start(20) == 0  # the pool as a whole keeps every position
    assert mixed.window_start(5, (3,)) == 2 and mixed.window_start(3, (0,)) == 0
    assert gqa(sliding_window=1).window_start(9) == 9  # a window of 1 reads only itself


def test_a_pipeline_stage_carries_the_models_window_map() -> None:
    """A stage holds some layers but the map names every layer id, so the stage's geometry is
    the whole model's (what a PD gather checks) while its compat fingerprint is its own."""
    whole = gqa(layer_windows=MIXED)
    stage = gqa(layer_ids=(2, 3), num_layers=None, layer_windows=MIXED)
    assert [stage.window_of(i) for i in (2, 3)] == [8, 4]
    assert stage.geometry_fingerprint() == whole.geometry_fingerprint()
    assert stage.compat_fingerprint() != whole.compat_fingerprint()
    other = gqa(layer_ids=(2, 3), num_layers=None, layer_windows=(8, None, 8, 8))
    assert other.geometry_fingerprint() != stage.geometry_fingerprint()


def test_windows_are_identity_and_a_uniform_pool_keeps_its_fingerprint() -> None:
    mixed = gqa(layer_windows=MIXED)
    assert mixed.fingerprint() != gqa().fingerprint()
    assert mixed.compat_fingerprint() != gqa(layer_windows=(8, None, 4, 8)).compat_fingerprint()
    assert "layer_windows" not in gqa(sliding_window=8).describe()
    assert mixed.describe()["layer_windows"] == list(MIXED)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"layer_windows": (8, None, 8)}, "every layer id up to 3"),
        ({"layer_windows": MIXED, "sliding_window": 8}, "and no sliding_window"),
        ({"layer_windows": (8, 0, 8, 8)}, r"layer_windows\[1\]"),
        ({"layer_windows": (8, True, 8, 8)}, r"layer_windows\[1\]"),
        ({"layer_windows": 8}, "must be a sequence"),
    ],
)
def test_bad_windows_are_refused(kw: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        gqa(**kw)


def test_a_state_pool_has_no_window() -> None:
    with pytest.raises(LayoutError, match="no sliding window"):
        KVLayout(
            kind=KVLayout.state(num_slots=1, num_layers=2, state_dim=4).kind, num_blocks=1,
            block_size=1, layer_ids=(0, 1), total_heads=1, head_dim=4, dtype=torch.float32,
            layer_windows=(3, None),
        )  # fmt: skip
