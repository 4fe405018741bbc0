"""How a ``kvplane serve`` process stops: wait for SIGTERM/SIGINT or a ``Shutdown`` order, then,
once the caller has closed what it owns, end the process without the interpreter's finalization.

Owns the process's SIGTERM/SIGINT handlers while serving; touches no socket, worker or tier
(closing them is the caller's, before :func:`end_process`). See docs/serving.md.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that stop a serving process (each then closes in order and exits 0)."""


def wait_for_stop(stop: threading.Event) -> bool:
    """Block until ``stop`` is set (a ``Shutdown`` order) or a :data:`STOP_SIGNALS` signal
    arrives (which sets it); whether a signal ended the wait. Installs the signals' handlers,
    so call it on the main thread (``ValueError`` elsewhere, before any wait)."""
    signalled = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        signalled.set()
        stop.set()

    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    while not stop.wait(0.2):  # a bounded wait: the handler runs between two
        pass
    return signalled.is_set()


def other_threads_waited_for() -> list[str]:
    """The names of the live non-daemon threads other than this one: a normal exit would wait
    for them (``threading``'s shutdown joins them before the exit handlers run)."""
    me = threading.current_thread()
    return [t.name for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]


def end_process(code: int) -> None:
    """End this process with ``code`` now: call it once everything the process owns is closed.

    Does what a normal exit does for others to see: the exit handlers run (``atexit``: logging's
    flush, ``weakref.finalize`` finalizers, library hooks) and stdout/stderr are flushed; then
    ``os._exit`` skips the interpreter's finalization, which tears down every module and runs the
    cyclic collector over torch's object graph for memory the kernel reclaims anyway (0.4-0.7 s
    on an idle host, seconds on a busy one). Returns, ending nothing, while another non-daemon
    thread lives (:func:`other_threads_waited_for`): the normal exit then waits for it as before.
    """
    if other_threads_waited_for():
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(OSError, ValueError):  # a reader gone, a stream closed
                stream.flush()
    os._exit(code)
