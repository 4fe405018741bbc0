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
from kvplane.offload.tiers import mget as mget_module
from kvplane.offload.tiers import remote as remote_module
from kvplane.offload.tiers import resp as resp_module
from kvplane.testing.redis_server import LocalRedisServer, free_port

FP = bytes(range(16))
OK, CORRUPT, MISSING = ReadOutcome.OK, ReadOutcome.CORRUPT, ReadOutcome.MISSING
CHUNK = 10_000


def pattern(i: int, n: int = CHUNK) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 13 + i) % 253).to(torch.uint8)


def corrupt(m: MetricsRegistry, reason: str) -> float:
    return m.value("offload_corrupt_chunks", {"tier": "remote", "reason": reason}, "_total")


def test_a_write_is_refused_once_less_than_one_timeout_of_the_lease_is_left(
    redis_url: str, redis_namespace: str
) -> None:
    """A write let through now runs on the server up to ``timeout_s`` later: with the key still
    ours but less than one timeout of its lease left, a write must be refused (it could land
    after the key expired and another engine claimed the namespace)."""
    tier = RemoteTier(
        redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=1.6, timeout_s=0.8
    )
    raw = redis.Redis.from_url(redis_url)
    try:
        tier.write([SlotId(0)], keys(0), [pattern(0)])
        assert tier._lease is not None
        tier._lease._stop.set()  # renewals stall from here on (like a hung server)
        tier._lease._thread.join()
        owner = f"{redis_namespace}:owner"
        while raw.pttl(owner) > 600:  # 0.6 s of the server's lease left: less than a timeout
            time.sleep(0.01)
        assert raw.get(owner) == tier._lease.token.encode()  # still ours on the server
        with pytest.raises(OffloadError, match=r"lease .* was lost"):
            tier.write([SlotId(1)], keys(1), [pattern(1)])
        assert raw.get(f"{redis_namespace}:slot:1") is None  # nothing went out
    finally:
        tier.close()
        raw.close()


class LostAfterFirstCommit:
    """Wraps a tier's lease: ``lost`` once chunk 0's header (its commit record) is written."""

    def __init__(self, real: Any, raw: Any, header: str) -> None:
        self.real, self.raw, self.header = real, raw, header

    @property
    def lost(self) -> bool:
        return bool(self.raw.exists(self.header))

    def release(self) -> None:
        self.real.release()

    def __getattr__(self, name: str) -> Any:  # key, token, mark_lost
        return getattr(self.real, name)


def test_a_lease_lost_part_way_stops_the_write_before_its_next_round_trip(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is asked before every round trip, not once per batch: a batch of several
    groups whose lease is lost after the first sends nothing more (earlier chunks stay whole)."""
    monkeypatch.setattr(remote_module, "PIPELINE_BYTES", CHUNK)  # one chunk per group
    m = MetricsRegistry()
    tier = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, metrics=m)
    raw = redis.Redis.from_url(redis_url)
    real = tier._lease
    tier._lease = LostAfterFirstCommit(real, raw, f"{redis_namespace}:slot:0:h")  # type: ignore[assignment]
    try:
        with pytest.raises(OffloadError, match=r"lease .* was lost"):
            tier.write([SlotId(0), SlotId(1)], keys(0, 1), [pattern(0), pattern(1)])
        assert raw.get(f"{redis_namespace}:slot:1") is None  # the second group never went out
        assert m.value("offload_tier_errors", {"tier": "remote"}, "_total") == 1
        outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(2)]
        assert tier.read([SlotId(0), SlotId(1)], keys(0, 1), outs) == [OK, MISSING]
    finally:
        tier.close()
        raw.close()


def test_a_lease_shorter_than_two_timeouts_is_refused_before_connecting() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens: connecting would fail
    with pytest.raises(InvalidArgumentError) as info:
        RemoteTier(url, 2, CHUNK, FP, lease_s=1.0, timeout_s=0.6)
    assert type(info.value) is InvalidArgumentError
    assert str(info.value) == (
        "RemoteTier.lease_s must be >= 2 * RemoteTier.timeout_s (a renewal may take "
        "RemoteTier.timeout_s and a write RemoteTier.timeout_s more before the lease runs out), "
        "got RemoteTier.lease_s=1.0 and RemoteTier.timeout_s=0.6"
    )


def test_the_default_lease_is_at_least_two_timeouts(redis_url: str, redis_namespace: str) -> None:
    tier = RemoteTier(redis_url, 2, CHUNK, FP, namespace=redis_namespace)
    assert tier._lease is not None and tier._lease.lease_ms == 10_000  # DEFAULT_LEASE_S
    tier.close()
    slow = RemoteTier(redis_url, 2, CHUNK, FP, namespace=redis_namespace, timeout_s=30.0)
    assert slow._lease is not None and slow._lease.lease_ms == 60_000  # 2 * timeout_s
    slow.close()


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
    tier = RemoteTier(
        redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=1.0, timeout_s=0.25
    )
    raw = redis.Redis.from_url(redis_url)
    holder = raw.get(f"{redis_namespace}:owner")
    assert holder is not None and f"pid {os.getpid()}".encode() in holder
    with pytest.raises(OffloadError, match=f"{redis_namespace}' is in use by .*pid {os.getpid()}"):
        RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=1.0, timeout_s=0.25)
    time.sleep(1.3)  # longer than the lease: renewed while open
    tier.write([SlotId(1)], keys(0), [pattern(0)])
    tier.close()
    assert raw.get(f"{redis_namespace}:owner") is None  # released at close
    again = RemoteTier(
        redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=1.0, timeout_s=0.25
    )
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
    again = RemoteTier(
        redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=2.0, timeout_s=1.0
    )
    assert time.monotonic() - start < 2.0  # waited for the dead lease, not for its own
    assert again.scan() == {key(5): 2}  # and re-finds its chunks
    again.close()
    raw.close()


def test_a_lost_lease_refuses_writes(redis_url: str, redis_namespace: str) -> None:
    m = MetricsRegistry()
    tier = RemoteTier(
        redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=0.3, timeout_s=0.1, metrics=m
    )
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
        mp.setattr(mget_module, "ReplyReader", Breaks)
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


def test_a_late_write_after_another_engine_claimed_is_refused_by_the_server(
    redis_url: str, redis_namespace: str
) -> None:
    """A's write passed its client-side lease check, then its lease ran out and B claimed the
    namespace and wrote slot 1 before A's commands reached the server (a slow link): the
    server must refuse A's write and leave B's slot whole."""
    a = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=0.4, timeout_s=0.2)
    raw = redis.Redis.from_url(redis_url)
    b: RemoteTier | None = None
    try:
        assert a._lease is not None
        a._lease._stop.set()  # A's renewals stop (its link is down)
        a._lease._thread.join()
        real_check = a._check_lease
        holder: list[RemoteTier] = []

        def late_check() -> None:  # A passes its check, then B takes over before A's send
            real_check()
            if not holder:
                raw.delete(f"{redis_namespace}:owner")  # A's lease ran out
                holder.append(
                    RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace, lease_s=10.0)
                )
                holder[0].write([SlotId(1)], keys(9), [pattern(9)])

        a._check_lease = late_check  # type: ignore[method-assign]
        with pytest.raises(OffloadError, match=r"lease .* was lost"):
            a.write([SlotId(1), SlotId(2)], keys(1, 2), [pattern(1), pattern(2)])
        b = holder[0]
        outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(2)]
        assert b.read([SlotId(1), SlotId(2)], [keys(9)[0], keys(2)[0]], outs) == [OK, MISSING]
        assert torch.equal(outs[0], pattern(9))
        assert not list(raw.scan_iter(match=f"{redis_namespace}:stage:*"))  # A's staging gone
        assert a._client.connection_pool.make_connection().retry.get_retries() == 0
    finally:
        a.close()
        if b is not None:
            b.close()
        raw.close()


def test_a_server_that_lost_its_scripts_still_stores_whole_chunks(
    redis_url: str, redis_namespace: str
) -> None:
    """``SCRIPT FLUSH`` (or a restart) between writes: the fenced delete and store answer
    NOSCRIPT and are loaded again; the chunks are stored whole, the old ones replaced, and no
    stage key is left behind."""
    raw = redis.Redis.from_url(redis_url)
    tier = RemoteTier(redis_url, 4, CHUNK, FP, namespace=redis_namespace)
    try:
        tier.write([SlotId(0), SlotId(1)], keys(1, 2), [pattern(1), pattern(2)])
        raw.script_flush()
        tier.write([SlotId(1), SlotId(3)], keys(5, 6), [pattern(5), pattern(6)])
        outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in range(3)]
        got = tier.read([SlotId(0), SlotId(1), SlotId(3)], keys(1, 5, 6), outs)
        assert got == [OK, OK, OK]
        for out, i in zip(outs, (1, 5, 6), strict=True):
            assert torch.equal(out, pattern(i))
        raw.script_flush()
        assert tier.clear() == 3
        assert tier.scan() == {}
        assert not list(raw.scan_iter(match=f"{redis_namespace}:stage:*"))
        assert raw.exists(f"{redis_namespace}:owner") == 1  # the lease is untouched
    finally:
        tier.close()
        raw.close()
