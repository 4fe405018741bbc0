"""RemoteTier against a real redis-server: round trip, damage is a MISS plus a metric,
re-index, a server that goes away mid-run, and the typed "unsupported" path."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Any

import pytest
import redis
import torch
from offload_testlib import key, keys

from kvplane.errors import (
    InvalidArgumentError,
    MalformedMessageError,
    OffloadError,
    UnsupportedError,
)
from kvplane.ids import SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.tiers import ReadOutcome, RemoteTier, Tier
from kvplane.offload.tiers import remote as remote_module
from kvplane.offload.tiers import resp as resp_module
from kvplane.offload.tiers.redis_server import LocalRedisServer

FP = bytes(range(16))
OK, CORRUPT, MISSING = ReadOutcome.OK, ReadOutcome.CORRUPT, ReadOutcome.MISSING
CHUNK = 10_000


def pattern(i: int, n: int = CHUNK) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 13 + i) % 253).to(torch.uint8)


def corrupt(m: MetricsRegistry, reason: str) -> float:
    return m.value("offload_corrupt_chunks", {"tier": "remote", "reason": reason}, "_total")


def test_round_trip_and_reindex(redis_url: str, redis_namespace: str) -> None:
    tier = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace)
    assert isinstance(tier, Tier)
    tier.write([SlotId(3), SlotId(0)], keys(0, 1), [pattern(0), pattern(1)])
    outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(3)]
    got = tier.read([SlotId(0), SlotId(3), SlotId(2)], keys(1, 0, 2), outs)
    assert got == [OK, OK, MISSING]
    assert torch.equal(outs[0], pattern(1)) and torch.equal(outs[1], pattern(0))
    assert tier.read([], [], []) == []
    tier.close()
    again = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace)  # a restart
    assert again.scan() == {key(0): 3, key(1): 0}
    again.close()
    small = RemoteTier(redis_url, 2, CHUNK, FP, namespace=redis_namespace)
    assert small.scan() == {key(1): 0}  # slot 3 is beyond a 2-slot tier
    assert small.clear() == 2 and small.scan() == {}
    small.close()


def test_a_namespace_is_held_by_one_open_tier(redis_url: str, redis_namespace: str) -> None:
    """Two tiers on one namespace would overwrite each other's slots: the second is refused,
    naming the holder, and gets it once the first closes."""
    tier = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=0.3)
    raw = redis.Redis.from_url(redis_url)
    holder = raw.get(f"{redis_namespace}:owner")
    assert holder is not None and f"pid {os.getpid()}".encode() in holder
    with pytest.raises(OffloadError, match=f"{redis_namespace}' is in use by .*pid {os.getpid()}"):
        RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=0.3)
    time.sleep(0.5)  # longer than the lease: renewed while open
    tier.write([SlotId(1)], keys(0), [pattern(0)])
    tier.close()
    assert raw.get(f"{redis_namespace}:owner") is None  # released at close
    again = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=0.3)
    assert again.scan() == {key(0): 1}
    again.close()
    raw.close()


def test_an_engine_restarted_after_a_crash_reclaims_its_namespace(
    redis_url: str, redis_namespace: str
) -> None:
    tier = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace)
    tier.write([SlotId(2)], keys(5), [pattern(5)])
    tier.close()
    raw = redis.Redis.from_url(redis_url)
    raw.set(f"{redis_namespace}:owner", "dead engine", px=400)  # died holding it, unrenewed
    start = time.monotonic()
    again = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=2.0)
    assert time.monotonic() - start < 2.0  # waited for the dead lease, not for its own
    assert again.scan() == {key(5): 2}  # and re-finds its chunks
    again.close()
    raw.close()


def test_a_lost_lease_refuses_writes(redis_url: str, redis_namespace: str) -> None:
    m = MetricsRegistry()
    tier = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=0.3, metrics=m)
    raw = redis.Redis.from_url(redis_url)
    raw.set(f"{redis_namespace}:owner", "another engine")  # taken over (e.g. after a partition)
    deadline = time.monotonic() + 5.0
    while tier._lease is not None and not tier._lease.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(OffloadError, match=r"lease .* was lost"):
        tier.write([SlotId(0)], keys(0), [pattern(0)])
    tier.close()
    assert raw.get(f"{redis_namespace}:owner") == b"another engine"  # not ours to delete
    raw.close()


def test_foreign_keys_under_the_prefix_are_skipped_by_the_reindex(
    redis_url: str, redis_namespace: str
) -> None:
    """A key matching ``ns:slot:*:h`` whose slot is not ASCII digits (bytes that do not
    decode, a digit ``int`` refuses) is not ours: skipped, not a startup error."""
    tier = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace)
    try:
        tier.write([SlotId(1)], keys(0), [pattern(0)])
        raw = redis.Redis.from_url(redis_url)
        for slot in (b"\xff", "\u00b2".encode(), b"1x", b""):
            raw.set(redis_namespace.encode() + b":slot:" + slot + b":h", b"junk")
        assert tier.scan() == {key(0): 1}
        raw.close()
    finally:
        tier.clear()
        tier.close()


def test_damage_is_a_miss_and_a_metric(redis_url: str, redis_namespace: str) -> None:
    m = MetricsRegistry()
    tier = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, metrics=m)
    tier.write([SlotId(0), SlotId(1), SlotId(2)], keys(0, 1, 2), [pattern(i) for i in range(3)])
    raw = redis.Redis.from_url(redis_url)
    payload = bytearray(raw.get(f"{redis_namespace}:slot:0"))
    payload[77] ^= 0x04
    raw.set(f"{redis_namespace}:slot:0", bytes(payload))  # bit flip
    raw.set(f"{redis_namespace}:slot:1", b"short")  # wrong length
    header = bytearray(raw.get(f"{redis_namespace}:slot:2:h"))
    header[20] ^= 0x01
    raw.set(f"{redis_namespace}:slot:2:h", bytes(header))  # damaged header
    outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(3)]
    assert tier.read([SlotId(0), SlotId(1), SlotId(2)], keys(0, 1, 2), outs) == [CORRUPT] * 3
    assert (corrupt(m, "checksum"), corrupt(m, "length"), corrupt(m, "header")) == (1, 1, 1)
    tier.write([SlotId(3)], keys(3), [pattern(3)])
    assert tier.read([SlotId(3)], keys(4), [outs[0]]) == [CORRUPT]  # another chunk's slot
    assert corrupt(m, "key") == 1
    # a header value of the wrong size, even one starting with a valid header, is skipped
    # unread (never allocated whole) and the next chunk of the reply stream still reads
    good = raw.get(f"{redis_namespace}:slot:3:h")
    raw.set(f"{redis_namespace}:slot:3:h", good + bytes(1 << 20))
    tier.write([SlotId(0)], keys(0), [pattern(0)])
    assert tier.read([SlotId(3), SlotId(0)], keys(3, 0), outs[:2]) == [CORRUPT, OK]
    assert corrupt(m, "header") == 2 and torch.equal(outs[1], pattern(0))
    assert key(3) not in tier.scan()  # nor is it adopted by a re-index
    tier.close()
    other = RemoteTier(redis_url, 4, CHUNK, bytes(16), namespace=redis_namespace, metrics=m)
    assert other.scan() == {}  # another layout: nothing is adopted
    raw.close()
    other.close()


def test_batches_span_pipeline_groups_and_a_lost_payload_is_corrupt(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote_module, "PIPELINE_BYTES", 2 * CHUNK + 1)  # groups of two chunks
    m = MetricsRegistry()
    tier = RemoteTier(redis_url, 5, CHUNK, FP, namespace=redis_namespace, metrics=m)
    order = [SlotId(s) for s in (4, 0, 2, 1, 3)]
    tier.write(order, keys(0, 1, 2, 3, 4), [pattern(i) for i in range(5)])
    outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(5)]
    assert tier.read(order[::-1], keys(4, 3, 2, 1, 0), outs) == [OK] * 5
    assert all(torch.equal(outs[i], pattern(4 - i)) for i in range(5))
    raw = redis.Redis.from_url(redis_url)
    raw.delete(f"{redis_namespace}:slot:0")  # the header stays, the payload is gone
    assert tier.read([SlotId(0), SlotId(4)], keys(1, 0), outs[:2]) == [CORRUPT, OK]
    assert corrupt(m, "missing") == 1 and torch.equal(outs[1], pattern(0))
    # a writer that died after dropping the old header and setting the new payload
    raw.delete(f"{redis_namespace}:slot:2:h")
    raw.set(f"{redis_namespace}:slot:2", bytes(pattern(9)))
    assert tier.read([SlotId(2)], keys(2), outs[:1]) == [MISSING]
    assert SlotId(2) not in tier.scan().values()
    # a payload of the wrong length is skipped in the reply stream: the next chunks still read
    raw.set(f"{redis_namespace}:slot:1", bytes(CHUNK // 2 + 3))
    assert tier.read([SlotId(1), SlotId(3), SlotId(4)], keys(3, 4, 0), outs[:3]) == [
        CORRUPT, OK, OK,
    ]  # fmt: skip
    assert corrupt(m, "length") == 1
    assert torch.equal(outs[1], pattern(4)) and torch.equal(outs[2], pattern(0))
    raw.close()
    tier.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("kvplane-remote-")]


def test_a_reply_stream_broken_part_way_drops_its_connection(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails between replies leaves unread replies on its connection: the
    connection is dropped, so the next read (on a fresh one) gets exactly its own replies."""
    monkeypatch.setattr(remote_module, "PIPELINE_BYTES", CHUNK)  # a group per chunk
    tier = RemoteTier(redis_url, 3, CHUNK, FP, namespace=redis_namespace)
    slots = [SlotId(i) for i in range(3)]
    tier.write(slots, keys(0, 1, 2), [pattern(i) for i in range(3)])
    outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(3)]

    class Breaks(remote_module.ReplyReader):
        def bulk_into(self, out: memoryview) -> None:
            raise MalformedMessageError("injected")

    pool = tier._client.connection_pool
    released: list[bool] = []  # per release: was the connection's socket still open?
    release = pool.release

    def recording(conn: Any) -> None:
        released.append(conn._sock is not None)
        release(conn)

    monkeypatch.setattr(pool, "release", recording)
    with monkeypatch.context() as mp:
        mp.setattr(remote_module, "ReplyReader", Breaks)
        with pytest.raises(OffloadError, match="read failed: injected"):
            tier.read(slots, keys(0, 1, 2), outs)
    assert released == [False]  # dropped before it went back to the pool
    assert tier.read(slots[::-1], keys(2, 1, 0), outs) == [OK] * 3
    assert released == [False, True]  # a clean read keeps its connection
    assert all(torch.equal(outs[i], pattern(2 - i)) for i in range(3))
    tier.close()


def test_a_health_check_due_mid_read_does_not_take_a_reply(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``health_check_interval`` in the URL, redis-py PINGs before a send once the
    interval has passed since it last read a reply itself -- which during a read it never
    does. Sending the next group after the interval must not PING (its answer would be an
    MGET reply), so a slow read still gets exactly its own replies."""
    monkeypatch.setattr(remote_module, "PIPELINE_BYTES", CHUNK)  # a group per chunk
    # A small line buffer: the next group's reply is still on the socket when it is due.
    monkeypatch.setattr(resp_module, "BUFFER_BYTES", 256)
    sep = "&" if "?" in redis_url else "?"
    tier = RemoteTier(f"{redis_url}{sep}health_check_interval=1", 3, CHUNK, FP,
                      namespace=redis_namespace)  # fmt: skip
    slots = [SlotId(i) for i in range(3)]
    tier.write(slots, keys(0, 1, 2), [pattern(i) for i in range(3)])
    outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(3)]
    slow: list[int] = []

    class Slow(remote_module.ReplyReader):
        def array(self) -> int:
            if not slow:  # the first reply is read 1.2 s after the first send
                slow.append(1)
                time.sleep(1.2)
            return super().array()

    monkeypatch.setattr(remote_module, "ReplyReader", Slow)
    assert tier.read(slots, keys(0, 1, 2), outs) == [OK] * 3
    assert all(torch.equal(outs[i], pattern(i)) for i in range(3))
    tier.close()


def test_server_going_away_mid_run_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    m = MetricsRegistry()
    with LocalRedisServer() as server:  # stopped even if an assertion fails
        tier = RemoteTier(server.url, 2, CHUNK, FP, timeout_s=2.0, metrics=m)
        tier.write([SlotId(0)], keys(0), [pattern(0)])
        server.kill()
        with pytest.raises(OffloadError, match="write failed"):
            tier.write([SlotId(1)], keys(1), [pattern(1)])
        many = [SlotId(i) for i in range(2)]
        with monkeypatch.context() as mp:  # several groups: the helper's failure surfaces too
            mp.setattr(remote_module, "PIPELINE_BYTES", CHUNK)
            with pytest.raises(OffloadError, match="write failed"):
                tier.write(many, keys(0, 1), [pattern(0), pattern(1)])
            with pytest.raises(OffloadError, match="read failed"):
                tier.read(many, keys(0, 1), [torch.zeros(CHUNK, dtype=torch.uint8)] * 2)
        with pytest.raises(OffloadError, match="read failed"):
            tier.read([SlotId(0)], keys(0), [torch.zeros(CHUNK, dtype=torch.uint8)])
        with pytest.raises(OffloadError, match="re-index failed"):
            tier.scan()
        assert m.value("offload_tier_errors", {"tier": "remote"}, "_total") == 5
        tier.close()
        with pytest.raises(OffloadError, match="unreachable"):
            RemoteTier(server.url, 2, CHUNK, FP, timeout_s=1.0)


def test_bad_arguments_and_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = [{"namespace": ns} for ns in ("a:b", "", "kv*", "k?", "[k]", "k\\")]
    for kw in ({"url": "http://x"}, {"timeout_s": 0}, *bad):
        args = {"url": "redis://127.0.0.1:1/0", "namespace": "ns", "timeout_s": 1.0} | kw
        with pytest.raises(InvalidArgumentError):
            RemoteTier(
                args["url"], 2, CHUNK, FP, namespace=args["namespace"], timeout_s=args["timeout_s"]
            )  # type: ignore[arg-type]
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "redis" else real(name, *a)
    )
    with pytest.raises(UnsupportedError, match="pip install"):
        RemoteTier("redis://127.0.0.1:1/0", 2, CHUNK, FP)
