"""The router's KV event watch: one subscriber on the publishers its membership names.

:class:`KVEventWatch` owns the router's :class:`~kvplane.serving.router.prefix_index.PrefixIndex`
and the one :class:`~kvplane.serving.router.kv_subscriber.KVEventSubscriber` that feeds it. Each
membership refresh hands it the workers' latest ``WorkerInfo``; when the event addresses they
advertise change (a worker learned, restarted on new ports, or no longer publishing) it replaces
the subscriber (the new one replays every publisher from seq 0, each worker's holdings cleared
at its first frame) and forgets the workers that stopped publishing. Decides nothing about
routing; never touches a worker. See docs/serving.md ("KV events").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import zmq

from kvplane.errors import KVPlaneError
from kvplane.serving.messages import WorkerInfo
from kvplane.serving.router.kv_subscriber import EventSource, KVEventSubscriber
from kvplane.serving.router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)


def sources_of(infos: Iterable[WorkerInfo | None]) -> dict[str, EventSource]:
    """Per worker (peer id) advertising both KV event addresses, its :class:`EventSource`; a
    worker advertising a malformed address is left out (logged). Pure but for the log."""
    out: dict[str, EventSource] = {}
    for info in infos:
        if info is None or not info.kv_events_address or not info.kv_replay_address:
            continue
        try:
            out[info.peer_id] = EventSource(info.kv_events_address, info.kv_replay_address)
        except KVPlaneError as exc:
            log.warning("worker %s advertises bad KV event addresses: %s", info.peer_id, exc)
    return out


class KVEventWatch:
    """The prefix index and its subscriber (see the module docstring). ``secret``: the
    cluster secret (None: plain, the router's insecure mode). Call :meth:`update` and
    :meth:`close` from one thread at a time (the router's refresh lock); :attr:`index` is
    read from any thread."""

    def __init__(self, *, secret: bytes | None, resync_s: float = 1.0) -> None:
        self.secret = secret
        self.resync_s = resync_s
        self.index = PrefixIndex()
        self.subscriber: KVEventSubscriber | None = None
        self._sources: dict[str, EventSource] = {}

    @property
    def sources(self) -> dict[str, EventSource]:
        """The publishers subscribed to now, by worker."""
        return dict(self._sources)

    def update(self, infos: Iterable[WorkerInfo | None]) -> bool:
        """Subscribe to the publishers ``infos`` advertise, replacing the subscriber when they
        changed; True when it did. A socket that cannot connect is logged and the watch left
        without a subscriber (the next update tries again)."""
        sources = sources_of(infos)
        if sources == self._sources and (self.subscriber is not None or not sources):
            return False
        self._stop_subscriber()
        for worker in set(self._sources) - set(sources):
            self.index.clear(worker)
        self._sources = sources
        if sources:
            try:
                sub = KVEventSubscriber(
                    list(sources.values()), secret=self.secret, index=self.index,
                    resync_s=self.resync_s,
                )  # fmt: skip
            except zmq.ZMQError as exc:
                log.warning("router cannot subscribe to KV events: %s", exc)
                return False
            sub.start()
            self.subscriber = sub
        return True

    def _stop_subscriber(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    def snapshot(self) -> dict[str, int]:
        """The subscriber's counters (empty without one) and the publishers subscribed to."""
        sub = self.subscriber
        counts = sub.snapshot() if sub is not None else {}
        return {**counts, "sources": len(self._sources)}

    def close(self) -> None:
        """Stop the subscriber; the index stays readable."""
        self._stop_subscriber()
