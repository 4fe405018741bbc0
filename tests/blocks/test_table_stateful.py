"""Hypothesis stateful test: many BlockTables sharing one pool never serve wrong KV.

A fake KV pool stores, in each slot, the token prefix that produced it (what real KV depends
on). Tables admit prompts from a tiny alphabet (so prefixes are shared often), grow, compute and
release in any order. After every step: the pool is consistent, each block's ref count equals
the number of live tables holding it, each table's ranges partition its tokens, and every
computed or cached token of every live table reads back exactly its own prefix from the slot
``slot_mapping`` names, so a prefix hit never serves KV of another sequence. Writes only ever go
to blocks the writing table holds alone. The pool has a null block: tables drop computed blocks
out of a (pretend) window and receivers admit with the leading blocks dropped; only the held
range is read back, and dropped or partial KV is never matched.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from kvplane.blocks.hashing import BlockHasher
from kvplane.blocks.pool import BlockPool
from kvplane.blocks.table import BlockTable, TableState
from kvplane.ids import BlockId, RequestId, TokenRange

NUM_BLOCKS = 10
BS = 2
HASHER = BlockHasher(seed=11, fingerprint=b"stateful")
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=7)


class TableMachine(RuleBasedStateMachine):
    tables = Bundle("tables")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS + 1, BS, null_block=True)  # block NUM_BLOCKS is null
        self.kv: list[tuple[int, ...] | None] = [None] * ((NUM_BLOCKS + 1) * BS)
        self.live: dict[str, BlockTable] = {}
        self.received: dict[str, int] = {}  # a received table's first position with KV
        self.next_id = 0

    @rule(target=tables, tokens=TOKENS)
    def admit(self, tokens: list[int]) -> str:
        rid = f"r{self.next_id}"
        self.next_id += 1
        t = BlockTable(RequestId(rid), BS, HASHER)
        free_before = self.pool.num_free_blocks
        res = t.admit(self.pool, tokens)
        if res is None:
            assert free_before < -(-len(tokens) // BS)  # enough free blocks always admit
            assert t.state is TableState.NEW
        else:
            self.live[rid] = t
            assert res.cached_range == t.cached_range
            assert len(res.cached_range) == BS * res.num_cached_blocks < len(tokens)
        return rid

    @rule(target=tables, tokens=TOKENS, data=st.data())
    def receive(self, tokens: list[int], data: st.DataObject) -> str:
        """A PD receiver: admit with the blocks before ``first`` dropped, get ``[first, n)``."""
        rid = f"r{self.next_id}"
        self.next_id += 1
        first = data.draw(st.integers(0, len(tokens)))
        t = BlockTable(RequestId(rid), BS, HASHER)
        if t.admit(self.pool, tokens, drop_before=first) is None:
            assert t.state is TableState.NEW
            return rid
        self.live[rid] = t
        if first:  # the KV before ``first`` never arrives: no prefix hit, nothing cached
            assert t.num_cached_tokens == 0
        assert t.num_dropped_blocks == first // BS
        first = max(first, t.num_cached_tokens)  # the sender skips the receiver's prefix
        self.received[rid] = first
        held = TokenRange(first, len(tokens))
        for pos, slot in zip(range(held.start, held.end), t.slot_mapping(held).tolist(),
                             strict=True):  # fmt: skip
            assert self.pool.ref_count(BlockId(slot // BS)) == 1
            self.kv[slot] = tuple(tokens[: pos + 1])
        t.mark_computed(self.pool, len(t.new_range))
        return rid

    @rule(rid=tables, data=st.data())
    def drop(self, rid: str, data: st.DataObject) -> None:
        t = self.live.get(rid)
        if t is None:
            return
        position = data.draw(st.integers(0, t.num_computed_tokens))
        held = t.num_held_blocks
        freed = t.drop_before(self.pool, position)
        assert t.num_held_blocks == held - freed
        assert t.num_dropped_blocks >= position // BS

    @rule(rid=tables, tokens=st.lists(st.integers(0, 1), max_size=3))
    def append(self, rid: str, tokens: list[int]) -> None:
        t = self.live.get(rid)
        if t is None:
            return
        before = (t.block_ids, t.num_tokens, self.pool.free_queue_order())
        need = -(-(t.num_tokens + len(tokens)) // BS) - len(t.block_ids)
        ok = t.append_tokens(self.pool, tokens)
        assert ok == (need <= before[2].__len__())
        if not ok:
            assert (t.block_ids, t.num_tokens, self.pool.free_queue_order()) == before

    @rule(rid=tables, data=st.data())
    def compute(self, rid: str, data: st.DataObject) -> None:
        t = self.live.get(rid)
        if t is None:
            return
        k = data.draw(st.integers(0, len(t.new_range)))
        rng = TokenRange(t.new_range.start, t.new_range.start + k)
        tokens = t.token_ids.tolist()
        for pos, slot in zip(range(rng.start, rng.end), t.slot_mapping(rng).tolist(), strict=True):
            block = BlockId(slot // BS)
            assert self.pool.ref_count(block) == 1  # never write into a shared block
            assert self.pool.block_hash(block) is None  # nor into a cached one
            self.kv[slot] = tuple(tokens[: pos + 1])
        t.mark_computed(self.pool, k)

    @rule(rid=tables)
    def release(self, rid: str) -> None:
        t = self.live.pop(rid, None)
        if t is not None:
            t.release(self.pool)
            t.release(self.pool)  # idempotent

    @invariant()
    def pool_and_tables_agree(self) -> None:
        pool = self.pool
        pool.check_integrity()
        holders = [0] * NUM_BLOCKS
        for t in self.live.values():
            dropped = t.num_dropped_blocks
            assert set(t.block_ids[:dropped]) <= {NUM_BLOCKS}
            for b in t.block_ids[dropped:]:
                holders[b] += 1
            n = t.num_tokens
            assert len(t.block_ids) == -(-n // BS)
            assert len(set(t.block_ids[dropped:])) == len(t.block_ids) - dropped
            assert t.cached_range.end == t.computed_range.start
            assert t.computed_range.end == t.new_range.start
            assert t.new_range.end == n
            assert t.num_cached_tokens % BS == 0
            tokens = t.token_ids.tolist()
            assert list(t.block_hashes) == HASHER.hash_blocks(tokens, BS)
            first = max(dropped * BS, self.received.get(str(t.request_id), 0))
            done = TokenRange(min(first, t.num_computed_tokens), t.num_computed_tokens)
            for pos, slot in zip(range(done.start, done.end), t.slot_mapping(done).tolist(),
                                 strict=True):  # fmt: skip
                assert self.kv[slot] == tuple(tokens[: pos + 1])
            for i in range(dropped, t.num_computed_tokens // BS):  # held full computed blocks
                cached = pool.block_hash(t.block_ids[i])  # are findable, but partial KV never
                partial = self.received.get(str(t.request_id), 0) > t.num_cached_tokens
                assert cached is None if partial else cached is not None
                assert cached is None or pool.lookup(cached) is not None
        assert holders == [pool.ref_count(BlockId(b)) for b in range(NUM_BLOCKS)]

    def teardown(self) -> None:
        for t in self.live.values():
            t.release(self.pool)
        self.pool.check_integrity()
        assert self.pool.num_free_blocks == NUM_BLOCKS


TestTableMachine = TableMachine.TestCase
TestTableMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


class SoakTableMachine(TableMachine):
    pass


TestTableSoak = pytest.mark.slow(SoakTableMachine.TestCase)
TestTableSoak.settings = settings(max_examples=1500, stateful_step_count=80, deadline=None)
