"""StepBatch: exact packing of tokens, positions, slots, last rows and page tables."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.blocks import BlockHasher, BlockPool, BlockTable
from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId, TokenRange
from kvplane.models import StepBatch, StepRequest


def test_two_requests_pack_exactly() -> None:
    batch = StepBatch.build(
        [StepRequest([7, 8, 9], start=2, block_ids=[5, 1]), StepRequest([4], 6, [3, 0, 2, 9])],
        block_size=4,
    )
    assert batch.token_ids.tolist() == [7, 8, 9, 4]
    assert batch.positions.tolist() == [2, 3, 4, 6]
    # request 0: pos 2,3 -> block 5; pos 4 -> block 1. request 1: pos 6 -> block 0 (2nd entry)
    assert batch.slot_mapping.tolist() == [22, 23, 4, 2]
    assert batch.last_rows.tolist() == [2, 3]
    assert batch.ranges == (TokenRange(2, 5), TokenRange(6, 7))
    assert (batch.num_tokens, batch.batch_size, batch.is_decode) == (4, 2, False)
    s = batch.metadata.structure()
    assert (s.q_lens, s.kv_lens, s.page_size, s.max_page) == ((3, 1), (5, 7), 4, 5)
    dense = batch.metadata.dense()
    assert dense.block_table.tolist() == [[5, 1], [3, 0]]  # only the blocks [0, end) needs


def test_decode_batch() -> None:
    batch = StepBatch.build([StepRequest([1], 0, [0]), StepRequest([2], 9, [4, 3, 8])], 4)
    assert batch.is_decode and batch.slot_mapping.tolist() == [0, 33]


def test_from_tables_uses_the_tables_tokens_and_blocks() -> None:
    pool = BlockPool(8, 4)
    table = BlockTable(RequestId("a"), 4, BlockHasher(0, b"fp"))
    assert table.admit(pool, list(range(10, 20))) is not None
    batch = StepBatch.from_tables([(table, TokenRange(3, 9))])
    ids = table.block_ids
    assert batch.token_ids.tolist() == list(range(13, 19))
    want = [ids[p // 4] * 4 + p % 4 for p in range(3, 9)]
    assert batch.slot_mapping.tolist() == want
    assert torch.equal(batch.slot_mapping, table.slot_mapping(TokenRange(3, 9)))
    with pytest.raises(InvalidArgumentError, match=r"step range \[8, 11\) must be non-empty"):
        StepBatch.from_tables([(table, TokenRange(8, 11))])
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        StepBatch.from_tables([(table, TokenRange(4, 4))])
    other_pool = BlockPool(2, 8)
    other = BlockTable(RequestId("b"), 8, BlockHasher(0, b"fp"))
    assert other.admit(other_pool, [1, 2]) is not None
    with pytest.raises(InvalidArgumentError, match="disagree on block size"):
        StepBatch.from_tables([(table, TokenRange(0, 1)), (other, TokenRange(0, 1))])
    with pytest.raises(InvalidArgumentError, match="at least one request"):
        StepBatch.from_tables([])
    other.release(other_pool)
    other_pool.check_integrity()
    table.release(pool)
    pool.check_integrity()
    assert pool.num_free_blocks == 8


@pytest.mark.parametrize(
    ("requests", "block_size", "words"),
    [
        ([], 4, "at least one request"),
        ([StepRequest([], 0, [0])], 4, "request 0 computes no tokens"),
        ([StepRequest([1], -1, [0])], 4, "start must be an int >= 0"),
        (
            [StepRequest([1, 2], 3, [0])],
            4,
            r"computes tokens \[3, 5\) but its 1 blocks of 4 cover 4",
        ),
        ([StepRequest([1], 0, [-2])], 4, "ids"),
        ([StepRequest([-1], 0, [0])], 4, "-1"),
        ([StepRequest([1], 0, [0])], 0, "block_size must be a positive int"),
        (["x"], 4, "request 0 is not a StepRequest"),
    ],
)
def test_bad_requests(requests: list[StepRequest], block_size: int, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words):
        StepBatch.build(requests, block_size)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 5),
    st.lists(
        st.tuples(st.integers(0, 20), st.integers(1, 9), st.integers(0, 3)), min_size=1, max_size=5
    ),
    st.randoms(use_true_random=False),
)
def test_slots_follow_the_block_formula(
    bs: int, reqs: list[tuple[int, int, int]], rnd: object
) -> None:
    requests, expect = [], []
    for i, (start, n, extra) in enumerate(reqs):
        end = start + n
        blocks = list(range(100 * i, 100 * (i + 1)))  # disjoint: no two requests write a slot
        rnd.shuffle(blocks)  # type: ignore[attr-defined]
        blocks = blocks[: -(-end // bs) + extra]
        requests.append(StepRequest(list(range(n)), start, blocks))
        expect += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
    batch = StepBatch.build(requests, bs)
    assert batch.slot_mapping.tolist() == expect
    assert batch.positions.tolist() == [p for s, n, _ in reqs for p in range(s, s + n)]
    ends = [s + n for s, n, _ in reqs]
    assert batch.last_rows.tolist() == [
        sum(n for _, n, _ in reqs[: i + 1]) - 1 for i in range(len(reqs))
    ]
    assert batch.metadata.structure().kv_lens == tuple(ends)


def test_a_block_repeated_among_the_written_slots_is_rejected() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"request 0 writes slot 4 \(block 1, offset 0\) twice in one step "
        r"\(positions 0 and 4\)",
    ):
        StepBatch.build([StepRequest(list(range(8)), 0, [1, 1])], 4)


def test_two_requests_writing_one_block_are_rejected() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"requests 0 \(position 2\) and 1 \(position 6\) both write slot 14 "
        r"\(block 3, offset 2\) in one step",
    ):
        StepBatch.build([StepRequest([1], 2, [3]), StepRequest([2], 6, [5, 3])], 4)


def test_shared_blocks_that_are_only_read_are_allowed() -> None:
    # both requests read the shared prefix block 7 (and one repeats it) but write apart
    batch = StepBatch.build([StepRequest([1, 2], 4, [7, 2]), StepRequest([3], 8, [7, 7, 5])], 4)
    assert batch.slot_mapping.tolist() == [8, 9, 20]
    assert batch.metadata.dense().block_table.tolist() == [[7, 2, 0], [7, 7, 5]]
