"""A publisher in its own process and the router's subscriber over real zmq sockets with CURVE.

The publisher (the worker's :class:`KVEventPublisher`, driven over stdin) publishes before the
subscriber exists, then live; the subscriber rebuilds by replay (a snapshot: its buffer is
small), follows the live stream, rebuilds again after its own restart, and one holding another
secret learns nothing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from kvplane.ids import ChunkKey
from kvplane.serving.router.kv_subscriber import EventSource, KVEventSubscriber
from kvplane.serving.router.prefix_index import PrefixMatch

SECRET = b"kv-events-secret"
PUBLISHER = """
import sys
from kvplane.ids import ChunkKey
from kvplane.offload.events import TierChange
from kvplane.serving.kv_publisher import KVEventPublisher, KVEventSettings
pub = KVEventPublisher("w1", 7, KVEventSettings(buffer_steps=2), secret=sys.argv[1].encode(),
                       block_size=32)
pub.start()
print(pub.address, pub.replay_address, flush=True)
for line in sys.stdin:
    what, tier, lo, hi = line.split()
    for i in range(int(lo), int(hi)):
        pub.record(TierChange(tier, ChunkKey(i.to_bytes(4, "big")), what == "store"))
    print("ok", flush=True)
pub.close()
"""


def _key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(4, "big"))


def _keys(lo: int, hi: int) -> frozenset[ChunkKey]:
    return frozenset(_key(i) for i in range(lo, hi))


def _wait(cond: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture
def publisher() -> Iterator[tuple[subprocess.Popen[str], EventSource]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, SECRET.decode()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    address, replay = proc.stdout.readline().split()
    try:
        yield proc, EventSource(address, replay)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)


def _send(proc: subprocess.Popen[str], *lines: str) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    for line in lines:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ok"
        time.sleep(0.03)  # separate batches, so the 2-batch buffer overflows


def test_index_follows_a_curve_publisher_and_rebuilds(
    publisher: tuple[subprocess.Popen[str], EventSource],
) -> None:
    proc, source = publisher
    _send(proc, "store host 0 100", "remove host 0 20", "store disk 50 80")
    want = {"host": _keys(20, 100), "disk": _keys(50, 80)}
    sub = KVEventSubscriber([source], secret=SECRET, resync_s=0.2)
    stranger = KVEventSubscriber([source], secret=b"another-secret", resync_s=0.2)
    sub.start()
    stranger.start()
    try:
        assert _wait(lambda: sub.index.holdings("w1") == want), sub.snapshot()
        assert sub.snapshot()["feed_applied"] >= 1
        _send(proc, "store remote 0 5", "remove disk 50 60")
        want = {"host": _keys(20, 100), "disk": _keys(60, 80), "remote": _keys(0, 5)}
        assert _wait(lambda: sub.index.holdings("w1") == want), sub.snapshot()
        assert sub.longest_prefix([_key(i) for i in range(10)]) == {
            "w1": PrefixMatch("w1", 5, {"remote": 5})
        }
        assert stranger.index.holdings("w1") == {} and stranger.feed.workers() == []
    finally:
        sub.close()
        stranger.close()
    again = KVEventSubscriber([source], secret=SECRET, resync_s=0.2)  # the router restarted
    again.start()
    try:
        assert _wait(lambda: again.index.holdings("w1") == want), again.snapshot()
        _send(proc, "store host 0 3")
        want["host"] = _keys(0, 3) | _keys(20, 100)
        assert _wait(lambda: again.index.holdings("w1") == want), again.snapshot()
    finally:
        again.close()
