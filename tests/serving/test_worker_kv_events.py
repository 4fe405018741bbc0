"""A worker started with KV event settings publishes its offload tiers' chunk changes."""

from __future__ import annotations

from kvplane.ids import ChunkKey
from kvplane.offload import OffloadConfig
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
