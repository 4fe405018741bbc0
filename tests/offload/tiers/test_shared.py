"""SharedTier against real redis-servers: publish and dedup, two-phase visibility, per-writer
fencing, CRC and eviction races as misses, fingerprint isolation, replicas (writes, reads and
``held`` asking the next server only for what the first lacks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from offload_testlib import key, keys

from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.ids import ChunkKey, SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.tiers import PublishOutcome, ReadOutcome, SharedTier, Tier
from kvplane.offload.tiers.shared_server import fence_off_writer, writer_key
from kvplane.testing.redis_server import LocalRedisServer

FP, FP2 = bytes(range(16)), bytes(range(1, 17))
OK, CORRUPT, MISSING = ReadOutcome.OK, ReadOutcome.CORRUPT, ReadOutcome.MISSING
PUBLISHED, DEDUPED, EXPIRED = (
    PublishOutcome.PUBLISHED,
    PublishOutcome.DEDUPED,
    PublishOutcome.EXPIRED,
)
CHUNK = 4_000


def pattern(i: int) -> torch.Tensor:
    return ((torch.arange(CHUNK, dtype=torch.int64) * 7 + i) % 251).to(torch.uint8)


def slots(n: int) -> list[SlotId]:
    return [SlotId(i) for i in range(n)]


def read(tier: SharedTier, ks: list[ChunkKey]) -> tuple[list[ReadOutcome], list[torch.Tensor]]:
    outs = [torch.zeros(CHUNK, dtype=torch.uint8) for _ in ks]
    return tier.read(slots(len(ks)), ks, outs), outs


def published(m: MetricsRegistry, outcome: str) -> float:
    return m.value("offload_shared_publish", {"tier": "remote", "outcome": outcome}, "_total")


@pytest.fixture
def raw(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def test_publish_then_read_on_another_engine_and_dedup(
    redis_url: str, redis_namespace: str, raw: redis.Redis
) -> None:
    m = MetricsRegistry()
    a = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace, metrics=m)
    b = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace, metrics=m)
    try:
        assert isinstance(a, Tier)
        a.write(slots(2), keys(0, 1), [pattern(0), pattern(1)])
        got, outs = read(b, keys(0, 1))
        assert got == [OK, OK]
        assert torch.equal(outs[0], pattern(0)) and torch.equal(outs[1], pattern(1))
        before = raw.info("commandstats")["cmdstat_set"]["calls"]
        res = b.publish(keys(0, 1, 2), [pattern(0), pattern(1), pattern(2)])
        assert res.outcomes == (DEDUPED, DEDUPED, PUBLISHED) and res.failed == ()
        assert (published(m, "published"), published(m, "deduped")) == (3.0, 2.0)
        # held chunks were not sent: chunk 2's stage SET and its header's (in the script)
        assert raw.info("commandstats")["cmdstat_set"]["calls"] - before == 2
        assert list(raw.scan_iter(match=f"{redis_namespace}:stage:*")) == []
        assert b.scan() == {k: SlotId(i) for i, k in enumerate(sorted(keys(0, 1, 2)))}
        assert b.held([key(2), key(9)]) == [True, False]
    finally:
        a.close()
        b.close()


def test_the_script_dedups_a_racing_writer_without_touching_the_chunk(
    redis_url: str, redis_namespace: str, raw: redis.Redis
) -> None:
    a = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace)
    try:
        a.write(slots(1), keys(0), [pattern(0)])
        server = a.servers[0]
        header = raw.get(server.header_key(key(0)))
        assert header is not None
        # A second writer that checked before the first published: it staged and publishes.
        got = server.publish(keys(0), [b"x" * 128], [memoryview(bytes(CHUNK))])
        assert got == [DEDUPED]
        assert raw.get(server.header_key(key(0))) == header  # the first chunk stays
        assert read(a, keys(0))[0] == [OK]
        assert list(raw.scan_iter(match=f"{redis_namespace}:stage:*")) == []
    finally:
        a.close()


def test_staged_only_is_a_miss_and_expires(redis_url: str, redis_namespace: str) -> None:
    a = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace, stage_ttl_s=0.2)
    try:
        server = a.servers[0]
        stage = f"{redis_namespace}:stage:{server.writer_id}:99".encode()
        server.client.set(stage, bytes(CHUNK), px=200)  # a writer that died after staging
        assert read(a, keys(0))[0] == [MISSING]
        assert 0 < server.client.pttl(stage) <= 200
        # A stage that ran out before the script: nothing published, the write raises.
        pipe_stage = f"{redis_namespace}:stage:{server.writer_id}:"
        got = server._publish(  # the script alone, its stage keys never set
            keys=[writer_key(redis_namespace, server.writer_id), pipe_stage + "x",
                  server.payload_key(key(1)), server.header_key(key(1))],
            args=[server._writer.token, b"h"],
        )  # fmt: skip
        assert got == [3]
        assert read(a, keys(1))[0] == [MISSING]
    finally:
        a.close()


def test_a_fenced_off_writer_is_refused_and_others_go_on(
    redis_url: str, redis_namespace: str, raw: redis.Redis
) -> None:
    a = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace)
    b = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace)
    try:
        fence_off_writer(raw, redis_namespace, a.servers[0].writer_id)
        with pytest.raises(OffloadError, match="fenced off"):
            a.write(slots(1), keys(0), [pattern(0)])
        assert read(b, keys(0))[0] == [MISSING]
        assert list(raw.scan_iter(match=f"{redis_namespace}:stage:*")) == []  # stages dropped
        with pytest.raises(OffloadError, match="fenced off"):  # for good
            a.write(slots(1), keys(0), [pattern(0)])
        b.write(slots(1), keys(0), [pattern(0)])
        assert read(a, keys(0))[0] == [OK]  # a fenced writer still reads
    finally:
        a.close()
        b.close()


def test_a_lapsed_writer_is_refused_by_the_server_then_registers_afresh(
    redis_url: str, redis_namespace: str, raw: redis.Redis
) -> None:
    a = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace)
    try:
        server = a.servers[0]
        old = server.writer_id
        raw.delete(writer_key(redis_namespace, old))  # expired (or a restarted server)
        before = raw.info("commandstats")["cmdstat_evalsha"]["calls"]
        a.write(slots(1), keys(0), [pattern(0)])  # refused, re-registered, sent again
        assert raw.info("commandstats")["cmdstat_evalsha"]["calls"] - before == 2
        assert server.writer_id != old and server.rejoins == 1
        assert raw.exists(writer_key(redis_namespace, old)) == 0
        assert read(a, keys(0))[0] == [OK]
    finally:
        a.close()


def test_checksum_mismatch_is_corrupt_then_replaced(
    redis_url: str, redis_namespace: str, raw: redis.Redis
) -> None:
    m = MetricsRegistry()
    a = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace, metrics=m)
    try:
        a.write(slots(2), keys(0, 1), [pattern(0), pattern(1)])
        server = a.servers[0]
        raw.setrange(server.payload_key(key(0)), 17, b"\xff")
        raw.setrange(server.header_key(key(1)), 40, b"\xff")
        got, outs = read(a, keys(0, 1))
        assert got == [CORRUPT, CORRUPT]
        for reason in ("checksum", "header"):
            assert m.value("offload_corrupt_chunks", {"tier": "remote", "reason": reason}, "_total")
        assert raw.exists(server.header_key(key(0)), server.payload_key(key(0))) == 0  # dropped
        assert a.publish(keys(0, 1), [pattern(0), pattern(1)]).outcomes == (PUBLISHED, PUBLISHED)
        got, outs = read(a, keys(0, 1))
        assert got == [OK, OK] and torch.equal(outs[0], pattern(0))
        raw.set(server.header_key(key(1)), b"not a header")  # foreign bytes under our key
        assert read(a, keys(1))[0] == [CORRUPT]
        assert raw.exists(server.header_key(key(1)), server.payload_key(key(1))) == 0
    finally:
        a.close()


def test_eviction_of_either_half_is_a_miss_and_a_republish_heals(
    redis_url: str, redis_namespace: str, raw: redis.Redis
) -> None:
    a = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace)
    try:
        a.write(slots(2), keys(0, 1), [pattern(0), pattern(1)])
        server = a.servers[0]
        raw.delete(server.payload_key(key(0)))
        raw.delete(server.header_key(key(1)))
        assert read(a, keys(0, 1))[0] == [MISSING, MISSING]
        assert a.publish(keys(0, 1), [pattern(0), pattern(1)]).outcomes == (PUBLISHED, PUBLISHED)
        assert read(a, keys(0, 1))[0] == [OK, OK]
    finally:
        a.close()


def test_another_fingerprint_never_reads_or_dedups(redis_url: str, redis_namespace: str) -> None:
    a = SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace)
    b = SharedTier([redis_url], 4, CHUNK, FP2, namespace=redis_namespace)
    c = SharedTier([redis_url], 4, CHUNK + 1, FP, namespace=redis_namespace)
    try:
        a.write(slots(1), keys(0), [pattern(0)])
        assert read(b, keys(0))[0] == [MISSING] and b.scan() == {}
        assert b.publish(keys(0), [pattern(7)]).outcomes == (PUBLISHED,)
        got, outs = read(a, keys(0))
        assert got == [OK] and torch.equal(outs[0], pattern(0))
        out = torch.zeros(CHUNK + 1, dtype=torch.uint8)
        assert c.read(slots(1), keys(0), [out]) == [CORRUPT]  # same fingerprint, other size
    finally:
        for t in (a, b, c):
            t.close()


def test_replicas_write_to_all_and_read_from_the_first_that_has_it() -> None:
    with LocalRedisServer() as s1, LocalRedisServer() as s2:
        m = MetricsRegistry()
        a = SharedTier([s1.url, s2.url], 4, CHUNK, FP, namespace="rep", metrics=m, timeout_s=1.0)
        try:
            a.write(slots(2), keys(0, 1), [pattern(0), pattern(1)])
            r1 = redis.Redis.from_url(s1.url)
            r1.delete(a.servers[0].header_key(key(1)))
            got, outs = read(a, keys(0, 1))
            assert got == [OK, OK] and torch.equal(outs[1], pattern(1))
            r2 = redis.Redis.from_url(s2.url)
            before = r2.info("commandstats")["cmdstat_exists"]["calls"]
            assert a.held(keys(0, 1, 5)) == [True, True, False]
            # the replica is asked only about the chunks the first server lacks
            assert r2.info("commandstats")["cmdstat_exists"]["calls"] - before == 2
            r1.close()
            r2.close()
            s1.kill()
            got, outs = read(a, keys(0, 1))
            assert got == [OK, OK] and torch.equal(outs[0], pattern(0))
            res = a.publish(keys(2), [pattern(2)])
            assert res.outcomes == (PUBLISHED,) and [f.split(": ")[0] for f in res.failed] == [
                s1.url
            ]
            s2.kill()
            with pytest.raises(OffloadError, match="every server failed"):
                a.write(slots(1), keys(3), [pattern(3)])
            with pytest.raises(OffloadError, match="no server answered"):
                read(a, keys(0))
            assert m.value("offload_tier_errors", {"tier": "remote"}, "_total") == 6
        finally:
            a.close()


def test_bad_arguments_raise_before_connecting() -> None:
    for kw in ({"urls": ["http://x"]}, {"urls": []}, {"namespace": "a:b"}, {"stage_ttl_s": 0}):
        args: dict[str, object] = {"urls": ["redis://127.0.0.1:1/0"], **kw}
        with pytest.raises(InvalidArgumentError):
            SharedTier(args.pop("urls"), 4, CHUNK, FP, **args)  # type: ignore[arg-type]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.sampled_from("wdrc"), st.integers(0, 1), st.integers(0, 3)),
        min_size=1,
        max_size=25,
    )
)
def test_two_writers_never_read_wrong_bytes(
    redis_url: str, redis_namespace: str, ops: list[tuple[str, int, int]]
) -> None:
    """Writes (w), evictions of a random half (d), reads (r) and corruptions (c) by two
    engines: a read is OK exactly when a whole chunk is there, and then has the right bytes."""
    client = redis.Redis.from_url(redis_url)
    for name in client.scan_iter(match=f"{redis_namespace}:*"):
        client.delete(name)
    tiers = [SharedTier([redis_url], 4, CHUNK, FP, namespace=redis_namespace) for _ in range(2)]
    whole: set[int] = set()
    try:
        for op, who, i in ops:
            tier, server = tiers[who], tiers[who].servers[0]
            if op == "w":
                tier.write(slots(1), keys(i), [pattern(i)])
                whole.add(i)
            elif op == "d":
                client.delete((server.header_key if who else server.payload_key)(key(i)))
                whole.discard(i)
            elif op == "c" and i in whole:
                client.setrange(server.payload_key(key(i)), i, b"\x00\xff")
                whole.discard(i)
            got, outs = read(tier, [key(i)])
            assert (got[0] is OK) == (i in whole)
            if got[0] is OK:
                assert torch.equal(outs[0], pattern(i))
    finally:
        for t in tiers:
            t.close()
        client.close()


def test_eviction_by_the_servers_lru_policy_is_a_miss_never_wrong_bytes() -> None:
    """The documented set-up: ``maxmemory`` with ``allkeys-lru``. 80 chunks of 64 KiB into
    4 MiB (about 1 MiB of it the server's own): the server evicts headers and payloads one by
    one, and every read is whole or a miss."""
    with LocalRedisServer(maxmemory_mb=4) as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory-policy", "allkeys-lru")
        size = 64 << 10
        a = SharedTier([server.url], 4, size, FP, namespace="lru")
        try:
            data = [torch.full((size,), i, dtype=torch.uint8) for i in range(80)]
            for b in range(0, 80, 4):
                a.publish(keys(*range(b, b + 4)), data[b : b + 4])
            outs = [torch.zeros(size, dtype=torch.uint8) for _ in range(80)]
            got = a.read([SlotId(0)] * 80, keys(*range(80)), outs)
            assert MISSING in got and OK in got and CORRUPT not in got
            for i, outcome in enumerate(got):
                if outcome is OK:
                    assert torch.equal(outs[i], data[i])
            assert client.info("stats")["evicted_keys"] > 0
        finally:
            a.close()
            client.close()
