"""A worker's KV event publisher: a zmq PUB socket for the events, a ROUTER for replays.

:class:`KVEventPublisher` turns the :class:`~kvplane.offload.events.TierChange` reports of the
tiers it watches (:meth:`KVEventPublisher.watch`) into batches of its
:class:`~kvplane.serving.kv_event_log.EventLog` on one thread of its own: whatever changes are
waiting when it wakes (every 10 ms, or at once for a replay) become one batch, consecutive
changes of one kind in one tier one event. Both sockets are CURVE servers with keys derived
from the cluster secret for this purpose (``secret`` None: plain, the ``--insecure`` rule of
``WorkerConfig``) behind a :class:`~kvplane.pd.door.ListenerDoor` each; the replay socket also
answers describe requests (:mod:`~kvplane.serving.kv_describe`). It decides nothing about the
tiers and never blocks the thread that reports. See docs/serving.md ("KV events").
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvplane.curve_auth import CurveKeys, derive_keys
from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.events import TierChange, WatchedPolicy
from kvplane.offload.manager import OffloadManager
from kvplane.pd.door import MAX_CONNECTIONS, ListenerDoor
from kvplane.serving.kv_describe import DESCRIBE, KeyScheme, answer_frames
from kvplane.serving.kv_event_log import EventLog, coalesce
from kvplane.serving.kv_events import ChunksStored, parse_seq
from kvplane.serving.worker_config import LOOPBACK, split_address
from kvplane.validators import require_int

log = logging.getLogger(__name__)
POLL_MS = 10
"""How long the publisher's thread waits for a replay request before it publishes again."""


def keep_running(
    step: Callable[[], None],
    stop: threading.Event,
    count: Callable[[str], None],
    *,
    bugs: str,
    logger: logging.Logger,
) -> None:
    """Call ``step`` until ``stop`` is set; nothing it raises ends the loop. A ``ZMQError`` is
    counted under ``"socket_errors"`` (or ends the loop once ``stop`` is set: the sockets are
    closing); any other exception is a bug, counted under ``bugs`` and logged to ``logger``.
    The one loop rule of the KV event threads (publisher and subscriber)."""
    while not stop.is_set():
        try:
            step()
        except zmq.ZMQError:
            if stop.is_set():
                return
            count("socket_errors")
        except Exception:  # a bug must not stop the events: count it and keep going
            count(bugs)
            logger.exception("KV event thread error, counted as %r (it keeps going)", bugs)


def event_keys(secret: bytes) -> CurveKeys:
    """The KV event sockets' CURVE keys for cluster ``secret`` (``InvalidArgumentError`` for an
    empty one); unrelated to the order and PD sockets' keys."""
    return derive_keys(secret, b"kvev", "the KV event sockets")


@dataclass(frozen=True, slots=True)
class KVEventSettings:
    """Where a worker publishes (``pub_bind``) and answers replays (``replay_bind``), both
    127.0.0.1 unless told otherwise; ``buffer_steps`` batches kept for replay (vLLM's default);
    ``max_batch`` changes at most per batch; ``hwm`` the PUB socket's send high-water mark."""

    pub_bind: str = LOOPBACK
    replay_bind: str = LOOPBACK
    buffer_steps: int = 10_000
    max_batch: int = 4096
    hwm: int = 100_000

    def __post_init__(self) -> None:
        split_address("KVEventSettings.pub_bind", self.pub_bind)
        split_address("KVEventSettings.replay_bind", self.replay_bind)
        for name in ("buffer_steps", "max_batch", "hwm"):
            require_int(f"KVEventSettings.{name}", getattr(self, name), min=1)


class _TierLog(EventLog):
    """An :class:`EventLog` whose stored events say each tier's own tokens per chunk
    (:attr:`tier_block_sizes`; a tier not in it: ``block_size``), live and in snapshots."""

    def __init__(self, worker: str, incarnation: int, *, buffer_steps: int, block_size: int):
        self.tier_block_sizes: dict[str, int] = {}
        super().__init__(worker, incarnation, buffer_steps=buffer_steps, block_size=block_size)

    def stored(self, tier: str, keys: Sequence[ChunkKey]) -> ChunksStored:
        event = super().stored(tier, keys)
        size = self.tier_block_sizes.get(tier)
        return event if size is None else msgspec.structs.replace(event, block_size=size)


class KVEventPublisher:
    """One worker incarnation's publisher (see the module docstring); binds at construction.
    ``block_size``: tokens per chunk, said in each stored event of a tier watched without its
    own (0: unsaid; see :meth:`watch`). ``scheme``: how its chunks are keyed, told to describe
    requests (None: not known yet; :meth:`describe_as` tells it later)."""

    def __init__(
        self,
        worker: str,
        incarnation: int,
        settings: KVEventSettings | None = None,
        *,
        secret: bytes | None,
        block_size: int = 0,
        scheme: KeyScheme | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.scheme: KeyScheme | None = None
        if scheme is not None:
            self.describe_as(scheme)
        self.settings = settings = settings if settings is not None else KVEventSettings()
        self.log = _TierLog(
            worker, incarnation, buffer_steps=settings.buffer_steps, block_size=block_size
        )
        keys = None if secret is None else event_keys(secret)
        self.counters: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self._queue: queue.SimpleQueue[TierChange] = queue.SimpleQueue()
        self._ctxs: list[zmq.Context[zmq.Socket[bytes]]] = []
        self._doors: list[ListenerDoor] = []
        self._pub, self.address = self._listen(zmq.PUB, settings.pub_bind, keys, max_connections)
        self._pub.setsockopt(zmq.SNDHWM, settings.hwm)
        self._replay, self.replay_address = self._listen(
            zmq.ROUTER, settings.replay_bind, keys, max_connections
        )
        self._replay.setsockopt(zmq.MAXMSGSIZE, 64)
        self._replay.setsockopt(zmq.SNDHWM, settings.buffer_steps + 16)  # a whole replay
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{worker}", daemon=True)

    def _listen(
        self, kind: int, bind: str, keys: CurveKeys | None, cap: int
    ) -> tuple[zmq.Socket[bytes], str]:
        """A socket of ``kind`` bound to ``bind`` in a context of its own (one ZAP gate per
        context) behind its door; the socket and its bound address."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ctxs.append(ctx)
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        door = ListenerDoor(ctx, keys=keys, max_connections=cap, name="kv-events-door",
                            count=self._count)  # fmt: skip
        self._doors.append(door)
        door.guard(sock)
        sock.bind(bind)
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        door.start(address)
        return sock, address

    def _count(self, key: str, n: int = 1) -> None:
        with self._count_lock:
            self.counters[key] += n

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters (any thread): batches and events published, replays and
        snapshots served, requests dropped, the doors' counts."""
        with self._count_lock:
            return dict(self.counters)

    # -- reporting (any thread) ------------------------------------------------------------
    def describe_as(self, scheme: KeyScheme) -> None:
        """Answer describe requests with ``scheme`` from now on (any thread). Once told, the
        scheme is fixed: ``InvalidArgumentError`` for another one (a new scheme is a new
        publisher incarnation)."""
        if not isinstance(scheme, KeyScheme):
            raise InvalidArgumentError(f"a publisher's scheme must be a KeyScheme, got {scheme!r}")
        if self.scheme is not None and self.scheme != scheme:
            raise InvalidArgumentError(
                f"this publisher already describes scheme {self.scheme.fields()}, not "
                f"{scheme.fields()}"
            )
        self.scheme = scheme

    def record(self, change: TierChange) -> None:
        """Queue ``change`` for the next batch; never blocks."""
        self._queue.put(change)

    def watch_tiers(
        self, managers: Iterable[OffloadManager], tokens_per_chunk: int, spans: Mapping[str, int]
    ) -> None:
        """:meth:`watch` each of a cascade's ``managers`` (host first), each tier's stored events
        saying its own tokens per chunk: ``tokens_per_chunk`` times its span of host chunks
        (``spans``, the tier book's; 1 where absent). The one rule for kvplane workers and the
        vLLM connector alike; same thread rule as :meth:`watch`."""
        for manager in managers:
            self.watch(manager, tokens_per_chunk * spans.get(manager.tier, 1))

    def watch(self, manager: OffloadManager, block_size: int | None = None) -> None:
        """Report ``manager``'s tier changes from now on by wrapping its eviction policy (see
        :class:`~kvplane.offload.events.WatchedPolicy`); the chunks it holds now are reported
        stored first. ``block_size``: the tier's tokens per chunk, said in its stored events
        (None: the publisher's; a cold tier's chunk may span several host chunks). Call on the
        thread that owns ``manager``, once per manager, before :meth:`start`."""
        if block_size is not None:
            size = require_int(f"{manager.tier} block_size", block_size, min=0)
            self.log.tier_block_sizes[manager.tier] = size
        resident = manager.policy.order()
        manager.policy = WatchedPolicy(manager.policy, manager.tier, self.record)
        for key in resident:
            self.record(TierChange(manager.tier, ChunkKey(key), True))

    # -- the thread ------------------------------------------------------------------------
    def start(self) -> None:
        if not self._thread.is_alive():
            self._thread.start()

    def _run(self) -> None:
        keep_running(self._step, self._stop, self._count, bugs="publisher_errors", logger=log)
        with contextlib.suppress(zmq.ZMQError):
            self._publish()

    def _step(self) -> None:
        if self._replay.poll(POLL_MS):
            self._serve_replays()
        self._publish()

    def _publish(self) -> None:
        """Publish every change waiting, ``max_batch`` at most per batch."""
        while True:
            changes: list[tuple[str, ChunkKey, bool]] = []
            with contextlib.suppress(queue.Empty):
                while len(changes) < self.settings.max_batch:
                    ch = self._queue.get_nowait()
                    changes.append((ch.tier, ch.key, ch.stored))
            if not changes:
                return
            events = coalesce(changes, self.log)
            with contextlib.suppress(zmq.Again):  # PUB drops past its HWM; replay fills gaps
                self._pub.send_multipart(self.log.append(events), zmq.NOBLOCK)
            self._count("batches_published")
            self._count("events_published", len(changes))

    def _serve_replays(self) -> None:
        """Answer every replay request waiting: ``[id, b"", start]`` (vLLM's REQ framing), and
        every describe request ``[id, b"", DESCRIBE]``."""
        while True:
            try:
                parts = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) == 3 and not parts[1] and parts[2] == DESCRIBE:
                answer = answer_frames(self.log.topic, self.scheme)
                self._replay.send_multipart([parts[0], b"", *answer], zmq.NOBLOCK)
                self._count("describes_served")
                continue
            start = parse_seq(parts[2]) if len(parts) == 3 and not parts[1] else None
            if start is None or start >= 1 << 63:
                self._count("dropped_requests")
                continue
            self._publish()  # a replay covers everything reported before it was asked
            before = self.log.snapshots
            for frame in self.log.replay(start):
                self._replay.send_multipart([parts[0], b"", *frame], zmq.NOBLOCK)
            self._replay.send_multipart([parts[0], b"", *self.log.end_frame()], zmq.NOBLOCK)
            self._count("replays_served")
            self._count("snapshots_served", self.log.snapshots - before)

    def close(self) -> None:
        """Publish what is waiting, stop the thread, close the sockets and doors."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        for sock in (self._pub, self._replay):
            sock.close(linger=0)
        for door in self._doors:
            door.close()
        for ctx in self._ctxs:
            ctx.term()
