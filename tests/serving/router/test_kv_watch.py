"""The router's KV event watch: sources from membership infos, subscriber replaced on change."""

from __future__ import annotations

from kvplane.serving.messages import WorkerInfo
from kvplane.serving.router.kv_subscriber import EventSource
from kvplane.serving.router.kv_watch import KVEventWatch, sources_of

PUB, REPLAY = "tcp://127.0.0.1:5601", "tcp://127.0.0.1:5602"


def _info(name: str, pub: str = "", replay: str = "") -> WorkerInfo:
    return WorkerInfo(
        role="prefill", peer_id=name, pd_address="tcp://127.0.0.1:1", incarnation=1,
        transport="tcp", kv_events_address=pub, kv_replay_address=replay,
    )  # fmt: skip


def test_sources_are_the_workers_advertising_both_addresses() -> None:
    infos = [
        _info("a", PUB, REPLAY), _info("b"), _info("c", PUB), None,
        _info("d", "tcp://x:99999", REPLAY),
    ]  # fmt: skip
    assert sources_of(infos) == {"a": EventSource(PUB, REPLAY)}


def test_the_subscriber_follows_the_advertised_addresses() -> None:
    watch = KVEventWatch(secret=None)
    try:
        assert watch.update([_info("a")]) is False and watch.subscriber is None
        assert watch.update([_info("a", PUB, REPLAY)]) is True
        first = watch.subscriber
        assert first is not None and watch.update([_info("a", PUB, REPLAY)]) is False
        moved = "tcp://127.0.0.1:5603"
        assert watch.update([_info("a", moved, REPLAY)]) is True
        assert watch.subscriber is not first and watch.sources == {"a": EventSource(moved, REPLAY)}
        assert watch.update([_info("a")]) is True
        assert watch.subscriber is None and watch.snapshot() == {"sources": 0}
    finally:
        watch.close()
