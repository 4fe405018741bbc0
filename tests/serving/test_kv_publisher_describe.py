"""A publisher's describe answer: its topic and key scheme, over real zmq with CURVE.

A kvplane worker's :class:`KVEventPublisher` (constructed as a worker does, with its scheme)
answers kvplane's own subscriber; a client with another secret gets nothing; a publisher that
does not know its scheme yet says so and tells it once told.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvplane.blocks.hashing import BlockHasher
from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError, MalformedMessageError, TransferTimeoutError
from kvplane.serving.kv_describe import DESCRIBE, Description, KeyScheme, decode_answer
from kvplane.serving.kv_events import Origin
from kvplane.serving.kv_publisher import KVEventPublisher, KVEventSettings
from kvplane.serving.router.kv_subscriber import EventSource, KVEventSubscriber
from kvplane.testing.cluster import TEST_SECRET

SCHEME = KeyScheme(7, b"\x01\x02\x03", 16, 4)
ROOT = b"model:" + b"org/some-model" * 10 + b"\0layout:" + bytes(range(16))
WORKER = KeyScheme.of(BlockHasher(7, ROOT), ChunkSpec(16, 4))
"""A worker's scheme: its hasher (a key root of 170 bytes) and offload chunk spec."""
ANY = KVEventSettings("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")


@pytest.fixture
def pub() -> Iterator[KVEventPublisher]:
    p = KVEventPublisher("prefill-0", 3, ANY, secret=TEST_SECRET, block_size=64, scheme=WORKER)
    p.start()
    yield p
    p.close()


def ask(pub: KVEventPublisher, secret: bytes | None, timeout_s: float = 5.0) -> Description:
    sub = KVEventSubscriber([EventSource(pub.address, pub.replay_address)], secret=secret)
    try:
        return sub.describe(timeout_s=timeout_s)
    finally:
        sub.close()


def test_a_worker_publisher_describes_its_topic_and_scheme(pub: KVEventPublisher) -> None:
    assert ask(pub, TEST_SECRET) == Description(Origin("prefill-0", 3), WORKER)
    assert (WORKER.hash_seed, WORKER.key_root, WORKER.block_size) == (7, ROOT, 16)
    assert SCHEME.fields() == {
        "key_root": "010203",
        "hash_seed": 7,
        "block_size": 16,
        "blocks_per_chunk": 4,
    }
    assert pub.snapshot()["describes_served"] == 1


def test_a_client_with_another_secret_gets_nothing(pub: KVEventPublisher) -> None:
    with pytest.raises(TransferTimeoutError) as err:
        ask(pub, b"another-secret-0123456789abcdef!", timeout_s=0.5)
    assert str(err.value) == (
        f"KV event source {pub.replay_address} did not describe itself within 0.5 s "
        "(down, another secret, or a publisher without describe)"
    )
    assert pub.snapshot().get("describes_served", 0) == 0


def test_an_unknown_scheme_is_said_until_told_and_then_fixed() -> None:
    pub = KVEventPublisher("vllm-x", 9, ANY, secret=None)
    pub.start()
    try:
        assert ask(pub, None) == Description(Origin("vllm-x", 9), None)
        pub.describe_as(SCHEME)
        pub.describe_as(SCHEME)  # the same again: nothing changes
        assert ask(pub, None).scheme == SCHEME
        with pytest.raises(InvalidArgumentError, match=r"^this publisher already describes"):
            pub.describe_as(KeyScheme(8, b"\x01\x02\x03", 16, 4))
    finally:
        pub.close()


def test_a_bad_answer_is_one_malformed_line() -> None:
    with pytest.raises(MalformedMessageError, match=r"^a bad KV event describe answer: "):
        decode_answer([b"kv/w/1", DESCRIBE, b"\x93\x01\x02\x03"])
    with pytest.raises(MalformedMessageError) as err:
        decode_answer([b"kv/w/1", b"\x00" * 8, b""])
    assert str(err.value) == "not a KV event describe answer: 3 frame(s)"
