"""A TP rank's part of a Mamba2 state row (``StateSplit``) and the STATE layout that holds it:
exact spans for split and replicated groups, vLLM's refusals, the layout's row size, and
fingerprints: a rank's part changes the physical identity, not the PD geometry (#33)."""

from __future__ import annotations

import pytest
import torch

from kvplane.errors import LayoutError
from kvplane.layout import KVLayout
from kvplane.state_split import MambaGeometry, RowSpan, StateSplit

# H=8 heads of P=4, G=2 groups of N=3, K=4 (3 conv inputs kept): x 8·4·3 = 96, B and C
# 2·3·3 = 18 each, SSM 8·4·3 = 96: a row of 228 elements
GEO = MambaGeometry(num_heads=8, head_dim=4, num_groups=2, state_size=3, conv_kernel=4)


def test_the_geometry_of_a_row() -> None:
    assert (GEO.conv_dim, GEO.row_dim) == (44, 228)
    assert GEO.parts() == ((0, 8, 12), (96, 2, 9), (114, 2, 9), (132, 8, 12))


def test_tp2_splits_heads_and_groups() -> None:
    assert StateSplit(GEO, 2, 0).spans == (
        RowSpan(0, 0, 48), RowSpan(96, 48, 9), RowSpan(114, 57, 9), RowSpan(132, 66, 48),
    )  # fmt: skip
    assert StateSplit(GEO, 2, 1).spans == (
        RowSpan(48, 0, 48), RowSpan(105, 48, 9), RowSpan(123, 57, 9), RowSpan(180, 66, 48),
    )  # fmt: skip
    assert StateSplit(GEO, 2, 1).local_dim == 114
    assert StateSplit(GEO).spans[0] == RowSpan(0, 0, 96) and StateSplit(GEO).local_dim == 228


def test_one_group_is_held_by_every_rank() -> None:
    one = MambaGeometry(num_heads=8, head_dim=4, num_groups=1, state_size=3, conv_kernel=4)
    spans = [StateSplit(one, 4, r).spans for r in range(4)]
    assert [s[1] for s in spans] == [RowSpan(96, 24, 9)] * 4  # B: group 0 everywhere
    assert [s[2] for s in spans] == [RowSpan(105, 33, 9)] * 4
    assert [s[0].start for s in spans] == [0, 24, 48, 72]
    assert [s[3] for s in spans][3] == RowSpan(114 + 72, 42, 24)


@pytest.mark.parametrize(
    ("geometry", "tp", "message"),
    [
        (GEO, 3, r"TP 3 does not divide the state's 8 heads"),
        (GEO, 4, r"TP 4 does not divide the state's 2 groups \(and not one\)"),
    ],
)
def test_splits_vllm_refuses_are_layout_errors(
    geometry: MambaGeometry, tp: int, message: str
) -> None:
    with pytest.raises(LayoutError, match=message):
        StateSplit(geometry, tp, 0)


def test_bad_geometry_and_ranks_are_refused() -> None:
    with pytest.raises(LayoutError, match="3 groups do not divide 8 heads"):
        MambaGeometry(8, 4, 3, 3, 4)
    with pytest.raises(LayoutError, match="conv_kernel"):
        MambaGeometry(8, 4, 2, 3, 1)
    with pytest.raises(LayoutError, match="tp_rank"):
        StateSplit(GEO, 2, 2)


def layout(split: StateSplit | None, state_dim: int = GEO.row_dim) -> KVLayout:
    return KVLayout.state(num_slots=3, num_layers=2, state_dim=state_dim, split=split)


def test_a_rank_layout_holds_its_part_of_each_row() -> None:
    rank = layout(StateSplit(GEO, 2, 1))
    assert rank.head_dim == 228 and rank.row_dim == 114
    assert rank.shape == (3, 2, 1, 1, 1, 114)
    assert rank.pool_bytes == 3 * 2 * 114 * 4
    pool = rank.allocate()
    assert rank.state_view(pool, 1).shape == (3, 114)


def test_a_split_needs_a_state_layout_of_its_whole_row() -> None:
    with pytest.raises(LayoutError, match="needs a STATE layout of its whole row"):
        layout(StateSplit(GEO, 2, 0), state_dim=114)
    with pytest.raises(LayoutError, match="needs a STATE layout of its whole row"):
        KVLayout(kind=KVLayout.gqa(num_blocks=1, block_size=1, num_layers=1, kv_heads=1,
                                   head_dim=228).kind, num_blocks=1, block_size=1,
                 layer_ids=(0,), total_heads=1, head_dim=228, dtype=torch.float32,
                 state_split=StateSplit(GEO))  # fmt: skip


def test_fingerprints_keep_the_geometry_and_name_the_part() -> None:
    whole, plain = layout(StateSplit(GEO)), layout(None)
    r0, r1 = layout(StateSplit(GEO, 2, 0)), layout(StateSplit(GEO, 2, 1))
    assert whole.fingerprint() == plain.fingerprint()  # TP 1: the whole row, as before
    assert len({whole.fingerprint(), r0.fingerprint(), r1.fingerprint()}) == 3
    assert whole.compat_fingerprint() == r0.compat_fingerprint() == r1.compat_fingerprint()
    assert r0.describe()["state_split"] == {"mamba": [8, 4, 2, 3, 4], "tp": [2, 0]}
    assert "state_split" not in whole.describe()
