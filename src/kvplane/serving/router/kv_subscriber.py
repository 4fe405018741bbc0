"""The router's KV event subscriber: zmq sockets to every publisher, feeding the prefix index.

:class:`KVEventSubscriber` holds, per publisher (:class:`EventSource`), a SUB socket on its
events and a DEALER on its replay socket (vLLM's REQ framing: ``[b"", start]``), both CURVE
clients with the KV event keys of the cluster secret (None: plain). One thread reads them into
an :class:`~kvplane.serving.router.kv_feed.EventFeed` and asks each publisher for a replay,
one at a time (resent after ``replay_timeout_s``): from seq 0 while never heard from (a router
that starts or restarts rebuilds so: the publisher answers with its buffer or a snapshot), from
the feed's gap when one waits, and from its next seq after ``resync_s`` without a frame (a
lost tail, a publisher restarted). :meth:`KVEventSubscriber.describe` asks a publisher who it is
and how it keys chunks. See docs/serving.md ("KV events").
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from kvplane.curve_auth import secure_client
from kvplane.ids import ChunkKey
from kvplane.serving.kv_describe import Description, ask_describe
from kvplane.serving.kv_events import (
    END_SEQ,
    TOPIC_PREFIX,
    decode_end,
    decode_frame,
    replay_request,
)
from kvplane.serving.kv_publisher import event_keys, keep_running
from kvplane.serving.router.kv_feed import EventFeed
from kvplane.serving.router.prefix_index import PrefixIndex, PrefixMatch
from kvplane.serving.worker_config import split_address
from kvplane.validators import require_finite_positive

log = logging.getLogger(__name__)
MAX_FRAME = 64 << 20
"""Largest event message taken (a snapshot of a big host tier is one)."""


@dataclass(frozen=True, slots=True)
class EventSource:
    """A publisher's two addresses: its events (``address``) and its replays."""

    address: str
    replay_address: str

    def __post_init__(self) -> None:
        split_address("EventSource.address", self.address)
        split_address("EventSource.replay_address", self.replay_address)


@dataclass(slots=True)
class _Link:
    sub: zmq.Socket[bytes]
    dealer: zmq.Socket[bytes]
    worker: str | None = None
    asked_at: float | None = None
    """When the replay request now outstanding was sent (None: none is)."""
    last_ask: float = float("-inf")
    heard_at: float = float("-inf")


class KVEventSubscriber:
    """Subscribes to ``sources`` and keeps :attr:`index` (see the module docstring)."""

    def __init__(
        self,
        sources: Sequence[EventSource],
        *,
        secret: bytes | None,
        index: PrefixIndex | None = None,
        resync_s: float = 1.0,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.index = index if index is not None else PrefixIndex()
        self.feed = EventFeed(self.index)
        self.resync_s = require_finite_positive("resync_s", resync_s)
        self.replay_timeout_s = require_finite_positive("replay_timeout_s", replay_timeout_s)
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._keys = keys = None if secret is None else event_keys(secret)
        self.sources = tuple(sources)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._links: list[_Link] = []
        for src in sources:
            socks = []
            for kind, address in ((zmq.SUB, src.address), (zmq.DEALER, src.replay_address)):
                sock = self._ctx.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
                sock.setsockopt(zmq.RCVHWM, 0)  # the publisher's HWM bounds what waits
                if keys is not None:
                    secure_client(sock, keys)
                if kind == zmq.SUB:
                    sock.setsockopt(zmq.SUBSCRIBE, TOPIC_PREFIX)
                sock.connect(address)
                socks.append(sock)
            self._links.append(_Link(socks[0], socks[1]))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-subscriber", daemon=True)

    # -- questions (any thread) ------------------------------------------------------------
    def longest_prefix(self, keys: Sequence[ChunkKey]) -> dict[str, PrefixMatch]:
        """:meth:`PrefixIndex.longest_prefix` of the index as the feed has it now."""
        return self.index.longest_prefix(keys)

    def describe(self, source: int = 0, timeout_s: float = 2.0) -> Description:
        """Ask publisher ``sources[source]`` who it is and how it keys chunks (any thread; a
        socket of its own, with this subscriber's secret): see
        :func:`~kvplane.serving.kv_describe.ask_describe` for the errors
        (``TransferTimeoutError`` after ``timeout_s`` without an answer)."""
        return ask_describe(self._ctx, self.sources[source].replay_address, self._keys, timeout_s)

    def position(self, worker: str) -> tuple[int, int] | None:
        """:meth:`EventFeed.position` of ``worker`` as the feed has it now (any thread)."""
        with self._lock:
            return self.feed.position(worker)

    def snapshot(self) -> dict[str, int]:
        """The subscriber's and the feed's counters."""
        with self._lock:
            return {**self.counters, **{f"feed_{k}": v for k, v in self.feed.counters.items()}}

    # -- the thread ------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for link in self._links:
            poller.register(link.sub, zmq.POLLIN)
            poller.register(link.dealer, zmq.POLLIN)

        def step() -> None:
            ready = dict(poller.poll(50))
            now = time.monotonic()
            for link in self._links:
                if link.sub in ready:
                    self._read(link, link.sub, now)
                if link.dealer in ready:
                    self._read(link, link.dealer, now)
                self._ask(link, now)

        keep_running(step, self._stop, self._count, bugs="subscriber_errors", logger=log)

    def _count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1

    def _read(self, link: _Link, sock: zmq.Socket[bytes], now: float) -> None:
        """Feed every frame waiting on ``sock`` (a DEALER's come after an empty delimiter)."""
        with contextlib.suppress(zmq.Again):
            for _ in range(1024):
                parts = sock.recv_multipart(zmq.NOBLOCK)
                if sock is link.dealer:
                    if not parts or parts[0]:
                        self._count("dropped_frames")
                        continue
                    parts = parts[1:]
                    if len(parts) == 3 and parts[1] == END_SEQ:
                        link.asked_at = None
                        end = decode_end(parts)
                        if end is not None:
                            link.worker = end[0].worker
                            with self._lock:
                                self.feed.heard(*end)
                        continue
                frame = decode_frame(parts)
                if frame is None:
                    self._count("dropped_frames")
                    continue
                link.worker, link.heard_at = frame.origin.worker, now
                with self._lock:
                    self.feed.receive(frame)

    def _ask(self, link: _Link, now: float) -> None:
        """Send ``link``'s publisher the replay request it needs now, if any (see the module
        docstring); one outstanding per publisher."""
        if link.asked_at is not None and now - link.asked_at < self.replay_timeout_s:
            return
        start: int | None = None
        with self._lock:
            position = None if link.worker is None else self.feed.position(link.worker)
            gap = None if link.worker is None else self.feed.gaps().get(link.worker)
        idle = now - max(link.heard_at, link.last_ask) >= self.resync_s
        if gap is not None:
            start = gap
        elif position is None:
            start = 0 if now - link.last_ask >= self.resync_s else None
        elif idle:
            start = position[1]
        if start is None:
            return
        with contextlib.suppress(zmq.Again):
            link.dealer.send_multipart([b"", replay_request(start)], zmq.NOBLOCK)
            link.asked_at = link.last_ask = now
            self._count("replays_asked")

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for link in self._links:
            link.sub.close(linger=0)
            link.dealer.close(linger=0)
        self._ctx.term()
