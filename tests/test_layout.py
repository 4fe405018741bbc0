"""KVLayout: byte arithmetic against real torch tensors, views, fingerprints and bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvplane.errors import InvalidArgumentError, LayoutError
from kvplane.layout import (
    BLOCK_MAJOR,
    HEAD_MAJOR,
    LAYER_MAJOR,
    Axis,
    KVLayout,
    LayoutKind,
    check_layer_ids,
    dtype_from_name,
    dtype_name,
    heads_cover,
    shared_heads,
)

ORDERS = [BLOCK_MAJOR, LAYER_MAJOR, HEAD_MAJOR]


def gqa(**kw: object) -> KVLayout:
    args: dict[str, object] = dict(
        num_blocks=5, block_size=4, num_layers=3, kv_heads=4, head_dim=8, dtype=torch.float16
    )
    args.update(kw)
    return KVLayout.gqa(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("order", ORDERS)
def test_gqa_bytes_match_torch(order: tuple[Axis, ...]) -> None:
    layout = gqa(order=order)
    pool = layout.allocate()
    assert pool.numel() * pool.element_size() == layout.pool_bytes == 5 * 3 * 2 * 4 * 4 * 8 * 2
    assert layout.bytes_per_token_per_layer == 2 * 4 * 8 * 2
    assert layout.bytes_per_block_per_layer == 4 * 2 * 4 * 8 * 2
    assert layout.bytes_per_block == 3 * layout.bytes_per_block_per_layer
    # byte strides agree with torch's element strides of the canonical view
    canon = layout.canonical_view(pool)
    assert canon.shape == (5, 3, 2, 4, 4, 8)
    assert tuple(s * 2 for s in canon.stride()) == layout.strides_bytes()
    assert canon.data_ptr() == pool.data_ptr()


@pytest.mark.parametrize("order", ORDERS)
def test_element_offsets_address_the_right_bytes(order: tuple[Axis, ...]) -> None:
    layout = gqa(order=order, dtype=torch.float32)
    pool = layout.allocate()
    canon = layout.canonical_view(pool)
    flat = pool.view(-1)
    strides = layout.strides_bytes()
    for idx in itertools.product(range(5), range(3), range(2), [0, 3], [1, 3], [0, 7]):
        value = float(sum(i * 10**k for k, i in enumerate(idx)))
        canon[idx] = value
        offset = sum(i * s for i, s in zip(idx, strides, strict=True))
        assert flat[offset // 4].item() == value


def test_kv_views_are_zero_copy_slices_of_one_layer() -> None:
    layout = gqa(layer_ids=(4, 9, 11), num_layers=None)
    pool = layout.allocate()
    k, v = layout.kv_views(pool, 9)
    assert k.shape == v.shape == (5, 4, 4, 8)
    k[2, 1, 3, 5] = 7.0
    v[2, 1, 3, 5] = 9.0
    canon = layout.canonical_view(pool)
    assert canon[2, 1, 0, 1, 3, 5].item() == 7.0
    assert canon[2, 1, 1, 1, 3, 5].item() == 9.0
    assert pool.sum().item() == 16.0
    with pytest.raises(LayoutError, match="layer 5"):
        layout.layer_view(pool, 5)


def test_mla_packed_layout_matches_deepseek_shape() -> None:
    layout = KVLayout.mla(num_blocks=6, block_size=64, num_layers=2)
    assert layout.kind is LayoutKind.MLA
    assert layout.head_dim == 576 and layout.latent_dim == 512 and layout.rope_dim == 64
    pool = layout.allocate()
    assert layout.pool_bytes == pool.numel() * 2 == 6 * 2 * 64 * 576 * 2
    view = layout.mla_view(pool, 1)
    assert view.shape == (6, 64, 576)
    latent, rope = view[..., :512], view[..., 512:]
    assert latent.data_ptr() == view.data_ptr()
    assert rope.data_ptr() == view.data_ptr() + 512 * 2
    view[3, 10] = 1.0
    assert layout.canonical_view(pool)[3, 1, 0, 10, 0].sum().item() == 576


def test_state_layout_is_whole_only() -> None:
    layout = KVLayout.state(num_slots=3, num_layers=2, state_dim=10)
    assert layout.whole_only and layout.block_size == 1
    pool = layout.allocate()
    assert layout.state_view(pool, 1).shape == (3, 10)
    assert layout.bytes_per_block == 2 * 10 * 4


def test_tp_head_range_shrinks_the_pool() -> None:
    full = gqa(kv_heads=8)
    half = gqa(kv_heads=8, head_range=(4, 8))
    assert half.local_heads == 4 and half.pool_bytes * 2 == full.pool_bytes
    assert half.compat_fingerprint() == full.compat_fingerprint()
    assert half.fingerprint() != full.fingerprint()


def test_window_start_is_what_the_next_step_reads() -> None:
    """The step after ``n`` positions computes ``n``, which sees the ``W - 1`` before it."""
    windowed = gqa(sliding_window=6)
    assert [windowed.window_start(n) for n in (0, 4, 5, 6, 7, 21)] == [0, 0, 0, 1, 2, 16]
    assert gqa().window_start(21) == 0


def test_head_rules_cover_and_share() -> None:
    assert heads_cover((0, 4), (1, 3)) and heads_cover((0, 1), (0, 1))
    assert not heads_cover((1, 3), (0, 4)) and not heads_cover((0, 2), (1, 3))
    assert shared_heads((0, 2), (1, 3)) == (1, 2) and shared_heads((2, 6), (0, 8)) == (2, 6)
    assert shared_heads((0, 2), (2, 4)) is None


def test_fingerprints_are_stable_and_discriminating() -> None:
    a = gqa()
    assert a.fingerprint() == gqa().fingerprint()
    assert a.fingerprint() == gqa(num_blocks=99).fingerprint()  # pool size is not identity
    assert a.compat_fingerprint() == gqa(block_size=16, order=LAYER_MAJOR).compat_fingerprint()
    assert a.fingerprint() != gqa(block_size=16).fingerprint()
    assert a.compat_fingerprint() != gqa(dtype=torch.bfloat16).compat_fingerprint()
    assert a.compat_fingerprint() != gqa(head_dim=16).compat_fingerprint()
    assert a.compat_fingerprint() != gqa(sliding_window=8).compat_fingerprint()
    assert len(a.fingerprint()) == 16
    # golden value: a change of canonicalisation must be deliberate
    assert a.fingerprint().hex() == GOLDEN_GQA_FINGERPRINT


GOLDEN_GQA_FINGERPRINT = "74e2502cd0589e156fc443c339a75dbb"


def test_dtype_names_round_trip() -> None:
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        assert dtype_from_name(dtype_name(dt)) == dt
    with pytest.raises(LayoutError, match="int64"):
        dtype_name(torch.int64)
    with pytest.raises(LayoutError, match="fp13"):
        dtype_from_name("fp13")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_size": -4}, "block_size"),
        ({"head_dim": 0}, "head_dim"),
        ({"kv_heads": 0}, "total_heads"),
        ({"head_range": (2, 9)}, "head_range"),
        ({"head_range": (3, 3)}, "head_range"),
        ({"num_layers": 0}, "num_layers"),
        ({"dtype": torch.int64}, "dtype"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"order": (Axis.DIM, *BLOCK_MAJOR[:-1])}, "DIM last"),
        ({"order": (*BLOCK_MAJOR[:-2], Axis.DIM)}, "six axes"),
        ({"head_range": (0.5, 2.5)}, r"^KVLayout\.head_range\[0\] must be an int, got 0\.5$"),
        ({"head_range": (0, True)}, r"^KVLayout\.head_range\[1\] must be an int, got True$"),
        (
            {"layer_ids": (0, -1), "num_layers": None},
            r"^KVLayout\.layer_ids\[1\] must be an int >= 0, got -1$",
        ),
        ({"num_blocks": 2.0}, r"^KVLayout\.num_blocks must be a positive int, got 2\.0$"),
        ({"head_range": (0, 1, 2)}, "head_range must hold 2 ints"),
        ({"head_range": "01"}, "head_range must be a sequence of ints"),
        ({"order": ("block",) * 6}, "sequence of Axis"),
        ({"num_blocks": 1 << 60}, "exceeds the 4611686018427387904-byte limit"),
    ],
)
def test_bad_gqa_layouts_are_rejected(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        gqa(**kwargs)


def test_bad_mla_and_state_layouts_are_rejected() -> None:
    with pytest.raises(LayoutError, match="rope_dim"):
        KVLayout.mla(num_blocks=2, block_size=4, num_layers=1, latent_dim=8, rope_dim=0)
    with pytest.raises(LayoutError, match="one latent"):
        KVLayout(LayoutKind.MLA, 2, 4, (0,), 2, 72, torch.float16, rope_dim=8)
    with pytest.raises(LayoutError, match="MLA field"):
        KVLayout(LayoutKind.GQA, 2, 4, (0,), 2, 8, torch.float16, rope_dim=8)
    with pytest.raises(LayoutError, match="STATE"):
        KVLayout(LayoutKind.STATE, 2, 4, (0,), 1, 8, torch.float32)
    with pytest.raises(LayoutError, match="MHA"):
        KVLayout(LayoutKind.MHA, 2, 4, (0,), 4, 8, torch.float16, head_range=(0, 2))
    with pytest.raises(LayoutError, match="duplicates"):
        gqa(layer_ids=(1, 1), num_layers=None)
    with pytest.raises(LayoutError, match="disagrees"):
        gqa(layer_ids=(1, 2), num_layers=3)


def test_sequence_fields_are_stored_as_tuples_so_layouts_hash() -> None:
    layout = KVLayout(LayoutKind.GQA, 2, 4, [0, 1], 4, 8, torch.float16, head_range=[0, 2])  # type: ignore[arg-type]
    assert layout.layer_ids == (0, 1) and layout.head_range == (0, 2)
    assert hash(layout) == hash(
        KVLayout(LayoutKind.GQA, 2, 4, (0, 1), 4, 8, torch.float16, head_range=(0, 2))
    )


def test_pool_tensor_checks() -> None:
    layout = gqa()
    with pytest.raises(LayoutError, match="does not match"):
        layout.canonical_view(torch.zeros(3))
    with pytest.raises(LayoutError, match="contiguous"):
        layout.check_pool(torch.zeros(5, 3, 2, 4, 8, 4, dtype=torch.float16).transpose(-1, -2))
    with pytest.raises(LayoutError, match="MHA/GQA"):
        KVLayout.mla(num_blocks=2, block_size=4, num_layers=1, latent_dim=8, rope_dim=4).kv_views(
            torch.zeros(2, 1, 1, 4, 1, 12, dtype=torch.bfloat16), 0
        )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((), "ids must name at least one layer"),
        ((0, 2, 0), "ids has duplicates: (0, 2, 0)"),
        ((0, -1), "ids[1] must be an int >= 0, got -1"),
        ((True,), "ids[0] must be an int >= 0, got True"),
        ("01", "ids must be a sequence of ints, got '01'"),
    ],
)
def test_check_layer_ids_is_one_rule_with_the_callers_error(value: object, message: str) -> None:
    assert check_layer_ids("ids", [3, 1]) == (3, 1)
    for error in (LayoutError, InvalidArgumentError):
        with pytest.raises(error) as caught:
            check_layer_ids("ids", value, error=error)
        assert type(caught.value) is error and str(caught.value) == message


def test_the_geometry_fingerprint_leaves_out_layer_ids_and_the_compat_one_adds_them() -> None:
    a, stage = gqa(), gqa(layer_ids=(3, 5, 7))
    assert a.geometry_fingerprint() == stage.geometry_fingerprint()
    assert a.geometry_fingerprint() == gqa(block_size=16, head_range=(2, 4)).geometry_fingerprint()
    assert a.compat_fingerprint() != stage.compat_fingerprint()
    assert a.geometry_fingerprint() != gqa(dtype=torch.bfloat16).geometry_fingerprint()
    assert a.geometry_fingerprint() != gqa(sliding_window=8).geometry_fingerprint()
    assert len(a.geometry_fingerprint()) == len(a.compat_fingerprint()) == 16
    assert a.geometry_fingerprint() not in (a.compat_fingerprint(), a.fingerprint())
