"""Completion wake-ups for the slice driver: a transport tap and, where needed, a watcher thread.

A wake-up is only a hint: every state still comes from ``poll``. See docs/pipeline.md.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Protocol, cast

from kvplane.errors import KVPlaneError
from kvplane.transports.base import (
    Handle,
    Poll,
    Transport,
)
from kvplane.transports.proxy import TransportProxy

WATCH_S = 0.05
"""The longest single blocking wait on one batch (the watcher re-checks for close between)."""

_STOP = object()


class _Waitable(Protocol):
    def wait(self, handle: Handle, timeout_s: float | None = None) -> Poll: ...


class _Hooked(Protocol):
    def on_done(self, handle: Handle, fn: Callable[[], None]) -> None: ...


class _Tap(TransportProxy):
    """The watched transport: the real one's calls, plus each new handle sent to the watcher."""

    def __init__(self, inner: Transport, watch: Callable[[Handle], None]) -> None:
        super().__init__(inner)
        self._watch = watch

    def _submitted(self, handle: Handle, token: object) -> None:
        self._watch(handle)

    def close(self) -> None:
        """Not the tap's to close: the worker owns the transport."""


class BatchWatcher:
    """Wakes its owner when a watched batch ends (see the module docstring).

    ``wake`` is called on the watcher thread and must be cheap and thread-safe (the driver
    notifies its condition). Call :meth:`start` before submitting and :meth:`close` at the end.
    """

    def __init__(self, transport: Transport, wake: Callable[[], None]) -> None:
        hook = getattr(transport, "on_done", None)
        found = getattr(transport, "wait", None)
        self._hook = cast(_Hooked, transport).on_done if callable(hook) else None
        self._wait = cast(_Waitable, transport).wait if callable(found) else None
        self._wake = wake
        self._handles: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvplane-xfer-watch", daemon=True)
        watch: Callable[[Handle], None] = self._handles.put
        if self._hook is not None:
            watch = partial(_hook_one, self._hook, self._notify)
        self.transport: Transport = _Tap(transport, watch) if self.active else transport

    @property
    def active(self) -> bool:
        """Whether batches are watched (the transport has a completion hook or can block until
        a batch ends)."""
        return self._hook is not None or self._wait is not None

    @property
    def threaded(self) -> bool:
        """Whether a watcher thread is needed (no completion hook, only ``wait``)."""
        return self._hook is None and self._wait is not None

    def start(self) -> None:
        if self.threaded:
            self._thread.start()

    def close(self) -> None:
        self._closing.set()
        self._handles.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _notify(self) -> None:
        if not self._closing.is_set():
            self._wake()

    def _loop(self) -> None:
        wait = self._wait
        if wait is None:  # pragma: no cover - the thread starts only when active
            return
        while True:
            item = self._handles.get()
            if item is _STOP or self._closing.is_set():
                return
            handle = cast(Handle, item)
            with contextlib.suppress(KVPlaneError):  # forgotten or broken: poll will tell
                while not self._closing.is_set() and not wait(handle, WATCH_S).state.terminal:
                    pass
            self._wake()


def _hook_one(
    hook: Callable[[Handle, Callable[[], None]], None], notify: Callable[[], None], handle: Handle
) -> None:
    """Ask the transport to call ``notify`` when ``handle`` ends."""
    with contextlib.suppress(KVPlaneError):  # forgotten or broken: poll will tell
        hook(handle, notify)
