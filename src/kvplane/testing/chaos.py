"""Seeded fault injection into a real worker: a faulty transport and a faulty PD endpoint.

:class:`FaultyTransport` gives each submitted batch a :class:`~kvplane.testing.faults.Fate`
(reported only after the real batch ended, so it never reports DONE for bytes that did not
land); :class:`FaultyEndpoint` drops, duplicates or holds back outgoing *session* frames
(handshakes and heartbeats pass, so peers stay connected). :func:`worker_hooks` wires a
:class:`~kvplane.testing.faults.FaultPlan` into a worker.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace
from typing import Any, cast

from kvplane.errors import TransportError
from kvplane.pd.endpoint import Endpoint
from kvplane.pd.events import AnyWireEvent, SessionEvent
from kvplane.serving.worker import WorkerHooks
from kvplane.testing.faults import Fate, FaultPlan, FrameFaults, TransferFaults
from kvplane.transports.base import (
    FailureKind,
    Handle,
    Poll,
    Transport,
    XferState,
)
from kvplane.transports.proxy import TransportProxy


class FaultyTransport(TransportProxy):
    """A transport whose batches sometimes fail (see the module docstring); thread-safe."""

    def __init__(self, inner: Transport, faults: TransferFaults, seed: int = 0) -> None:
        super().__init__(inner)
        self.faults = faults
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._fates: dict[int, tuple[Fate, float]] = {}
        self._cancelled: set[int] = set()
        self.injected: dict[str, int] = {}

    def __getattr__(self, attr: str) -> Any:  # allocate, agent, ... of the real transport
        return getattr(self.inner, attr)

    def _before_submit(self) -> object:
        with self._lock:
            fate = self.faults.pick(self._rng)
            self.injected[fate.value] = self.injected.get(fate.value, 0) + 1
        if fate is Fate.SUBMIT_ERROR:
            raise TransportError("injected: submit refused")
        return fate

    def _submitted(self, handle: Handle, token: object) -> None:
        with self._lock:
            self._fates[handle.xfer_id] = (cast(Fate, token), 0.0)

    def poll(self, handle: Handle) -> Poll:
        got = self.inner.poll(handle)
        with self._lock:
            fate, since = self._fates.get(handle.xfer_id, (Fate.OK, 0.0))
            if fate is Fate.HANG and handle.xfer_id in self._cancelled:
                fate = Fate.OK  # a cancelled hung batch reports its truth
            if got.state.terminal and fate is Fate.LATE and since == 0.0:
                self._fates[handle.xfer_id] = (fate, time.monotonic())
                since = time.monotonic()
        if fate is Fate.HANG:
            return Poll(XferState.PENDING, got.bytes_done)
        if not got.state.terminal or fate is Fate.OK:
            return got
        if fate is Fate.LATE:  # the batch ends late, when revealed (so its true end is unknown)
            if time.monotonic() - since < self.faults.late_s:
                return Poll(XferState.PENDING, got.bytes_done)
            return replace(got, ended_at=None)
        state = XferState.FAILED if fate is Fate.FAIL else XferState.IN_DOUBT
        return Poll(state, got.bytes_done, FailureKind.BACKEND_ERROR, f"injected: {fate.value}")

    def cancel(self, handle: Handle) -> None:
        with self._lock:
            self._cancelled.add(handle.xfer_id)
        self.inner.cancel(handle)


class FaultyEndpoint(Endpoint):
    """A PD endpoint that drops, duplicates and delays its outgoing session frames."""

    def __init__(self, *args: Any, faults: FrameFaults, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = faults
        self._rng = random.Random(seed + 1)
        self._held: list[tuple[float, bytes, AnyWireEvent]] = []
        self.injected: dict[str, int] = {}

    def _count_fault(self, what: str) -> None:
        self.injected[what] = self.injected.get(what, 0) + 1

    def _send(self, identity: bytes, event: AnyWireEvent) -> None:
        if not isinstance(event, SessionEvent):
            super()._send(identity, event)
            return
        fate = self.faults.pick(self._rng)
        if fate != "ok":
            self._count_fault(fate)
        if fate == "drop":
            return
        if fate == "duplicate":
            super()._send(identity, event)
        elif fate == "reorder":
            delay = self._rng.random() * self.faults.reorder_s
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


def worker_hooks(plan: FaultPlan) -> WorkerHooks:
    """A worker's seams that inject ``plan`` (none for a kind of fault that is all zero)."""

    def wrap(transport: Transport) -> Transport:
        return FaultyTransport(transport, plan.transfers, plan.seed)

    def make(participant: Any, **options: Any) -> Endpoint:
        return FaultyEndpoint(participant, faults=plan.frames, seed=plan.seed, **options)

    return WorkerHooks(
        wrap_transport=wrap if plan.transfers.any else None,
        make_endpoint=make if plan.frames.any else None,
    )
