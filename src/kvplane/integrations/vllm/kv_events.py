"""The connector's KV events: its tiers' ``stored`` / ``removed`` chunks for a cache-aware router.

Owns :func:`events_setup` (the ``kv_events_*`` keys checked: secret or ``insecure``, the ports
free) and :func:`publish_book`, which starts kvplane's own
:class:`~kvplane.serving.kv_publisher.KVEventPublisher` over the scheduler side's
:class:`~kvplane.offload.book.TierBook`: the tier bookkeeping lives there (the worker side
moves bytes and never learns of an eviction), one book per engine whatever its TP size, and
:func:`scheme_note`, which tells the publisher its chunk key scheme once the workers' handshake
gives the key root (its describe answer). Same wire, topics, replay and describe as a kvplane
worker's; no vLLM import. See ``docs/vllm.md`` ("KV events").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvplane.config import secret_or_insecure
from kvplane.errors import ConfigError
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.integrations.vllm.startup import kv_events_addresses
from kvplane.offload.book import TierBook
from kvplane.serving.kv_describe import KeyScheme
from kvplane.serving.kv_publisher import KVEventPublisher, KVEventSettings
from kvplane.serving.ports import probe_bind
from kvplane.validators import require_id


@dataclass(frozen=True, slots=True)
class EventsSetup:
    """What an engine's publisher runs with: its id in the topic, its sockets, its secret."""

    name: str
    settings: KVEventSettings
    secret: bytes | None


def events_setup(
    config: ConnectorConfig, env: Mapping[str, str], dp_rank: int = 0
) -> EventsSetup | None:
    """The checked KV event setup of data-parallel engine ``dp_rank``, or None when
    ``kv_events_port`` is 0. ``ConfigError`` (one line, nothing bound) for no secret without
    ``kv_events_insecure``, both, a bad name, or a port past 65535 or busy on this host."""
    ev = config.kv_events
    if not ev.port:
        return None
    secret = secret_or_insecure(
        ev.secret_file, env, prefix="kv_events", insecure=ev.insecure, needs="KV events need",
        so_that="only the cluster reads them", otherwise="to publish plainly",
    )  # fmt: skip
    pub, replay = kv_events_addresses(config, dp_rank)
    probe_bind("kv_events_port", pub)
    probe_bind("kv_events_port + 1 (replays)", replay)
    name = ev.name or f"vllm-{ev.host}-{ev.port + 2 * dp_rank}"
    require_id("kv_events_name", name, error=ConfigError)
    return EventsSetup(name, KVEventSettings(pub_bind=pub, replay_bind=replay), secret)


def publish_book(
    setup: EventsSetup, book: TierBook, tokens_per_chunk: int, incarnation: int = 0
) -> KVEventPublisher:
    """A started publisher of every tier of ``book`` (host, then the lower tiers), each tier's
    stored events saying its own tokens per chunk (``tokens_per_chunk`` times its span of host
    chunks), as a kvplane worker watches its cascade's tiers; the chunks ``book`` holds now are
    reported stored first. ``incarnation`` 0: now in microseconds (a restarted engine's is
    larger). Call on the thread that owns ``book``; close the publisher at shutdown."""
    publisher = KVEventPublisher(
        setup.name,
        incarnation or time.time_ns() // 1000,
        setup.settings,
        secret=setup.secret,
        block_size=tokens_per_chunk,
    )
    try:
        publisher.watch_tiers(book.managers(), tokens_per_chunk, book.spans)
        publisher.start()
    except BaseException:
        publisher.close()
        raise
    return publisher


def scheme_note(publisher: KVEventPublisher, seed: int, root: bytes, spec: tuple[int, int]) -> str:
    """Tell ``publisher`` how the engine's chunk keys are made (hash seed, key root, vLLM
    block size, blocks per chunk: what a router needs to key a prompt alike), so it answers
    describe requests with them, and return one log line saying so and where it publishes.
    Call once the key root is known (the workers' handshake); ``InvalidArgumentError`` for a
    scheme other than one told before."""
    block_size, blocks_per_chunk = spec
    publisher.describe_as(KeyScheme(seed, root, block_size, blocks_per_chunk))
    return (
        f"kvplane: KV events on {publisher.address} (replays on {publisher.replay_address}), "
        f"topic {publisher.log.topic.decode()}; chunk keys: hash seed {seed}, key root "
        f"{root.hex()}, block size {block_size}, {blocks_per_chunk} blocks per chunk"
    )
