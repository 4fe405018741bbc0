"""Window-only hits of the scheduler side, without vLLM: with a sliding window a hit needs only
the chunks of its end's window held, loads only those, and never reaches a chunk missing from
that window (:class:`~kvplane.integrations.vllm.hits.Hits`).

Block size 4, chunks of 2 blocks (8 tokens), window 12 tokens: the hit ending at token 40 reads
blocks 7-9 (chunks 3-4), one ending at 32 blocks 5-7 (chunks 2-3), at 24 blocks 3-5 (1-2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.hits import LoadGrid
from kvplane.integrations.vllm.messages import JobReport, LoadOp, TierIndex, WorkerReport
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest, SchedulerSide
from kvplane.integrations.vllm.windows import KVWindow
from kvplane.metrics import MetricsRegistry
from kvplane.offload.slots import SlotStatus

FP = b"f" * 16
PROMPT = list(range(1, 42))  # 41 tokens: 5 full chunks, the hit stops before token 40
OTHER = list(range(100, 125))  # 24 tokens of another prompt: 3 chunks
TABLE = list(range(21, 32))  # 11 blocks, as vLLM allocates them for PROMPT with no window


def keys_of(tokens: list[int]) -> list[ChunkKey]:
    hashes = BlockHasher(0, FP).hash_blocks(tokens, 4)
    return ChunkSpec(4, 2).chunk_keys(hashes)


def side(window: int | None, host_slots: int = 8) -> tuple[SchedulerSide, MetricsRegistry]:
    config = parse_extra_config({"blocks_per_chunk": 2, "host_slots": host_slots}, {})
    metrics = MetricsRegistry()
    kv = None if window is None else KVWindow(window, 4)
    s = SchedulerSide(config, 4, metrics, window=kv)
    s.set_index(TierIndex(FP, 128))
    return s, metrics


def store(s: SchedulerSide, req_id: str, tokens: list[int]) -> None:
    """Request ``req_id`` computes ``tokens`` (fresh blocks) and its gathers report done."""
    view = RequestView(req_id, tokens)
    table = list(range(100, 100 + len(tokens) // 4 + 1))
    s.allocated(view, table, 0)
    meta = s.build_step([ScheduledRequest(view, len(tokens), table)])
    s.apply(
        WorkerReport(
            tuple(JobReport(op.job_id, "host", (True,) * len(op.keys)) for op in meta.stores)
        )
    )
    s.finished(req_id)


def evict(s: SchedulerSide, *chunks: int) -> None:
    keys = keys_of(PROMPT)
    s.book.host.evict([keys[i] for i in chunks])


def vllm_table(s: SchedulerSide, computed: int) -> list[int]:
    """PROMPT's table once ``computed`` tokens are in: the null block before the window."""
    kept = 0 if s.window is None else s.window.first_kept_block(computed)
    return [0] * kept + TABLE[kept:]


def load(s: SchedulerSide, tokens: int) -> LoadOp:
    view = RequestView("b", PROMPT)
    op = s.allocated(view, vllm_table(s, tokens), tokens)
    assert isinstance(op, LoadOp)
    return op


def test_evicted_early_chunks_still_give_the_whole_hit() -> None:
    """Host holds 5 chunks: OTHER's 3 evict PROMPT's oldest, chunks 0-2 (LRU)."""
    s, m = side(12, host_slots=5)
    store(s, "a", PROMPT)
    store(s, "c", OTHER)
    keys = keys_of(PROMPT)
    held = [s.book.host.status(k) is SlotStatus.READY for k in keys]
    assert held == [False, False, False, True, True]
    assert s.match(RequestView("b", PROMPT), 0) == (40, False)
    op = load(s, 40)
    assert (op.first_chunk, op.skip_blocks, op.keys) == (3, 1, tuple(keys[3:5]))
    assert op.block_ids == (28, 29, 30) and op.doomed_from is None  # blocks 7-9
    s.apply(WorkerReport((JobReport(op.job_id, "host", (True, True)),)))
    assert m.value("vllm_hit_tokens", None, "_total") == 40
    assert m.value("vllm_hit_chunks", {"tier": "host"}, "_total") == 2
    s.check_integrity()


def test_without_a_window_evicted_early_chunks_are_a_miss() -> None:
    s, _ = side(None, host_slots=5)
    store(s, "a", PROMPT)
    store(s, "c", OTHER)
    assert s.match(RequestView("b", PROMPT), 0) == (0, False)


@pytest.mark.parametrize(
    ("evicted", "hit", "first_chunk", "skip", "block_ids"),
    [
        ((), 40, 3, 1, (28, 29, 30)),
        ((0, 1, 2), 40, 3, 1, (28, 29, 30)),
        ((3,), 24, 1, 1, (24, 25, 26)),  # the window of 40 and of 32 needs chunk 3
        ((4,), 32, 2, 1, (26, 27, 28)),  # a gap at the end: the window of 32 is held
        ((2, 4), 16, 0, 1, (22, 23, 24)),  # the windows of 32 and 24 need chunk 2
        ((1, 3), 8, 0, 0, (21, 22)),  # those of 40 and 32 need chunk 3, of 24 and 16 chunk 1
        ((0, 2, 4), 0, 0, 0, ()),  # every window reaches a missing chunk
        ((0, 4), 32, 2, 1, (26, 27, 28)),
        ((0, 2), 40, 3, 1, (28, 29, 30)),
    ],
)
def test_a_gap_in_the_window_shortens_the_hit(
    evicted: tuple[int, ...], hit: int, first_chunk: int, skip: int, block_ids: tuple[int, ...]
) -> None:
    """Every chunk the hit's window reads is held; none before it is needed."""
    s, _ = side(12)
    store(s, "a", PROMPT)
    evict(s, *evicted)
    assert s.matched_tokens(RequestView("b", PROMPT), 0) == hit
    if hit:
        op = load(s, hit)
        keys = keys_of(PROMPT)[first_chunk : hit // 8]
        assert 0 not in op.block_ids  # vLLM's null block is never written nor read
        assert (op.first_chunk, op.skip_blocks, op.keys, op.block_ids) == (
            first_chunk,
            skip,
            tuple(keys),
            block_ids,
        )


def test_a_local_hit_inside_the_window_starts_the_load_there() -> None:
    s, _ = side(12)
    store(s, "a", PROMPT)
    evict(s, 0, 1, 2)
    view = RequestView("b", PROMPT)
    assert s.matched_tokens(view, 36) == 4  # vLLM holds tokens 0-35 itself
    op = s.allocated(view, vllm_table(s, 40), 4)
    assert isinstance(op, LoadOp)
    assert (op.first_chunk, op.skip_blocks, op.block_ids) == (4, 1, (30,))


def test_a_window_chunk_being_stored_asks_again() -> None:
    s, m = side(12)
    store(s, "a", PROMPT[:33])  # chunks 0-3
    view = RequestView("a2", PROMPT)
    s.allocated(view, TABLE, 0)
    s.build_step([ScheduledRequest(view, 41, TABLE)])  # chunk 4's store is in flight
    evict(s, 0)
    assert s.matched_tokens(RequestView("b", PROMPT), 0) is None
    assert m.value("vllm_ask_again", None, "_total") == 1


@pytest.mark.parametrize(
    ("window", "host_4", "hit", "skip"),
    [(12, False, 32, 1), (12, True, 40, 3), (None, False, 0, 0)],
)
def test_a_window_load_starts_on_a_whole_lower_tier_chunk(
    tmp_path: Path, window: int | None, host_4: bool, hit: int, skip: int
) -> None:
    """A restarted engine's disk (chunks of 2 host chunks) holds only PROMPT's chunks 2-3. The
    window of 40 (from chunk 3) is read from the pair 2-3 on; it needs chunk 4 (a pair not
    whole on disk) in host, else the hit is the window of 32, the pair itself."""
    extra = {"blocks_per_chunk": 2, "host_slots": 8, "disk_path": str(tmp_path / "d.bin")}
    extra |= {"disk_slots": 4, "disk_blocks_per_chunk": 4}
    kv = None if window is None else KVWindow(window, 4)
    s = SchedulerSide(parse_extra_config(extra, {}), 4, MetricsRegistry(), window=kv)
    keys = keys_of(PROMPT)
    s.set_index(TierIndex(FP, 128, (("disk", ((keys[3], 0),)),)))
    if host_4:
        store(s, "a", PROMPT)
        (down,) = s.build_step([]).demotes
        assert down.tier_keys == (keys[1],)  # pair 0-1 written down; 2-3 was held already
        s.apply(WorkerReport((JobReport(down.job_id, "disk", (True,)),)))
        s.book.host.evict(keys[:4])
    assert s.match(RequestView("b", PROMPT), 0) == (hit, hit > 0)  # auto: async from disk
    if hit:
        op = load(s, hit)
        assert (op.first_chunk, op.skip_blocks, op.keys) == (2, skip, tuple(keys[2 : hit // 8]))
        assert op.block_ids == tuple(TABLE[skip + 4 : hit // 4])
        assert [(p.index, p.tier) for p in op.promotions] == [(0, "disk"), (1, "disk")]


@pytest.mark.parametrize(
    ("window", "align", "computed", "end", "want"),
    [
        (None, 1, 0, 40, (0, 0)),
        (12, 1, 0, 40, (7, 3)),
        (12, 1, 36, 40, (9, 4)),  # the local hit is past the window start
        (12, 2, 0, 40, (7, 2)),  # on a whole pair of chunks
        (8, 1, 0, 8, (0, 0)),
    ],
)
def test_a_load_starts_at_the_first_held_block_on_whole_groups(
    window: int | None, align: int, computed: int, end: int, want: tuple[int, int]
) -> None:
    kv = None if window is None else KVWindow(window, 4)
    assert LoadGrid(ChunkSpec(4, 2), align, kv).load_start(computed, end) == want
