"""A worker started with KV event settings publishes its offload tiers' chunk changes."""

from __future__ import annotations

from pathlib import Path

from kvplane.ids import ChunkKey
from kvplane.offload import OffloadConfig
from kvplane.serving.kv_events import AllCleared, ChunksStored, decode_batch
from kvplane.serving.kv_publisher import KVEventSettings
from kvplane.serving.prefill_worker import PrefillWorker
from kvplane.serving.prefix_offload import PrefixSettings
from kvplane.serving.producers.synthetic import SyntheticProducer
from kvplane.serving.router.kv_subscriber import EventSource, KVEventSubscriber
from kvplane.testing.cluster import MLA, TEST_SECRET, base_config, wait_for


def test_prefill_worker_publishes_its_tiers_and_a_subscriber_indexes_them() -> None:
    offload = PrefixSettings(OffloadConfig(host_slots=4, pin_memory=False), 2)
    p = PrefillWorker(
        base_config(), SyntheticProducer(MLA), offload=offload, kv_events=KVEventSettings()
    )
    assert p.offload is not None
    host = p.offload.cascade.host_manager
    p.start()
    try:
        assert p.kv_events is not None and p.kv_events.log.block_size == 32
        sub = KVEventSubscriber(
            [EventSource(p.kv_events.address, p.kv_events.replay_address)],
            secret=TEST_SECRET, resync_s=0.1,
        )  # fmt: skip
        sub.start()
        key = ChunkKey(b"k" * 32)
        # the worker loop owns the tiers; with no request running, a store is safe here
        host.prepare_store([key], bypass_admission=True)
        host.complete_store([key], True)
        wait_for(lambda: sub.index.holdings("prefill") == {"host": frozenset({key})})
        host.evict([key])
        wait_for(lambda: sub.index.holdings("prefill") == {}, what="the eviction")
        assert p.stats().counters["kv_events_events_published"] == 2
        sub.close()
    finally:
        p.close()


def test_a_cold_tier_event_says_the_tokens_of_its_own_chunk(tmp_path: Path) -> None:
    """A disk chunk of 2 host chunks (4 blocks of 16 tokens) is published as 64 tokens, the
    host's as 32, live and in a replay's snapshot."""
    config = OffloadConfig(
        host_slots=4,
        pin_memory=False,
        disk_path=tmp_path / "disk",
        disk_slots=4,
        disk_blocks_per_chunk=4,
    )
    p = PrefillWorker(
        base_config(), SyntheticProducer(MLA), offload=PrefixSettings(config, 2),
        kv_events=KVEventSettings(buffer_steps=1),
    )  # fmt: skip
    assert p.offload is not None
    disk = next(m for m in p.offload.cascade.managers() if m.tier == "disk")
    p.start()
    try:
        assert p.kv_events is not None
        key = ChunkKey(b"d" * 32)
        disk.prepare_store([key], bypass_admission=True)
        disk.complete_store([key], True)
        log = p.kv_events.log
        wait_for(lambda: log.holdings() == {"disk": frozenset({key})})
        stored = ChunksStored((key,), "disk", block_size=64)
        assert log.stored("disk", [key]) == stored
        assert log.stored("host", [key]) == ChunksStored((key,), "host", block_size=32)
        (snapshot,) = log.replay(0)  # seq 0 is no longer buffered
        batch = decode_batch(snapshot[2])
        assert batch is not None and batch.events == (AllCleared(), stored)
    finally:
        p.close()
