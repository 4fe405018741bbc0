"""Seeded fault injection for the PD runtime: a faulty transport and a faulty PD endpoint.

Theory of operation
-------------------
Chaos runs need failures the real parts rarely produce on a quiet machine. A worker built with
a :class:`FaultPlan` wraps its transport in :class:`FaultyTransport` and its PD endpoint is a
:class:`FaultyEndpoint`; both draw from one seeded RNG, so a run is reproducible.

:class:`FaultyTransport` decides a fate per submitted batch: refused at submit (``submit``
raises), or — only *after* the real batch is terminal, so no byte can land after the report —
reported FAILED, IN_DOUBT, or late by ``delay_s`` (which trips per-slice timeouts). It never
reports DONE for bytes that did not land. :class:`FaultyEndpoint` drops, duplicates or delays
(reorders) outgoing *session* frames; handshakes, heartbeats and probes pass untouched, so
peers stay connected and the protocol's retransmits, duplicate rejection and reordering
tolerance are what get exercised.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvplane.errors import ConfigError, TransportError
from kvplane.ids import PeerId, RegionId
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import AnyWireEvent, SessionEvent
from kvplane.serving.worker import WorkerHooks
from kvplane.transports.base import (
    DescriptorList,
    FailureKind,
    Handle,
    Peer,
    Poll,
    Region,
    Transport,
    XferKind,
    XferState,
)


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Probabilities (each in [0, 1]) of each injected fault, and the RNG seed."""

    seed: int = 0
    submit_error: float = 0.0
    fail: float = 0.0
    in_doubt: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.5
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_s: float = 0.05

    def __post_init__(self) -> None:
        for name in ("submit_error", "fail", "in_doubt", "delay", "drop", "duplicate", "reorder"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise ConfigError(f"FaultPlan.{name} must be a probability, got {value!r}")
        for name in ("delay_s", "reorder_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ConfigError(f"FaultPlan.{name} must be >= 0 seconds, got {value!r}")

    @property
    def transport_faults(self) -> bool:
        return bool(self.submit_error or self.fail or self.in_doubt or self.delay)

    @property
    def frame_faults(self) -> bool:
        return bool(self.drop or self.duplicate or self.reorder)

    def hooks(self) -> WorkerHooks:
        """A worker's seams that inject this plan's faults (none where a kind is all zero)."""
        wrap = (lambda t: FaultyTransport(t, self)) if self.transport_faults else None
        make = (
            (lambda participant, **kw: FaultyEndpoint(participant, plan=self, **kw))
            if self.frame_faults
            else None
        )
        return WorkerHooks(wrap_transport=wrap, make_endpoint=make)


class FaultyTransport:
    """A transport whose batches sometimes fail (see the module docstring); thread-safe."""

    def __init__(self, inner: Transport, plan: FaultPlan) -> None:
        self.inner = inner
        self.name = inner.name
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()
        self._fates: dict[int, tuple[str, float]] = {}
        self.injected: dict[str, int] = {}

    def __getattr__(self, attr: str) -> Any:  # allocate, agent, ... of the real transport
        return getattr(self.inner, attr)

    def _pick(self) -> str:
        p, roll = self.plan, self._rng.random()
        for fate, prob in (("submit_error", p.submit_error), ("fail", p.fail),
                           ("in_doubt", p.in_doubt), ("delay", p.delay)):  # fmt: skip
            if roll < prob:
                return fate
            roll -= prob
        return "ok"

    def register(self, buffer: torch.Tensor) -> Region:
        return self.inner.register(buffer)

    def deregister(self, region_id: RegionId) -> None:
        self.inner.deregister(region_id)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def connect(self, peer_metadata: bytes) -> Peer:
        return self.inner.connect(peer_metadata)

    def submit(
        self,
        kind: XferKind,
        src: DescriptorList,
        dst: DescriptorList,
        peer: Peer,
        *,
        notify: bytes | None = None,
        deadline_s: float = 30.0,
    ) -> Handle:
        with self._lock:
            fate = self._pick()
            self.injected[fate] = self.injected.get(fate, 0) + 1
        if fate == "submit_error":
            raise TransportError("injected: submit refused")
        handle = self.inner.submit(kind, src, dst, peer, notify=notify, deadline_s=deadline_s)
        with self._lock:
            self._fates[handle.xfer_id] = (fate, 0.0)
        return handle

    def poll(self, handle: Handle) -> Poll:
        got = self.inner.poll(handle)
        with self._lock:
            fate, since = self._fates.get(handle.xfer_id, ("ok", 0.0))
            if got.state.terminal and fate == "delay" and since == 0.0:
                self._fates[handle.xfer_id] = (fate, time.monotonic())
                since = time.monotonic()
        if not got.state.terminal or fate == "ok":
            return got
        if fate == "delay":  # the batch ends late, when revealed (so its true end is unknown)
            if time.monotonic() - since < self.plan.delay_s:
                return Poll(XferState.PENDING, got.bytes_done)
            return replace(got, ended_at=None)
        state = XferState.FAILED if fate == "fail" else XferState.IN_DOUBT
        return Poll(state, got.bytes_done, FailureKind.BACKEND_ERROR, f"injected: {fate}")

    def cancel(self, handle: Handle) -> None:
        self.inner.cancel(handle)

    def notifications(self) -> list[tuple[PeerId, bytes]]:
        return self.inner.notifications()

    def close(self) -> None:
        self.inner.close()


class FaultyEndpoint(Endpoint):
    """A PD endpoint that drops, duplicates and delays its outgoing session frames."""

    def __init__(self, *args: Any, plan: FaultPlan, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.plan = plan
        self._rng = random.Random(plan.seed + 1)
        self._held: list[tuple[float, bytes, AnyWireEvent]] = []
        self.injected: dict[str, int] = {}

    def _count_fault(self, what: str) -> None:
        self.injected[what] = self.injected.get(what, 0) + 1

    def _send(self, identity: bytes, event: AnyWireEvent) -> None:
        if not isinstance(event, SessionEvent):
            super()._send(identity, event)
            return
        p, roll = self.plan, self._rng.random()
        if roll < p.drop:
            self._count_fault("drop")
            return
        roll -= p.drop
        if roll < p.duplicate:
            self._count_fault("duplicate")
            super()._send(identity, event)
        elif roll - p.duplicate < p.reorder:
            self._count_fault("reorder")
            delay = self._rng.random() * p.reorder_s
            self._held.append((self.clock() + delay, identity, event))
            return
        super()._send(identity, event)

    def _run_due(self, now: float) -> None:
        super()._run_due(now)
        if self._held:  # held frames whose time has come go out now
            due = [h for h in self._held if h[0] <= now]
            self._held = [h for h in self._held if h[0] > now]
            for _, identity, event in due:
                super()._send(identity, event)

    def _next_deadline(self) -> float | None:
        own = super()._next_deadline()
        times = [h[0] for h in self._held] + ([] if own is None else [own])
        return min(times) if times else None
