"""KV events on the wire and the publisher's log: vLLM's shape, replay, snapshot, coalescing."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.events import TierChange, WatchedPolicy
from kvplane.offload.manager import OffloadManager
from kvplane.serving.kv_event_log import EventLog, coalesce
from kvplane.serving.kv_events import (
    END_SEQ,
    AllCleared,
    ChunksRemoved,
    ChunksStored,
    EventBatch,
    Origin,
    decode_batch,
    decode_end,
    decode_frame,
    encode_batch,
    parse_topic,
    replay_request,
    topic,
)

A, B, C = ChunkKey(b"a" * 32), ChunkKey(b"b" * 32), ChunkKey(b"c" * 32)


def test_batch_is_vllm_kv_event_batch_in_msgpack() -> None:
    batch = EventBatch(
        1.5, (ChunksStored((A,), "host", block_size=32), ChunksRemoved((B,), "disk"), AllCleared())
    )
    plain = msgspec.msgpack.decode(encode_batch(batch))
    assert plain == [
        1.5,
        [
            {
                "type": "BlockStored", "block_hashes": [A], "medium": "host",
                "parent_block_hash": None, "token_ids": [], "block_size": 32, "lora_id": None,
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [B], "medium": "disk"},
            {"type": "AllBlocksCleared"},
        ],
        None,
    ]  # fmt: skip
    assert decode_batch(encode_batch(batch)) == batch


def test_vllm_fields_we_do_not_use_are_ignored_and_garbage_is_none() -> None:
    vllm = msgspec.msgpack.encode(
        [2.0, [{"type": "BlockRemoved", "block_hashes": [A], "medium": "GPU", "group_idx": 3}], 0]
    )
    assert decode_batch(vllm) == EventBatch(2.0, (ChunksRemoved((A,), "GPU"),), 0)
    assert decode_batch(b"\x93garbage") is None
    too_long = msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": [b"x" * 65],
                                              "medium": "host"}], None])  # fmt: skip
    assert decode_batch(too_long) is None


def test_topic_and_frames() -> None:
    assert topic("w-1", 42) == b"kv/w-1/42"
    assert parse_topic(b"kv/w/1/42") == Origin("w/1", 42)
    for bad in (b"kv/w/x", b"kv//3", b"xx/w/3", b"kv/w/" + b"9" * 21):
        assert parse_topic(bad) is None
    payload = encode_batch(EventBatch(0.0, (AllCleared(),)))
    frame = decode_frame([b"kv/w/1", (5).to_bytes(8, "big"), payload])
    assert frame is not None and (frame.origin, frame.seq, frame.batch.resets) == (
        Origin("w", 1), 5, True
    )  # fmt: skip
    assert decode_frame([b"kv/w/1", b"\x05", payload]) is None
    assert decode_frame([b"kv/w/1", (5).to_bytes(8, "big")]) is None
    assert decode_end([b"kv/w/1", END_SEQ, (9).to_bytes(8, "big")]) == (Origin("w", 1), 9)
    assert decode_end([b"", END_SEQ, b""]) is None  # vLLM's bare end
    assert replay_request(3) == (3).to_bytes(8, "big")
    with pytest.raises(InvalidArgumentError):
        replay_request(-1)


def _seqs(frames: list[tuple[bytes, bytes, bytes]]) -> list[int]:
    return [int.from_bytes(f[1], "big") for f in frames]


def test_log_replays_its_buffer_then_snapshots_past_it() -> None:
    log = EventLog("w", 3, buffer_steps=3, block_size=16, clock=lambda: 0.0)
    assert log.next_seq == 1  # seq 0: [AllCleared]
    log.append([log.stored("host", [A, B])])
    assert _seqs(log.replay(0)) == [0, 1]
    log.append([ChunksRemoved((A,), "host"), log.stored("disk", [C])])
    log.append([log.stored("host", [C])])
    assert _seqs(log.replay(1)) == [1, 2, 3]
    assert log.replay(4) == [] and log.snapshots == 0
    (snap,) = log.replay(0)  # seq 0 left the buffer: a snapshot under the latest seq
    batch = decode_batch(snap[2])
    assert snap[0] == b"kv/w/3" and _seqs([snap]) == [3] and log.snapshots == 1
    assert batch is not None and batch.events == (
        AllCleared(), ChunksStored((C,), "disk", block_size=16),
        ChunksStored((B, C), "host", block_size=16),
    )  # fmt: skip
    assert log.holdings() == {"host": frozenset({B, C}), "disk": frozenset({C})}
    assert decode_end(list(log.end_frame())) == (Origin("w", 3), 4)


def test_coalesce_keeps_order_and_merges_runs() -> None:
    log = EventLog("w", 1)
    changes = [("host", A, True), ("host", B, True), ("host", A, False), ("disk", A, True)]
    assert coalesce(changes, log) == [
        ChunksStored((A, B), "host"), ChunksRemoved((A,), "host"), ChunksStored((A,), "disk")
    ]  # fmt: skip
    assert coalesce([], log) == []


def test_watched_policy_reports_the_managers_residency_changes() -> None:
    seen: list[TierChange] = []
    mgr = OffloadManager("host", 2)
    mgr.policy = WatchedPolicy(mgr.policy, "host", seen.append)
    plan = mgr.prepare_store([A, B], bypass_admission=True)
    assert plan is not None and seen == []  # STORING is not readable yet
    mgr.complete_store([A, B], [True, False])
    assert seen == [TierChange("host", A, True)]
    mgr.prepare_store([B, C], bypass_admission=True)  # evicts A to make room
    mgr.complete_store([B, C], True)
    assert seen[1:] == [
        TierChange("host", A, False), TierChange("host", B, True), TierChange("host", C, True)
    ]  # fmt: skip
    mgr.prepare_load([B])
    mgr.complete_load([B], ok=False)  # a bad read drops it
    assert seen[-1] == TierChange("host", B, False)
    mgr.check_integrity()
