"""The handshake's multi-sender rule: a TP or PP prefill rank is a gather member of a decode
rank whose heads or layers it holds only part of; a 1:1 pairing keeps the strict rule."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.layout import KVLayout
from kvplane.pd.handshake import (
    PROTOCOL_VERSION,
    LayoutInfo,
    PeerProfile,
    Placement,
    Verdict,
    check_compatible,
    compat_fingerprint,
)


def rank(
    heads: tuple[int, int] = (0, 8),
    layers: tuple[int, ...] = (0, 1, 2, 3),
    *,
    total: int = 8,
    kind: str = "gqa",
    dtype: str = "float32",
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
) -> PeerProfile:
    kv = LayoutInfo(
        kind=kind, dtype=dtype, layer_ids=layers, total_heads=total, head_start=heads[0],
        head_end=heads[1], head_dim=16, block_size=16,
    )  # fmt: skip
    at = Placement(tp_rank=tp[0], tp_size=tp[1], pp_stage=pp[0], pp_size=pp[1])
    return PeerProfile(protocol_version=PROTOCOL_VERSION, model_id="m", layouts=(kv,), placement=at)


def both_ways(sender: PeerProfile, receiver: PeerProfile) -> Verdict:
    """The sender's verdict of the receiver; the receiver's verdict must be the same."""
    ours = check_compatible(sender, receiver, compat_fingerprint(receiver), sends=True)
    theirs = check_compatible(receiver, sender, compat_fingerprint(sender), sends=False)
    assert ours == theirs
    return ours


MEMBER = Verdict(compatible=True, member=True)
WHOLE = Verdict(compatible=True)


@pytest.mark.parametrize(
    ("sender", "receiver", "verdict"),
    [
        (rank((4, 8), tp=(1, 2)), rank(), MEMBER),  # prefill TP 2 -> decode TP 1
        (rank((2, 4), tp=(1, 4)), rank((0, 4), tp=(0, 2)), MEMBER),  # TP 4 -> TP 2
        (rank((1, 2), total=2, tp=(3, 4)), rank((0, 2), total=2), MEMBER),  # GQA replicated
        (rank((0, 8), tp=(0, 1)), rank((4, 8), tp=(1, 2)), WHOLE),  # one feeds several
        (rank((0, 1), total=1, kind="mla", tp=(1, 2)), rank((0, 1), total=1, kind="mla"), WHOLE),
        (rank(layers=(2, 3), pp=(1, 2)), rank(), MEMBER),  # prefill PP 2 -> decode PP 1
        (rank((0, 4), (0, 1), tp=(0, 2), pp=(0, 2)), rank(), MEMBER),  # TP 2 x PP 2 -> 1
    ],
)
def test_a_part_of_the_receiver_from_a_finer_layout_is_a_gather_member(
    sender: PeerProfile, receiver: PeerProfile, verdict: Verdict
) -> None:
    assert both_ways(sender, receiver) == verdict


@pytest.mark.parametrize(
    ("sender", "receiver", "reason"),
    [
        (  # 1:1 pairing (no placement): partial coverage stays refused
            rank((4, 8)),
            rank(),
            "pool 0 KV heads: the receiver's (0, 8) are not all in the sender's (4, 8): one "
            "sender cannot fill them",
        ),
        (  # same TP size on both sides: the sender's heads are another rank's
            rank((4, 8), tp=(1, 2)),
            rank((0, 4), tp=(0, 2)),
            "pool 0 KV heads: the sender's (4, 8) (TP rank 1 of 2) neither cover the receiver's "
            "(0, 4) nor lie inside them with a finer TP",
        ),
        (  # a finer TP, but heads outside the receiver's
            rank((2, 4), tp=(1, 4)),
            rank((4, 8), tp=(1, 2)),
            "pool 0 KV heads: the sender's (2, 4) (TP rank 1 of 4) neither cover the receiver's "
            "(4, 8) nor lie inside them with a finer TP",
        ),
        (  # fewer layers without saying it is a pipeline stage
            rank(layers=(2, 3)),
            rank(),
            "pool 0 layer_ids: ours (2, 3), theirs (0, 1, 2, 3)",
        ),
        (  # a pipeline stage holding a layer the receiver lacks
            rank(layers=(3, 4), pp=(1, 2)),
            rank(),
            "pool 0 layer_ids: ours (3, 4), theirs (0, 1, 2, 3): a pipeline stage's layers "
            "must be a part of the receiver's",
        ),
        (  # a pipeline-stage member must still match the model geometry
            rank(layers=(2, 3), pp=(1, 2), dtype="float16"),
            rank(),
            "pool 0 dtype: ours 'float16', theirs 'float32'",
        ),
    ],
)
def test_everything_else_is_refused_with_one_line(
    sender: PeerProfile, receiver: PeerProfile, reason: str
) -> None:
    verdict = check_compatible(sender, receiver, compat_fingerprint(receiver), sends=True)
    assert verdict == Verdict(compatible=False, reasons=(reason,))


def test_a_receiver_with_fewer_layers_is_refused() -> None:
    """A decode side split into pipeline stages is not a layout the rule admits."""
    full, stage = rank(), rank(layers=(0, 1), pp=(0, 2))
    got = check_compatible(full, stage, compat_fingerprint(stage), sends=True)
    assert got.reasons == ("pool 0 layer_ids: ours (0, 1, 2, 3), theirs (0, 1)",)


def test_without_a_direction_a_lone_stage_is_read_as_the_sender() -> None:
    full, stage = rank(), rank(layers=(2, 3), pp=(1, 2))
    assert check_compatible(stage, full, compat_fingerprint(full)) == MEMBER
    assert check_compatible(full, stage, compat_fingerprint(stage)) == MEMBER
    other = rank(layers=(0, 1), pp=(0, 2))
    assert not check_compatible(other, stage, compat_fingerprint(stage)).compatible


def test_the_l2_compat_fingerprint_is_still_compared_where_layers_match() -> None:
    def fp(p: PeerProfile, digest: bytes) -> PeerProfile:
        lay = msgspec.structs.replace(p.layouts[0], compat_fingerprint=digest)
        return msgspec.structs.replace(p, layouts=(lay,))

    sender, receiver = fp(rank((4, 8), tp=(1, 2)), b"\x01"), fp(rank(), b"\x02")
    got = check_compatible(sender, receiver, compat_fingerprint(receiver), sends=True)
    assert got.reasons == ("pool 0 layout compat fingerprint: ours 01, theirs 02",)


def with_geometry(p: PeerProfile, digest: bytes) -> PeerProfile:
    lay = msgspec.structs.replace(p.layouts[0], geometry_fingerprint=digest)
    return msgspec.structs.replace(p, layouts=(lay,))


def test_a_pipeline_stage_is_checked_by_its_geometry_fingerprint() -> None:
    stage, full = with_geometry(rank(layers=(2, 3), pp=(1, 2)), b"\x01"), rank()
    assert both_ways(stage, with_geometry(full, b"\x01")) == MEMBER
    assert both_ways(stage, full) == MEMBER  # one side carries none: the fields decide
    other = with_geometry(full, b"\x02")
    got = check_compatible(stage, other, compat_fingerprint(other), sends=True)
    assert got.reasons == ("pool 0 layout geometry fingerprint: ours 01, theirs 02",)


def test_a_stage_of_a_real_layout_matches_the_full_layout_by_geometry() -> None:
    def profile(layout: KVLayout, pp: tuple[int, int]) -> PeerProfile:
        info = LayoutInfo.from_description(
            layout.describe(), compat_fingerprint=layout.compat_fingerprint(),
            geometry_fingerprint=layout.geometry_fingerprint(),
        )  # fmt: skip
        at = Placement(pp_stage=pp[0], pp_size=pp[1])
        return PeerProfile(
            protocol_version=PROTOCOL_VERSION, model_id="m", layouts=(info,), placement=at
        )

    full = KVLayout.gqa(num_blocks=4, block_size=16, num_layers=4, kv_heads=2, head_dim=8)
    stage = KVLayout.gqa(num_blocks=4, block_size=32, layer_ids=(2, 3), kv_heads=2, head_dim=8)
    assert both_ways(profile(stage, (1, 2)), profile(full, (0, 1))) == MEMBER
    wide = KVLayout.gqa(
        num_blocks=4, block_size=16, layer_ids=(2, 3), kv_heads=2, head_dim=8, sliding_window=64
    )
    receiver = profile(full, (0, 1))
    got = check_compatible(
        profile(wide, (1, 2)), receiver, compat_fingerprint(receiver), sends=True
    )
    assert got.reasons == (
        "pool 0 sliding_window: ours 64, theirs None",
        f"pool 0 layout geometry fingerprint: ours {wide.geometry_fingerprint().hex()}, "
        f"theirs {full.geometry_fingerprint().hex()}",
    )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Placement(tp_rank=2, tp_size=2), r"Placement.tp_rank must be an int in \[0, 1\]"),
        (lambda: Placement(pp_stage=1), r"Placement.pp_stage must be an int in \[0, 0\]"),
        (lambda: Placement(tp_size=0), "Placement.tp_size must be a positive int, got 0"),
        (
            lambda: rank((0, 4), tp=(1, 2)),
            r"PeerProfile pool 0: TP rank 1 of 2 holds heads \(4, 8\) of 8, not \(0, 4\)",
        ),
        (
            lambda: rank((0, 1), total=3, tp=(0, 2)),
            "PeerProfile pool 0: 3 KV heads and TP 2: one must divide the other",
        ),
    ],
)
def test_a_placement_is_checked_on_construction(build: object, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        build()  # type: ignore[operator]


def test_the_placement_travels_and_an_old_profile_decodes_as_one_process() -> None:
    p = rank((2, 4), (0, 1), tp=(1, 4), pp=(0, 2))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(p), type=PeerProfile) == p
    old = msgspec.msgpack.encode([PROTOCOL_VERSION, "m", [p.layouts[0]]])
    assert msgspec.msgpack.decode(old, type=PeerProfile).placement == Placement()
