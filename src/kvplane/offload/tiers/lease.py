"""The remote tier's namespace claim: one open tier per Redis namespace, by a lease.

Slots are numbered by the one manager that owns a namespace, so two engines writing one
namespace overwrite each other's slots (their hits would read back as misses and load errors).
:class:`NamespaceLease` makes the ownership explicit: opening a tier sets
``<namespace>:owner`` to a token naming this process (``SET NX PX``), a helper thread renews it
every third of the lease while the tier is open, and :meth:`NamespaceLease.release` deletes it
if it is still ours (compare-and-delete in one Lua script). A namespace held by a live engine
is refused with an :class:`~kvplane.errors.OffloadError` naming the holder; a holder that died
without releasing stops renewing, so its lease runs out within ``lease_s`` and the claim (which
waits that long) succeeds: a restarted engine re-finds its own chunks, which is what the remote
tier is for. A lease lost while open (the server restarted, or renewals failed for a whole
lease) makes :attr:`NamespaceLease.lost` true; the tier then refuses to write.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
import uuid
from typing import Any

from kvplane.errors import InvalidArgumentError, OffloadError

_RENEW = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"
)
_RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
    "else return 0 end"
)
_POLL_S = 0.05


def owner_key(namespace: str) -> str:
    """The Redis key that names a namespace's owner (outside the ``:slot:`` keys)."""
    return f"{namespace}:owner"


class NamespaceLease:
    """This process's claim on ``namespace`` through ``client`` (a ``redis.Redis``).

    ``errors`` are the client's exception types (connection loss, server errors). The
    constructor claims or raises :class:`OffloadError` naming the holder (after waiting up to
    ``lease_s`` for a dead holder's lease to run out); renewals run on a daemon thread until
    :meth:`release`. Thread-safe.
    """

    def __init__(
        self,
        client: Any,
        namespace: str,
        lease_s: float,
        errors: tuple[type[BaseException], ...],
    ) -> None:
        if (
            isinstance(lease_s, bool)
            or not isinstance(lease_s, (int, float))
            or not math.isfinite(lease_s)
            or lease_s <= 0
        ):
            raise InvalidArgumentError(f"lease_s must be a finite number > 0: {lease_s!r}")
        self.key = owner_key(namespace)
        self.namespace = namespace
        self.lease_ms = max(1, int(lease_s * 1000))
        self.token = f"{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:12]})"
        self._client = client
        self._errors = errors
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._claim(lease_s)
        self._thread = threading.Thread(
            target=self._renew_loop, name=f"kvplane-lease-{namespace}", daemon=True
        )
        self._thread.start()

    @property
    def lost(self) -> bool:
        """True once the lease was found taken over or expired while the tier was open."""
        return self._lost.is_set()

    def _claim(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            if self._client.set(self.key, self.token, nx=True, px=self.lease_ms):
                return
            holder = self._client.get(self.key)
            if time.monotonic() >= deadline:
                who = holder.decode(errors="replace") if holder is not None else "(expired)"
                raise OffloadError(
                    f"remote namespace {self.namespace!r} is in use by {who}: each engine "
                    "needs its own remote_namespace (two sharing one would overwrite each "
                    "other's slots)"
                )
            time.sleep(_POLL_S)

    def _renew_loop(self) -> None:
        period = self.lease_ms / 3000.0
        last_ok = time.monotonic()
        while not self._stop.wait(period):
            try:
                kept = self._client.eval(_RENEW, 1, self.key, self.token, self.lease_ms)
            except self._errors:
                if time.monotonic() - last_ok > self.lease_ms / 1000.0:
                    self._lost.set()  # it has expired by now: another claim may succeed
                continue
            if not kept:
                self._lost.set()
                return
            last_ok = time.monotonic()

    def release(self) -> None:
        """Stop renewing and delete the owner key if it is still ours; idempotent, never
        raises for a server that is gone (the lease then simply runs out)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        if self._lost.is_set():
            return
        with contextlib.suppress(*self._errors):
            self._client.eval(_RELEASE, 1, self.key, self.token)
