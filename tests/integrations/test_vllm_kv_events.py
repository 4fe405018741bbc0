"""The connector publishes its tiers' KV events: exact chunk keys per tier, seqs, replays.

The real :class:`SchedulerSide` and :class:`WorkerSide` (``vllm_testlib.MiniEngine``) with
host and disk tiers publish through kvplane's own publisher; kvplane's own subscriber, feed
and index read them over real zmq sockets with CURVE (the cluster secret).
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from vllm_testlib import FINGERPRINT, MiniEngine, disk_extra

from kvplane.apps.proxy_schemes import chunk_keys
from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.config import SECRET_ENV
from kvplane.curve_auth import secure_client
from kvplane.errors import ConfigError
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.config import EventsConfig, parse_extra_config
from kvplane.integrations.vllm.kv_events import (
    EventsSetup,
    events_setup,
    publish_book,
    scheme_note,
)
from kvplane.integrations.vllm.startup import kv_events_addresses
from kvplane.offload.book import TierBook
from kvplane.serving.kv_describe import Description, KeyScheme
from kvplane.serving.kv_events import (
    END_SEQ,
    AllCleared,
    ChunksRemoved,
    ChunksStored,
    Frame,
    Origin,
    decode_end,
    decode_frame,
    replay_request,
)
from kvplane.serving.kv_publisher import KVEventPublisher, event_keys
from kvplane.serving.router.kv_feed import EventFeed
from kvplane.serving.router.kv_subscriber import EventSource, KVEventSubscriber
from kvplane.serving.router.prefix_index import PrefixIndex
from kvplane.serving.router.route_policy import ChunkKeyScheme
from kvplane.testing.cluster import TEST_SECRET, wait_for

ENV = {SECRET_ENV: TEST_SECRET.decode()}
SCHEME = ChunkKeyScheme(BlockHasher(0, FINGERPRINT), ChunkSpec(4, 2))
"""How a router keys a prompt for the engine: hash seed, key root, vLLM block size, chunk."""


def prompt(i: int) -> list[int]:
    """21 tokens: two full chunks of 2 blocks of 4 tokens."""
    return [1000 * (i + 1) + t for t in range(21)]


def free_pair() -> int:
    """The first of two consecutive free ports on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = int(s.getsockname()[1])
        with contextlib.ExitStack() as held, contextlib.suppress(OSError):
            for port in (first, first + 1):
                held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            return first
    raise OSError("no two consecutive free ports")


def holdings(book: TierBook) -> dict[str, frozenset[ChunkKey]]:
    """Ground truth: each tier's resident chunks as its bookkeeping has them."""
    out = {m.tier: frozenset(ChunkKey(k) for k in m.policy.order()) for m in book.managers()}
    return {tier: keys for tier, keys in out.items() if keys}


@contextlib.contextmanager
def engine(
    tmp_path: Path, buffer_steps: int = 10_000, **more: object
) -> Iterator[tuple[MiniEngine, KVEventPublisher]]:
    """An engine of host and disk tiers (8 slots each) publishing with incarnation 7."""
    eng = MiniEngine({**disk_extra(tmp_path, **more), "kv_events_port": free_pair()})
    setup = events_setup(eng.config, ENV)
    assert setup is not None
    settings = dataclasses.replace(setup.settings, buffer_steps=buffer_steps)
    setup = dataclasses.replace(setup, settings=settings)
    pub = publish_book(setup, eng.sched.book, 8, incarnation=7)
    try:
        yield eng, pub
    finally:
        pub.close()
        eng.close()


def replay(pub: KVEventPublisher, start: int) -> tuple[list[Frame], int]:
    """Ask ``pub`` for a replay from ``start`` on a CURVE DEALER: its frames and next seq."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        secure_client(sock, event_keys(TEST_SECRET))
        sock.connect(pub.replay_address)
        sock.send_multipart([b"", replay_request(start)])
        frames: list[Frame] = []
        while True:
            parts = sock.recv_multipart()[1:]
            if parts[1] == END_SEQ:
                end = decode_end(parts)
                assert end is not None
                return frames, end[1]
            frame = decode_frame(parts)
            assert frame is not None
            frames.append(frame)
    finally:
        sock.close(linger=0)
        ctx.term()


def changes(frames: list[Frame]) -> list[tuple[str, str, ChunkKey, int]]:
    """Every event's chunks one by one, ``(kind, tier, key, block_size)``, in seq order (how
    the publisher's thread cut them into batches is its timing, not the test's)."""
    out = []
    for frame in frames:
        for ev in frame.batch.events:
            if isinstance(ev, ChunksStored):
                out += [("stored", ev.medium, ChunkKey(k), ev.block_size) for k in ev.block_hashes]
            elif isinstance(ev, ChunksRemoved):
                out += [("removed", ev.medium, ChunkKey(k), 0) for k in ev.block_hashes]
    return out


def test_the_extra_config_keys_and_the_ports() -> None:
    config = parse_extra_config({"kv_events_port": 5557, "kv_events_name": "e1"}, {})
    assert config.kv_events == EventsConfig(port=5557, name="e1")
    assert kv_events_addresses(config, 0) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert kv_events_addresses(config, 3) == ("tcp://127.0.0.1:5563", "tcp://127.0.0.1:5564")
    env = {"KVPLANE_KV_EVENTS_PORT": "6000", "KVPLANE_KV_EVENTS_INSECURE": "1"}
    assert parse_extra_config({}, env).kv_events == EventsConfig(port=6000, insecure=True)
    assert parse_extra_config({}, {}).kv_events.port == 0
    with pytest.raises(ConfigError, match="kv_events_port"):
        parse_extra_config({"kv_events_port": 65535}, {})
    last = parse_extra_config({"kv_events_port": 65532}, {})
    assert kv_events_addresses(last, 1) == ("tcp://127.0.0.1:65534", "tcp://127.0.0.1:65535")
    with pytest.raises(ConfigError, match="rank 1 would publish on port 65535"):
        kv_events_addresses(parse_extra_config({"kv_events_port": 65533}, {}), 1)


def test_the_setup_refuses_in_one_line_before_binding_anything() -> None:
    assert events_setup(parse_extra_config({}, {}), ENV) is None
    port = free_pair()
    plain = parse_extra_config({"kv_events_port": port}, {})
    with pytest.raises(ConfigError, match="need a secret"):
        events_setup(plain, {})
    both = parse_extra_config({"kv_events_port": port, "kv_events_insecure": True}, {})
    with pytest.raises(ConfigError, match="choose one"):
        events_setup(both, ENV)
    setup = events_setup(plain, ENV, dp_rank=0)
    assert setup is not None
    assert setup == EventsSetup(f"vllm-127.0.0.1-{port}", setup.settings, TEST_SECRET)
    assert (setup.settings.pub_bind, setup.settings.replay_bind) == kv_events_addresses(plain)
    insecure = events_setup(both, {})
    assert insecure is not None and insecure.secret is None
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        with pytest.raises(ConfigError, match=r"kv_events_port \+ 1 \(replays\).*bound"):
            events_setup(plain, ENV)


def test_a_stored_prefix_is_published_per_tier_with_the_keys_a_router_computes(
    tmp_path: Path,
) -> None:
    with engine(tmp_path) as (eng, pub):
        eng.run(prompt(0))
        eng.settle()  # the write-through to disk reported
        k0, k1 = SCHEME.keys(prompt(0))
        frames, end = replay(pub, 0)
        assert [f.seq for f in frames] == list(range(end)) and end >= 2
        assert {f.origin.worker for f in frames} == {f"vllm-127.0.0.1-{eng.config.kv_events.port}"}
        assert {f.origin.incarnation for f in frames} == {7}
        assert frames[0].batch.events == (AllCleared(),)
        assert changes(frames) == [
            ("stored", "host", k0, 8), ("stored", "host", k1, 8),
            ("stored", "disk", k0, 8), ("stored", "disk", k1, 8),
        ]  # fmt: skip
        tail, end2 = replay(pub, 1)  # a gap from seq 1: exactly the frames after it
        assert (tail, end2) == (frames[1:], end)
        port = eng.config.kv_events.port
        sub = KVEventSubscriber([EventSource(pub.address, pub.replay_address)], secret=TEST_SECRET)
        try:  # before the workers' handshake the engine knows its id, not its key root
            origin = Origin(f"vllm-127.0.0.1-{port}", 7)
            assert sub.describe(timeout_s=10.0) == Description(origin, None)
            note = scheme_note(pub, 0, FINGERPRINT, (4, 2))
            described = sub.describe(timeout_s=10.0)
        finally:
            sub.close()
        assert described == Description(origin, KeyScheme(0, FINGERPRINT, 4, 2))
        assert described.scheme is not None
        assert chunk_keys(described.scheme).keys(prompt(0)) == [k0, k1]
        assert note == (
            f"kvplane: KV events on tcp://127.0.0.1:{port} (replays on tcp://127.0.0.1:"
            f"{port + 1}), topic kv/vllm-127.0.0.1-{port}/7; chunk keys: hash seed 0, key root "
            f"{FINGERPRINT.hex()}, block size 4, 2 blocks per chunk"
        )


def test_a_disk_chunk_of_two_host_chunks_is_published_with_its_own_span(
    tmp_path: Path,
) -> None:
    with engine(tmp_path, disk_blocks_per_chunk=4) as (eng, pub):
        eng.run(prompt(0))
        eng.settle()  # the write-down the gather's report decided
        k0, k1 = SCHEME.keys(prompt(0))
        frames, _end = replay(pub, 0)
        assert changes(frames) == [
            ("stored", "host", k0, 8), ("stored", "host", k1, 8), ("stored", "disk", k1, 16),
        ]  # fmt: skip


def test_eviction_is_published_removed_and_a_subscriber_tracks_the_tiers(
    tmp_path: Path,
) -> None:
    with engine(tmp_path) as (eng, pub):
        sub = KVEventSubscriber(
            [EventSource(pub.address, pub.replay_address)], secret=TEST_SECRET, resync_s=0.1
        )
        sub.start()
        try:
            name = pub.log.topic.decode().split("/")[1]
            for i in range(5):  # 10 chunks into 8 host and 8 disk slots: LRU drops prompt 0's
                eng.run(prompt(i))
                eng.settle()
            truth = holdings(eng.sched.book)
            keys = [SCHEME.keys(prompt(i)) for i in range(5)]
            every = frozenset(k for ks in keys[1:] for k in ks)
            assert truth == {"host": every, "disk": every}
            wait_for(lambda: sub.index.holdings(name) == truth, what="the index")
            frames, _ = replay(pub, 0)
            want = []
            for i, ks in enumerate(keys):
                if i == 4:  # its store made room first: prompt 0's chunks, least recently used
                    want += [("removed", t, k, 0) for t in ("host", "disk") for k in keys[0]]
                want += [("stored", t, k, 8) for t in ("host", "disk") for k in ks]
            assert changes(frames) == want
            match = sub.longest_prefix(SCHEME.keys(prompt(4)))[name]
            assert (match.any_tier, dict(match.by_tier)) == (2, {"disk": 2, "host": 2})
        finally:
            sub.close()


def test_a_lost_batch_is_filled_by_a_replay_and_an_old_one_by_a_snapshot(
    tmp_path: Path,
) -> None:
    """A feed that missed a batch waits on the gap; the replay from it brings the index to
    the book's truth. With a buffer of 2 batches, a replay from 0 is one snapshot."""
    with engine(tmp_path) as (eng, pub):
        for i in range(5):
            eng.run(prompt(i))
            eng.settle()
            replay(pub, 0)  # the publisher publishes what waits before it answers: a batch each
        frames, end = replay(pub, 0)
        assert len(frames) == end >= 6
        feed = EventFeed(PrefixIndex())
        lost = 2
        for frame in frames[:lost] + frames[lost + 1 :]:
            feed.receive(frame)
        name = frames[0].origin.worker
        assert feed.gaps() == {name: lost}
        tail, _ = replay(pub, feed.gaps()[name])
        for frame in tail:
            feed.receive(frame)
        assert feed.gaps() == {} and feed.position(name) == (7, end)
        assert feed.index.holdings(name) == holdings(eng.sched.book)

    (tmp_path / "small").mkdir()
    with engine(tmp_path / "small", buffer_steps=2) as (eng, pub):
        for i in range(5):
            eng.run(prompt(i))
            eng.settle()
            replay(pub, 5)  # a batch each (seq 5 is not yet: an empty answer)
        frames, end = replay(pub, 0)
        (snapshot,) = frames
        assert snapshot.seq == end - 1 > 2 and snapshot.batch.resets
        feed = EventFeed(PrefixIndex())
        feed.receive(snapshot)
        assert feed.index.holdings(snapshot.origin.worker) == holdings(eng.sched.book)
        assert pub.snapshot()["snapshots_served"] == 1
