"""Layout wire data and the pure compatibility check."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.pd.handshake import (
    PROTOCOL_VERSION,
    LayoutInfo,
    PeerProfile,
    check_compatible,
    compat_fingerprint,
    heads_cover,
)


def layout(**overrides: object) -> LayoutInfo:
    fields: dict[str, object] = dict(
        kind="mla", dtype="bfloat16", layer_ids=(0, 1, 2), total_heads=1, head_start=0,
        head_end=1, head_dim=512, rope_dim=64, block_size=64,
    )  # fmt: skip
    fields.update(overrides)
    return LayoutInfo(**fields)  # type: ignore[arg-type]


def profile(model: str = "m", *layouts: LayoutInfo) -> PeerProfile:
    return PeerProfile(
        protocol_version=PROTOCOL_VERSION, model_id=model, layouts=layouts or (layout(),)
    )


def test_identical_profiles_are_compatible() -> None:
    p = profile()
    assert check_compatible(p, p, compat_fingerprint(p)).reasons == ()
    assert check_compatible(p, p, compat_fingerprint(p)).compatible


def test_block_size_head_range_and_physical_fingerprint_may_differ() -> None:
    ours = profile("m", layout(kind="gqa", total_heads=8, head_start=0, head_end=4, head_dim=128))
    theirs = profile(
        "m",
        layout(
            kind="gqa", total_heads=8, head_start=4, head_end=8, head_dim=128, block_size=16,
            fingerprint=b"\x01" * 16,
        ),
    )  # fmt: skip
    verdict = check_compatible(ours, theirs, compat_fingerprint(theirs))
    assert verdict.compatible and verdict.reasons == ()
    assert compat_fingerprint(ours) == compat_fingerprint(theirs)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("kind", "gqa", "pool 0 kind: ours 'mla', theirs 'gqa'"),
        ("dtype", "float16", "pool 0 dtype: ours 'bfloat16', theirs 'float16'"),
        ("layer_ids", (0, 1, 3), "pool 0 layer_ids: ours (0, 1, 2), theirs (0, 1, 3)"),
        ("head_dim", 256, "pool 0 head_dim: ours 512, theirs 256"),
        ("rope_dim", 32, "pool 0 rope_dim: ours 64, theirs 32"),
        ("sliding_window", 4096, "pool 0 sliding_window: ours None, theirs 4096"),
    ],
)
def test_each_must_match_field_is_named(field: str, value: object, reason: str) -> None:
    ours, theirs = profile(), profile("m", layout(**{field: value}))
    verdict = check_compatible(ours, theirs, compat_fingerprint(theirs))
    assert not verdict.compatible
    assert verdict.reasons == (reason,)
    assert compat_fingerprint(ours) != compat_fingerprint(theirs)


def test_model_version_pool_count_and_l2_compat_fingerprint() -> None:
    ours = profile("m", layout(compat_fingerprint=b"a" * 16))
    theirs = PeerProfile(
        protocol_version=PROTOCOL_VERSION + 1,
        model_id="other",
        layouts=(layout(compat_fingerprint=b"b" * 16), layout(kind="state")),
    )
    verdict = check_compatible(ours, theirs, compat_fingerprint(theirs))
    assert verdict.reasons == (
        f"protocol_version: ours {PROTOCOL_VERSION}, theirs {PROTOCOL_VERSION + 1}",
        "model_id: ours 'm', theirs 'other'",
        "whole-only pools: ours 0, theirs 1",
        f"pool 0 layout compat fingerprint: ours {(b'a' * 16).hex()}, theirs {(b'b' * 16).hex()}",
    )


def test_a_claimed_fingerprint_that_lies_is_refused() -> None:
    p = profile()
    verdict = check_compatible(p, p, b"\x00" * 16)
    assert verdict.reasons == (
        "peer's claimed compatibility fingerprint does not match its own profile",
    )


@pytest.mark.parametrize(
    ("held", "needed", "covered"),
    [
        ((0, 1), (0, 1), True),  # MLA / state: one head, no split
        ((0, 8), (2, 4), True),  # GQA, prefill TP 1, decode TP 4
        ((2, 4), (2, 4), True),  # same TP degree, same rank
        ((0, 4), (1, 3), True),
        ((0, 4), (2, 6), False),  # decode straddles two prefill ranks
        ((1, 3), (0, 4), False),  # decode TP 1, prefill TP 2: one sender holds half
        ((0, 2), (2, 4), False),  # disjoint
    ],
)
def test_heads_cover_is_a_subset_test(
    held: tuple[int, int], needed: tuple[int, int], covered: bool
) -> None:
    assert heads_cover(held, needed) is covered


def test_the_kv_direction_makes_uncovered_heads_incompatible() -> None:
    def gqa(lo: int, hi: int) -> PeerProfile:
        return profile("m", layout(kind="gqa", total_heads=8, head_start=lo, head_end=hi),
                       layout(kind="state", total_heads=1, head_dim=16, rope_dim=0))  # fmt: skip

    prefill, decode = gqa(0, 4), gqa(2, 6)
    why = (
        "pool 0 KV heads: the receiver's (2, 6) are not all in the sender's (0, 4): "
        "one sender cannot fill them"
    )
    assert check_compatible(prefill, decode, compat_fingerprint(decode), sends=True).reasons == (
        why,
    )
    assert check_compatible(decode, prefill, compat_fingerprint(prefill), sends=False).reasons == (
        why,
    )
    assert check_compatible(prefill, decode, compat_fingerprint(decode)).compatible  # no role
    wide, narrow = gqa(0, 8), gqa(2, 4)  # the decode rank's heads a subset of the prefill's
    assert check_compatible(wide, narrow, compat_fingerprint(narrow), sends=True).compatible
    assert check_compatible(narrow, wide, compat_fingerprint(wide), sends=False).compatible
    assert not check_compatible(narrow, wide, compat_fingerprint(wide), sends=True).compatible
    mla = profile()  # no head split: always covered
    for sends in (True, False):
        assert check_compatible(mla, mla, compat_fingerprint(mla), sends=sends).compatible


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kind": "paged"}, "LayoutInfo.kind must be one of"),
        ({"layer_ids": ()}, "LayoutInfo.layer_ids must name at least one layer"),
        ({"layer_ids": (0, 0)}, "LayoutInfo.layer_ids has duplicates: (0, 0)"),
        ({"layer_ids": (0, -1)}, "LayoutInfo.layer_ids[1] must be an int >= 0, got -1"),
        ({"total_heads": 0}, "LayoutInfo.total_heads must be a positive int, got 0"),
        ({"head_start": 1, "head_end": 1}, "LayoutInfo head range [1, 1) is not a non-empty"),
        ({"head_start": 0, "head_end": 2}, "LayoutInfo head range [0, 2) is not a non-empty"),
        ({"block_size": 0}, "LayoutInfo.block_size must be a positive int, got 0"),
        ({"head_dim": 0}, "LayoutInfo.head_dim must be a positive int, got 0"),
        ({"sliding_window": 0}, "LayoutInfo.sliding_window must be a positive int, got 0"),
    ],
)
def test_layout_info_rejects_bad_values_on_construction_and_decode(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        layout(**overrides)
    assert str(caught.value).startswith(message)
    good = msgspec.to_builtins(layout())
    names = list(LayoutInfo.__struct_fields__)
    for key, value in overrides.items():
        good[names.index(key)] = list(value) if isinstance(value, tuple) else value
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(good, LayoutInfo)


def test_from_description_reads_kvlayout_describe_keys() -> None:
    desc = {
        "kind": "gqa", "num_blocks": 10, "block_size": 16, "layer_ids": [0, 1],
        "total_heads": 8, "head_range": [2, 4], "head_dim": 64, "rope_dim": None,
        "dtype": "float16", "order": ["BLOCK"], "sliding_window": None,
    }  # fmt: skip
    info = LayoutInfo.from_description(desc, compat_fingerprint=b"c", fingerprint=b"f")
    assert info == LayoutInfo(
        kind="gqa", dtype="float16", layer_ids=(0, 1), total_heads=8, head_start=2, head_end=4,
        head_dim=64, rope_dim=0, sliding_window=None, block_size=16, compat_fingerprint=b"c",
        fingerprint=b"f",
    )  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="unusable"):
        LayoutInfo.from_description({"kind": "gqa"})


def test_profile_round_trips_through_msgpack() -> None:
    p = profile("m", layout(), layout(kind="state", head_dim=32, rope_dim=0))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=PeerProfile) == p
