"""The scheduler side against fake requests: matches, load and store plans, frees, reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.messages import (
    JobReport,
    LoadOp,
    Promotion,
    StoreOp,
    TierIndex,
    TierWrite,
    WorkerReport,
)
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest, SchedulerSide
from kvplane.metrics import MetricsRegistry
from kvplane.offload.slots import SlotStatus

FP = b"f" * 16
TOKENS = list(range(1, 21))  # 20 tokens, block 4, 2 blocks per chunk: 2 full chunks


def keys_of(tokens: list[int], n: int) -> list[ChunkKey]:
    hashes = BlockHasher(0, FP).hash_blocks(tokens[:n], 4)
    return ChunkSpec(4, 2).chunk_keys(hashes)


def side(tmp_path: Path, **extra: object) -> tuple[SchedulerSide, MetricsRegistry]:
    cfg = {"blocks_per_chunk": 2, "host_slots": 4, "disk_path": str(tmp_path / "d"), **extra}
    metrics = MetricsRegistry()
    return SchedulerSide(parse_extra_config(cfg, {}), 4, metrics), metrics


def report(*jobs: tuple[int, str, tuple[bool, ...]]) -> WorkerReport:
    return WorkerReport(tuple(JobReport(j, t, ok) for j, t, ok in jobs))


def test_nothing_before_the_worker_handshake(tmp_path: Path) -> None:
    s, _ = side(tmp_path)
    view = RequestView("a", TOKENS)
    assert not s.ready
    assert s.matched_tokens(view, 0) == 0
    assert s.allocated(view, [1, 2, 3, 4, 5], 0) is None
    assert s.build_step([ScheduledRequest(view, 20, [1, 2, 3, 4, 5])]).empty
    s.set_index(TierIndex(FP, 128))
    with pytest.raises(InvalidArgumentError, match="already"):
        s.set_index(TierIndex(FP, 128))


def test_store_then_a_second_request_loads_the_prefix(tmp_path: Path) -> None:
    s, m = side(tmp_path)
    s.set_index(TierIndex(FP, 128))
    k = keys_of(TOKENS, 20)
    a = RequestView("a", TOKENS)
    assert s.matched_tokens(a, 0) == 0
    assert s.allocated(a, [11, 12, 13, 14, 15], 0) is None
    meta = s.build_step([ScheduledRequest(a, 20, [11, 12, 13, 14, 15])])
    write = TierWrite("disk", (0, 1), (0, 1))
    assert meta.stores == (StoreOp(1, "a", (k[0], k[1]), (0, 1), (11, 12, 13, 14), (write,)),)
    assert meta.loads == () and not meta.flush
    assert s.book.host.status(k[0]) is SlotStatus.STORING

    b = RequestView("b", [*TOKENS[:16], 99, 98])
    assert s.matched_tokens(b, 0) is None  # a's store is in flight: ask again
    s.apply(report((1, "host", (True, True))))
    assert s.book.host.status(k[0]) is SlotStatus.LOADING  # pinned for the disk write
    assert s.matched_tokens(b, 0) == 16
    load = s.allocated(b, [21, 22, 23, 24, 25], 16)
    assert load == LoadOp(2, "b", (k[0], k[1]), (0, 1), (21, 22, 23, 24))
    assert s.build_step([]).loads == (load,)
    s.apply(report((1, "disk", (True, True)), (2, "device", (True, True))))
    assert s.book.lower["disk"].status(k[1]) is SlotStatus.READY
    assert s.book.host.status(k[1]) is SlotStatus.READY
    s.finished("a")
    s.finished("b")
    assert s.tracked_requests() == [] and s.fenced_blocks == []
    assert m.value("vllm_hit_tokens", suffix="_total") == 16
    assert m.value("vllm_stored_chunks", suffix="_total") == 2
    assert m.value("vllm_ask_again", suffix="_total") == 1
    assert s.jobs_in_flight == 0 and s.tracked_requests() == []
    s.check_integrity()


def test_the_last_token_is_never_offered(tmp_path: Path) -> None:
    s, _ = side(tmp_path)
    s.set_index(TierIndex(FP, 128))
    a = RequestView("a", TOKENS[:16])
    s.allocated(a, [1, 2, 3, 4], 0)
    s.build_step([ScheduledRequest(a, 16, [1, 2, 3, 4])])
    s.apply(report((1, "host", (True, True)), (1, "disk", (True, True))))
    assert s.matched_tokens(RequestView("b", TOKENS[:16]), 0) == 8
    assert s.matched_tokens(RequestView("c", TOKENS[:17]), 0) == 16


def test_load_after_a_local_hit_skips_the_computed_blocks(tmp_path: Path) -> None:
    s, _ = side(tmp_path)
    s.set_index(TierIndex(FP, 128))
    a = RequestView("a", TOKENS)
    s.allocated(a, [1, 2, 3, 4, 5], 0)
    s.build_step([ScheduledRequest(a, 20, [1, 2, 3, 4, 5])])
    s.apply(report((1, "host", (True, True)), (1, "disk", (True, True))))
    b = RequestView("b", TOKENS)
    assert s.matched_tokens(b, 4) == 12  # vLLM holds block 0 locally
    op = s.allocated(b, [7, 8, 9, 10, 11], 12)
    assert op is not None
    assert (op.keys, op.skip_blocks, op.block_ids) == (tuple(keys_of(TOKENS, 16)), 1, (8, 9, 10))
    assert s.matched_tokens(b, 6) == 0  # not block aligned: nothing offered


def test_a_finished_request_fences_the_blocks_its_gather_reads(tmp_path: Path) -> None:
    s, m = side(tmp_path)
    s.set_index(TierIndex(FP, 128))
    a = RequestView("a", TOKENS)
    s.allocated(a, [1, 2, 3, 4, 5], 0)
    s.build_step([ScheduledRequest(a, 20, [1, 2, 3, 4, 5])])
    assert s.finished("a") is None  # vLLM frees the blocks now
    assert s.fenced_blocks == [1, 2, 3, 4] and s.tracked_requests() == ["a"]
    other = list(range(100, 120))
    b = RequestView("b", other)
    s.allocated(b, [5, 6, 7], 0)
    assert s.build_step([ScheduledRequest(b, 12, [5, 6, 7])]).flush is False  # 5: not read
    c = RequestView("c", TOKENS)  # a prefix-cache hit on blocks 1-4 writes only block 5
    assert s.build_step([ScheduledRequest(c, 20, [1, 2, 3, 4, 5], 16)]).flush is False
    d = RequestView("d", [*other, 1, 2])
    assert s.build_step([ScheduledRequest(d, 22, [5, 6, 7, 8, 9, 3], 12)]).flush is True
    s.will_write([9, 4])  # a PD receive into block 4 flushes the next step
    assert s.build_step([]).flush is True and s.build_step([]).flush is False
    s.apply(report((1, "host", (True, True))))
    assert s.fenced_blocks == [] and "a" not in s.tracked_requests()
    assert s.build_step([ScheduledRequest(d, 22, [5, 6, 7, 8, 9, 3], 12)]).flush is False
    s.apply(report((1, "disk", (True, True))))
    assert m.value("vllm_fenced_frees", suffix="_total") == 1


def test_preempted_request_with_gathers_flushes(tmp_path: Path) -> None:
    s, _ = side(tmp_path)
    s.set_index(TierIndex(FP, 128))
    a = RequestView("a", TOKENS)
    s.allocated(a, [1, 2, 3, 4, 5], 0)
    s.build_step([ScheduledRequest(a, 20, [1, 2, 3, 4, 5])])
    assert s.build_step([], preempted=["a", "zz"]).flush is True
    s.apply(report((1, "host", (True, True)), (1, "disk", (True, True))))
    assert s.build_step([], preempted=["a"]).flush is False


def test_restart_index_promotes_and_a_bad_read_is_dropped(tmp_path: Path) -> None:
    s, m = side(tmp_path)
    k = keys_of(TOKENS, 20)
    s.set_index(TierIndex(FP, 128, (("disk", ((k[0], 3), (k[1], 0))),)))
    b = RequestView("b", TOKENS)
    assert s.matched_tokens(b, 0) == 16
    op = s.allocated(b, [5, 6, 7, 8, 9], 16)
    assert op is not None
    assert op.promotions == (Promotion(0, "disk", 3), Promotion(1, "disk", 0))
    assert op.host_slots == (0, 1)
    s.build_step([])
    assert m.value("vllm_hit_tokens", suffix="_total") == 0  # promised, not loaded yet
    s.apply(report((op.job_id, "device", (True, False))))
    # only chunk 0 reached vLLM: the tokens of chunk 1 are recomputed, not hits
    assert m.value("vllm_hit_tokens", suffix="_total") == 8
    assert m.value("vllm_hit_chunks", {"tier": "disk"}, "_total") == 1
    assert s.book.host.status(k[0]) is SlotStatus.READY
    assert s.book.host.status(k[1]) is SlotStatus.EMPTY
    assert s.book.lower["disk"].status(k[1]) is SlotStatus.EMPTY  # dropped after a bad read
    assert m.value("offload_dropped_chunks", {"tier": "disk"}, "_total") == 1
    assert m.value("vllm_load_failed_chunks", suffix="_total") == 1
    # vLLM recomputes chunk 1: the next step of b offers it for storing again.
    meta = s.build_step([ScheduledRequest(b, 20, [5, 6, 7, 8, 9])])
    assert [op.keys for op in meta.stores] == [(k[1],)]
    assert meta.stores[0].block_ids == (7, 8)


def test_lower_tier_hits_are_offered_only_as_far_as_host_can_promote_them(
    tmp_path: Path,
) -> None:
    s, m = side(tmp_path, host_slots=2)
    k = keys_of(TOKENS, 20)
    s.set_index(TierIndex(FP, 128, (("disk", ((k[0], 3), (k[1], 0))),)))
    other = RequestView("a", list(range(100, 120)))
    s.allocated(other, [1, 2, 3, 4, 5], 0)
    (store,) = s.build_step([ScheduledRequest(other, 20, [1, 2, 3, 4, 5])]).stores
    b = RequestView("b", TOKENS)
    assert s.matched_tokens(b, 0) == 0  # both host slots are STORING: nothing to promote into
    s.apply(report((store.job_id, "host", (True, True))))
    assert s.matched_tokens(b, 0) == 0  # still pinned for their write-through to disk
    s.apply(report((store.job_id, "disk", (True, True))))
    assert s.matched_tokens(b, 0) == 16  # READY and unpinned: evictable
    op = s.allocated(b, [6, 7, 8, 9, 10], 16)
    assert op is not None and op.doomed_from is None and len(op.promotions) == 2
    s.build_step([])
    s.apply(report((op.job_id, "device", (True, True))))
    assert m.value("vllm_load_failed_chunks", suffix="_total") == 0
    s.check_integrity()


def test_a_host_too_small_for_the_promotions_offers_what_fits(tmp_path: Path) -> None:
    s, _ = side(tmp_path, host_slots=1)
    k = keys_of(TOKENS, 20)
    s.set_index(TierIndex(FP, 128, (("disk", ((k[0], 3), (k[1], 0))),)))
    b = RequestView("b", TOKENS)
    assert s.matched_tokens(b, 0) == 8  # one chunk fits, and not "ask again"
    op = s.allocated(b, [6, 7, 8, 9, 10], 8)
    assert op is not None and op.doomed_from is None and op.promotions == (Promotion(0, "disk", 3),)


def test_stored_chunks_count_only_gathers_that_succeeded(tmp_path: Path) -> None:
    m = MetricsRegistry()
    s = SchedulerSide(parse_extra_config({"blocks_per_chunk": 2, "host_slots": 4}, {}), 4, m)
    s.set_index(TierIndex(FP, 128))
    a = RequestView("a", TOKENS)
    s.allocated(a, [1, 2, 3, 4, 5], 0)
    (op,) = s.build_step([ScheduledRequest(a, 20, [1, 2, 3, 4, 5])]).stores
    assert m.value("vllm_stored_chunks", suffix="_total") == 0  # reserved, not stored yet
    s.apply(report((op.job_id, "host", (False, True))))
    assert m.value("vllm_stored_chunks", suffix="_total") == 1
    s.check_integrity()


def test_no_host_room_skips_the_store(tmp_path: Path) -> None:
    s, m = side(tmp_path, host_slots=1)
    s.set_index(TierIndex(FP, 128))
    a = RequestView("a", TOKENS)
    s.allocated(a, [1, 2, 3, 4, 5], 0)
    assert s.build_step([ScheduledRequest(a, 20, [1, 2, 3, 4, 5])]).stores == ()
    assert m.value("vllm_store_no_room", suffix="_total") == 2
    s.finished("a")
    assert s.tracked_requests() == [] and s.fenced_blocks == []
    s.check_integrity()


def test_ineligible_requests_are_left_alone(tmp_path: Path) -> None:
    s, _ = side(tmp_path)
    s.set_index(TierIndex(FP, 128))
    emb = RequestView("e", TOKENS, eligible=False)
    assert s.matched_tokens(emb, 0) == 0
    assert s.allocated(emb, [1, 2, 3, 4, 5], 0) is None
    assert s.build_step([ScheduledRequest(emb, 20, [1, 2, 3, 4, 5])]).stores == ()
    assert s.tracked_requests() == []


def test_reports_must_name_known_jobs(tmp_path: Path) -> None:
    s, _ = side(tmp_path)
    s.set_index(TierIndex(FP, 128))
    with pytest.raises(InvalidArgumentError, match="unknown job 9"):
        s.apply(report((9, "host", (True,))))
    a = RequestView("a", TOKENS)
    s.allocated(a, [1, 2, 3, 4, 5], 0)
    s.build_step([ScheduledRequest(a, 20, [1, 2, 3, 4, 5])])
    with pytest.raises(InvalidArgumentError, match="out of order"):
        s.apply(report((1, "disk", (True, True))))


def test_a_chunk_whose_host_copy_is_doomed_is_offered_again_until_stored(tmp_path: Path) -> None:
    s, _ = side(tmp_path)
    s.set_index(TierIndex(FP, 128))
    k = keys_of(TOKENS, 20)
    host = s.book.host
    s.book.lookup(k[:1])
    res = s.book.reserve_store(k[:1], write_through=True)
    assert res is not None
    s.book.gathered(res.keys, res.writes, [True])
    for w in res.writes:
        s.book.written(res.keys, w, [True], [True])
    host.prepare_load(k[:1])  # two readers of the host copy (two loads)...
    host.prepare_load(k[:1])
    host.complete_load(k[:1], ok=False)  # ...one read it back bad: doomed, still pinned
    a = RequestView("a", TOKENS)
    assert s.matched_tokens(a, 0) == 0
    assert s.allocated(a, [1, 2, 3, 4, 5], 0) is None
    step = ScheduledRequest(a, 20, [1, 2, 3, 4, 5])
    first = s.build_step([step]).stores
    assert [op.keys for op in first] == [(k[1],)]  # k0 deferred: its slot is still busy
    assert s.build_step([step]).stores == ()  # offered again: still busy
    host.complete_load(k[:1])  # the last reader is done: the bad copy is dropped
    again = s.build_step([step]).stores
    assert [(op.keys, op.block_ids) for op in again] == [((k[0],), (1, 2))]
    assert s.build_step([step]).stores == ()  # stored now: not offered again
    for op in (*first, *again):
        s.apply(
            report((op.job_id, "host", (True,)), *((op.job_id, w.tier, (True,)) for w in op.writes))
        )
    s.check_integrity()


@pytest.mark.parametrize(("mode", "host_async", "disk_async"), [
    ("sync", False, False),
    ("async", True, True),
    ("auto", False, True),
])  # fmt: skip
def test_the_load_mode_says_which_hits_load_asynchronously(
    tmp_path: Path, mode: str, host_async: bool, disk_async: bool
) -> None:
    s, m = side(tmp_path, load_mode=mode)
    k = keys_of(TOKENS, 20)
    s.set_index(TierIndex(FP, 128, (("disk", ((k[0], 3), (k[1], 0))),)))
    b = RequestView("b", TOKENS)
    assert s.match(b, 0) == (16, disk_async)
    assert s.matched_tokens(b, 0) == 16
    op = s.allocated(b, [5, 6, 7, 8, 9], 16)
    assert op is not None and op.load_async is disk_async
    assert s.build_step([]).loads == (op,)
    s.apply(report((op.job_id, "device", (True, True))))
    c = RequestView("c", [*TOKENS[:16], 77])  # both chunks are in host now
    assert s.match(c, 0) == (16, host_async)
    assert s.match(c, 8) == (8, host_async)  # after a local hit of chunk 0
    assert s.match(RequestView("d", list(range(200, 221))), 0) == (0, False)  # a miss
    load = s.allocated(c, [10, 11, 12, 13, 14], 8)
    assert load is not None and load.load_async is host_async and load.block_ids == (12, 13)
    s.build_step([])
    s.apply(report((load.job_id, "device", (True,))))
    modes = [m.value("vllm_loads", {"mode": x}, "_total") for x in ("sync", "async")]
    assert modes == [2 - disk_async - host_async, disk_async + host_async]
    s.check_integrity()


def test_auto_loads_a_run_that_reaches_below_host_asynchronously(tmp_path: Path) -> None:
    s, _ = side(tmp_path)
    k = keys_of(TOKENS, 20)
    s.set_index(TierIndex(FP, 128, (("disk", ((k[1], 0),)),)))  # chunk 1 on disk
    a = RequestView("a", TOKENS[:9])  # stores chunk 0 into host
    s.allocated(a, [1, 2, 3], 0)
    (store,) = s.build_step([ScheduledRequest(a, 9, [1, 2, 3])]).stores
    s.apply(report((store.job_id, "host", (True,)), (store.job_id, "disk", (True,))))
    b = RequestView("b", TOKENS)
    assert s.match(b, 0) == (16, True)  # chunk 0 from host, chunk 1 from disk
    assert s.match(b, 8) == (8, True)
    assert s.match(RequestView("c", TOKENS[:9]), 0) == (8, False)  # chunk 0 alone: host
    s.finished("a")
    s.check_integrity()
