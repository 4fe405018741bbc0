"""Gather sets: the prefill ranks whose TP heads × PP layers tile one decode worker's KV pool
exactly once, each with the piece it sends."""

from __future__ import annotations

import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.serving.messages import WorkerInfo
from kvplane.serving.router.gather_sets import ANY_TOKENS, gather_set
from kvplane.serving.router.workers import WorkerHandle
from kvplane.transfer.resharding import KVBox, Piece, SenderId

ALL4 = (0, 1, 2, 3)


def worker(
    name: str, heads: tuple[int, int] | None, layers: tuple[int, ...] = ALL4, *, stage: int = 0,
    tp: int = 0, up: bool = True, pools: int = 2,
) -> WorkerHandle:  # fmt: skip
    ranges = () if heads is None else (heads, *([(0, 1)] * (pools - 1)))
    info = WorkerInfo(role="w", peer_id=name, pd_address="a", incarnation=1, transport="tcp",
                      head_ranges=ranges, layer_ids=layers, pp_stage=stage, tp_rank=tp)  # fmt: skip
    return WorkerHandle(address=f"tcp://{name}", client=None, info=info, up=up)  # type: ignore[arg-type]


def chosen(prefill: list[WorkerHandle], d: WorkerHandle) -> list[tuple[str, Piece]] | None:
    got = gather_set(prefill, d)
    return None if got is None else [(p.address[6:], piece) for p, piece in got]


def piece(stage: int, tp: int, heads: tuple[int, int], layers: tuple[int, ...] = ALL4) -> Piece:
    return Piece(SenderId(stage, tp), KVBox(heads, layers, ANY_TOKENS))


def test_prefill_tp_2_covers_a_decode_tp_1_worker_with_one_piece_each() -> None:
    prefill = [worker("p1", (2, 4), tp=1), worker("p0", (0, 2), tp=0)]
    assert chosen(prefill, worker("d", (0, 4))) == [
        ("p0", piece(0, 0, (0, 2))), ("p1", piece(0, 1, (2, 4))),
    ]  # fmt: skip


def test_prefill_pp_2_covers_a_decode_worker_by_layers() -> None:
    prefill = [worker("s1", (0, 4), (2, 3), stage=1), worker("s0", (0, 4), (0, 1), stage=0)]
    assert chosen(prefill, worker("d", (0, 4))) == [
        ("s0", piece(0, 0, (0, 4), (0, 1))), ("s1", piece(1, 0, (0, 4), (2, 3))),
    ]  # fmt: skip


def test_a_rank_holding_everything_is_a_set_of_one_and_replicas_are_chosen_once() -> None:
    whole = worker("w", (0, 4), tp=0)
    halves = [worker("a", (0, 2), tp=0), worker("b", (2, 4), tp=1)]
    assert chosen([*halves, whole], worker("d", (0, 2))) == [("a", piece(0, 0, (0, 2)))]
    assert chosen([halves[1], whole], worker("d", (0, 4))) == [("w", piece(0, 0, (0, 4)))]
    replicas = [worker("r1", (0, 1), tp=1), worker("r0", (0, 1), tp=0), worker("x", (1, 2), tp=2)]
    assert chosen(replicas, worker("d", (0, 2))) == [
        ("r0", piece(0, 0, (0, 1))), ("x", piece(0, 2, (1, 2))),
    ]  # fmt: skip


def test_no_set_without_full_coverage_or_without_what_a_set_needs_to_know() -> None:
    half = [worker("p0", (0, 2), tp=0)]
    assert chosen(half, worker("d", (0, 4))) is None  # heads [2, 4) held by nobody
    down = [worker("p0", (0, 2), tp=0), worker("p1", (2, 4), tp=1, up=False)]
    assert chosen(down, worker("d", (0, 4))) is None
    unnamed = [worker("p0", (0, 2)), worker("p1", (2, 4))]  # both say they are rank (0, 0)
    assert chosen(unnamed, worker("d", (0, 4))) is None
    assert chosen([worker("p", (0, 4), ())], worker("d", (0, 4))) is None  # no layers said
    assert chosen([worker("p", (0, 4))], worker("d", None)) is None
    assert chosen([worker("p", (0, 4), pools=1)], worker("d", (0, 4))) is None  # pools differ
    assert chosen([worker("p", (0, 4), (4, 5))], worker("d", (0, 4))) is None  # other layers


def test_worker_info_layer_ids_must_be_distinct() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^layer_ids must be distinct, got \(1, 1\)$"):
        WorkerInfo(role="w", peer_id="w", pd_address="a", incarnation=1, transport="tcp",
                   layer_ids=(1, 1))  # fmt: skip
