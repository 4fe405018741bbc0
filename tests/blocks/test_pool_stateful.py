"""Hypothesis stateful test: BlockPool against a plain-list model, invariants after every step.

The model keeps ref counts, the free queue as a Python list (head first) and the hash map as a
dict of hash -> list of holders (registration order), applying the documented rules in the
most obvious way (lookup: the first holder in use, else the first). Every rule also predicts which
typed error a call must raise; a raising call must leave the pool exactly as it was.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplane.blocks.pool import BlockPool
from kvplane.errors import (
    BlockStateError,
    DoubleFreeError,
    InvalidArgumentError,
    KVPlaneError,
    UnknownBlockError,
)
from kvplane.ids import BlockHash, BlockId

N = 6
HASHES = [BlockHash(bytes([i + 1]) * 32) for i in range(5)]
ANY_ID = st.integers(-1, N)  # includes the two nearest unknown ids


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N, 4)
        self.ref = [0] * N
        self.queue = list(range(N))
        self.hash_of: dict[int, BlockHash] = {}
        self.by_hash: dict[BlockHash, list[int]] = {}

    # -- helpers ---------------------------------------------------------------------------
    def expect_error(self, exc: type[KVPlaneError], call: object) -> None:
        before = self.observed()
        with pytest.raises(exc):
            call()  # type: ignore[operator]
        assert self.observed() == before

    def observed(self) -> tuple[object, ...]:
        p = self.pool
        return (
            tuple(p.free_queue_order()),
            tuple(p.ref_count(BlockId(b)) for b in range(N)),
            tuple(p.block_hash(BlockId(b)) for b in range(N)),
        )

    def model_free(self, ids: list[int]) -> type[KVPlaneError] | None:
        if any(not 0 <= b < N for b in ids):
            return UnknownBlockError
        if any(c > self.ref[b] for b, c in Counter(ids).items()):
            return DoubleFreeError
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.queue.append(b)
        return None

    def model_touch(self, ids: list[int]) -> type[KVPlaneError] | None:
        if any(not 0 <= b < N for b in ids):
            return UnknownBlockError
        if any(self.ref[b] == 0 and b not in self.hash_of for b in ids):
            return BlockStateError
        for b in ids:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1
        return None

    # -- rules -----------------------------------------------------------------------------
    @rule(n=st.integers(-1, N + 1))
    def allocate(self, n: int) -> None:
        if n < 0:
            self.expect_error(InvalidArgumentError, lambda: self.pool.allocate(n))
            return
        before = self.observed()
        got = self.pool.allocate(n)
        if n > len(self.queue):
            assert got is None
            assert self.observed() == before
            return
        expected, self.queue = self.queue[:n], self.queue[n:]
        for b in expected:
            h = self.hash_of.pop(b, None)
            if h is not None:
                self.by_hash[h].remove(b)
                if not self.by_hash[h]:
                    del self.by_hash[h]
            self.ref[b] = 1
        assert got == expected

    @precondition(lambda self: any(self.ref))
    @rule(data=st.data())
    def free_held(self, data: st.DataObject) -> None:
        held = [b for b in range(N) for _ in range(self.ref[b])]
        order = data.draw(st.permutations(held))
        ids = order[: data.draw(st.integers(1, len(order)))]
        assert self.model_free(ids) is None
        self.pool.free([BlockId(b) for b in ids])

    @rule(ids=st.lists(ANY_ID, max_size=4))
    def free_any(self, ids: list[int]) -> None:
        saved = (list(self.ref), list(self.queue))
        err = self.model_free(ids)
        if err is None:
            self.pool.free([BlockId(b) for b in ids])
        else:
            self.ref, self.queue = saved
            self.expect_error(err, lambda: self.pool.free([BlockId(b) for b in ids]))

    @precondition(lambda self: bool(self.by_hash) or any(self.ref))
    @rule(data=st.data())
    def touch_hit(self, data: st.DataObject) -> None:
        candidates = sorted(set(self.hash_of) | {b for b in range(N) if self.ref[b]})
        ids = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3))
        assert self.model_touch(ids) is None
        self.pool.touch([BlockId(b) for b in ids])

    @rule(ids=st.lists(ANY_ID, max_size=3))
    def touch_any(self, ids: list[int]) -> None:
        saved = (list(self.ref), list(self.queue))
        err = self.model_touch(ids)
        if err is None:
            self.pool.touch([BlockId(b) for b in ids])
        else:
            self.ref, self.queue = saved
            self.expect_error(err, lambda: self.pool.touch([BlockId(b) for b in ids]))

    @rule(block=ANY_ID, h=st.sampled_from(HASHES))
    def cache_block(self, block: int, h: BlockHash) -> None:
        call = lambda: self.pool.cache_block(BlockId(block), h)  # noqa: E731
        if not 0 <= block < N:
            self.expect_error(UnknownBlockError, call)
        elif self.ref[block] == 0 or self.hash_of.get(block, h) != h:  # free, or recached
            self.expect_error(BlockStateError, call)
        else:
            if block not in self.hash_of:
                self.hash_of[block] = h
                self.by_hash.setdefault(h, []).append(block)
            call()

    def model_lookup(self, h: BlockHash) -> int | None:
        holders = self.by_hash.get(h, [])
        return next((b for b in holders if self.ref[b] > 0), holders[0] if holders else None)

    @rule(h=st.sampled_from(HASHES))
    def lookup(self, h: BlockHash) -> None:
        assert self.pool.lookup(h) == self.model_lookup(h)

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def integrity_and_model_agree(self) -> None:
        p = self.pool
        p.check_integrity()
        assert p.free_queue_order() == self.queue
        assert [p.ref_count(BlockId(b)) for b in range(N)] == self.ref
        assert [p.block_hash(BlockId(b)) for b in range(N)] == [
            self.hash_of.get(b) for b in range(N)
        ]
        assert p.num_free_blocks == len(self.queue)
        assert p.num_used_blocks == sum(1 for r in self.ref if r)
        assert p.num_cached_blocks == len(self.hash_of)
        assert all(p.lookup(h) == self.model_lookup(h) for h in self.by_hash)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class SoakPoolMachine(PoolMachine):
    pass


TestPoolSoak = pytest.mark.slow(SoakPoolMachine.TestCase)
TestPoolSoak.settings = settings(max_examples=2000, stateful_step_count=80, deadline=None)
