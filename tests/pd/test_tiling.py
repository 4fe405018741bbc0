"""Receiver coverage: pieces tile the destination exactly once; anything else is refused."""

from __future__ import annotations

import itertools
import random

import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import TokenRange
from kvplane.layout import KVLayout
from kvplane.pd.tiling import Tiling
from kvplane.transfer.resharding import KVBox, Parallelism, Piece, SenderId, destination, reshard

DEST = KVBox((0, 4), (0, 1, 2, 3), TokenRange(0, 64))
A, B = SenderId(0, 0), SenderId(0, 1)


def box(heads: tuple[int, int], layers: tuple[int, ...], a: int, b: int) -> KVBox:
    return KVBox(heads, layers, TokenRange(a, b))


def full_tiling() -> list[Piece]:
    return [Piece(A, box((0, 2), (0, 1, 2, 3), 0, 64)), Piece(B, box((2, 4), (0, 1, 2, 3), 0, 64))]


def test_two_senders_tile_the_destination() -> None:
    tiling = Tiling(DEST)
    for p in full_tiling():
        assert not tiling.complete
        tiling.add(p)
    assert tiling.complete and tiling.received_cells == 4 * 4 * 64 and tiling.pieces == 2
    assert tiling.senders == {A, B}
    tiling.check_complete()


def test_a_duplicate_piece_is_a_protocol_error_and_changes_nothing() -> None:
    tiling = Tiling(DEST)
    first = Piece(A, box((0, 2), (0, 1), 0, 32))
    tiling.add(first)
    with pytest.raises(ProtocolError) as info:
        tiling.add(Piece(B, first.box))
    assert str(info.value) == (
        "piece heads [0, 2) × layers (0, 1) × [0, 32) from stage 0 tp 1 duplicates "
        "heads [0, 2) × layers (0, 1) × [0, 32) from stage 0 tp 0"
    )
    assert (tiling.received_cells, tiling.pieces, tiling.senders) == (2 * 2 * 32, 1, {A})


@pytest.mark.parametrize(
    ("second", "other"),
    [
        (box((1, 3), (0, 1), 0, 32), "heads [0, 2) × layers (0, 1) × [0, 32)"),  # heads
        (box((0, 2), (1, 2), 0, 32), "heads [0, 2) × layers (0, 1) × [0, 32)"),  # layers
        (box((0, 2), (0, 1), 31, 40), "heads [0, 2) × layers (0, 1) × [0, 32)"),  # tokens
        (box((0, 2), (0, 1), 47, 49), "heads [0, 2) × layers (0, 1) × [48, 64)"),  # next run
    ],
)
def test_an_overlapping_piece_names_the_piece_it_overlaps(second: KVBox, other: str) -> None:
    tiling = Tiling(DEST)
    tiling.add(Piece(A, box((0, 2), (0, 1), 0, 32)))
    tiling.add(Piece(A, box((0, 2), (0, 1), 48, 64)))
    with pytest.raises(ProtocolError) as info:
        tiling.add(Piece(B, second))
    assert str(info.value) == f"piece {second} from stage 0 tp 1 overlaps {other} from stage 0 tp 0"
    assert tiling.pieces == 2


def test_pieces_touching_at_a_token_boundary_do_not_overlap() -> None:
    tiling = Tiling(DEST)
    for a, b in ((32, 48), (0, 32), (48, 64)):
        tiling.add(Piece(A, box((0, 4), (0, 1, 2, 3), a, b)))
    assert tiling.complete


def test_a_piece_outside_the_destination_is_refused() -> None:
    tiling = Tiling(DEST)
    outside = Piece(A, box((0, 2), (4,), 0, 8))
    with pytest.raises(ProtocolError) as info:
        tiling.add(outside)
    assert str(info.value) == (
        "piece heads [0, 2) × layers (4,) × [0, 8) from stage 0 tp 0 is outside the "
        "destination heads [0, 4) × layers (0, 1, 2, 3) × [0, 64)"
    )
    assert tiling.conflict(Piece(A, box((0, 2), (0,), 60, 65))) is not None


def test_only_pieces_are_taken() -> None:
    with pytest.raises(ProtocolError, match=r"^a tiling takes Pieces, got 'x'$"):
        Tiling(DEST).add("x")  # type: ignore[arg-type]


def test_an_incomplete_union_is_not_committable() -> None:
    tiling = Tiling(DEST)
    tiling.add(full_tiling()[0])
    with pytest.raises(ProtocolError) as info:
        tiling.check_complete()
    assert str(info.value) == (
        "destination heads [0, 4) × layers (0, 1, 2, 3) × [0, 64) is incomplete: 512 of 1024 "
        "cells received from 1 piece(s)"
    )


def test_a_piece_with_no_tokens_holds_no_cell() -> None:
    tiling = Tiling(DEST)
    tiling.add(Piece(A, box((0, 2), (0,), 64, 64)))
    tiling.add(Piece(A, box((0, 2), (0,), 64, 64)))
    assert (tiling.pieces, tiling.received_cells) == (0, 0)


MODELS = [
    KVLayout.gqa(num_blocks=1, block_size=16, num_layers=4, kv_heads=h, head_dim=8)
    for h in (2, 4, 8)
] + [KVLayout.mla(num_blocks=1, block_size=16, num_layers=4, latent_dim=12, rope_dim=4)]


@pytest.mark.parametrize(("model", "tp_p", "pp_p", "tp_d"),
                         list(itertools.product(MODELS, (1, 2, 4), (1, 2), (1, 2, 4))))  # fmt: skip
def test_resharded_pieces_cut_into_slices_tile_in_any_order(
    model: KVLayout, tp_p: int, pp_p: int, tp_d: int
) -> None:
    """Every decode rank's pieces, cut into random token slices and received in random order,
    tile its destination; dropping one leaves it incomplete; resending one is refused."""
    rng = random.Random(tp_p * 100 + pp_p * 10 + tp_d + model.total_heads)
    prefill = Parallelism.pipeline(tp_size=tp_p, num_layers=4, pp_size=pp_p, block_size=16)
    decode = Parallelism.pipeline(tp_size=tp_d, num_layers=4, block_size=32)
    tokens = TokenRange(0, 100)
    for d, pieces in enumerate(reshard(model, prefill, decode, tokens)):
        slices = []
        for p in pieces:
            cuts = sorted({0, 100, *rng.sample(range(1, 100), 4)})
            slices += [Piece(p.sender, KVBox(p.box.heads, p.box.layers, TokenRange(a, b)))
                       for a, b in itertools.pairwise(cuts)]  # fmt: skip
        rng.shuffle(slices)
        tiling = Tiling(destination(model, decode, d, tokens))
        for s in slices[:-1]:
            tiling.add(s)
        assert not tiling.complete
        with pytest.raises(ProtocolError, match=" duplicates "):
            tiling.add(slices[0])
        tiling.add(slices[-1])
        tiling.check_complete()
