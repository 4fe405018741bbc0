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
tier is for. :attr:`NamespaceLease.lost` is true while the lease may have run out: from one
lease after the last renewal that succeeded was *sent* (renewals failing meanwhile), until a
renewal succeeds again (the key still holding our token proves nobody held it in between);
and for good once the key is found gone or another's (the server restarted, or it expired).
While it is true the tier refuses to write.
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
        self._lost = threading.Event()  # for good: the key was found gone or another's
        self._valid_until = time.monotonic() + lease_s  # before the claim is sent: no later
        self._claim(lease_s)
        self._thread = threading.Thread(
            target=self._renew_loop, name=f"kvplane-lease-{namespace}", daemon=True
        )
        self._thread.start()

    @property
    def lost(self) -> bool:
        """True while the lease may have run out (see the module docstring)."""
        return self._lost.is_set() or time.monotonic() > self._valid_until

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
        while not self._stop.wait(period):
            sent = time.monotonic()
            try:
                kept = self._client.eval(_RENEW, 1, self.key, self.token, self.lease_ms)
            except self._errors:
                continue  # ``lost`` turns true by itself one lease after the last success
            if not kept:
                self._lost.set()
                return
            self._valid_until = sent + self.lease_ms / 1000.0

    def release(self) -> None:
        """Stop renewing and delete the owner key if it is still ours; idempotent, never
        raises for a server that is gone (the lease then simply runs out)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(*self._errors):  # deletes only a key holding our token
            self._client.eval(_RELEASE, 1, self.key, self.token)
