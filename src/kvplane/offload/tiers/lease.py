"""The remote tier's namespace claim: one open tier per Redis namespace, by a renewed lease.

Safety rests on the server (fenced writes), not on timing; ``lost`` is a fast path, and
``lease_s >= 2 * timeout_s`` (:func:`check_lease_timing`). See docs/offload.md.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from typing import Any

from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.validators import require_finite_positive

_RENEW = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then "
    "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"
)
_RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
    "else return 0 end"
)
_POLL_S = 0.05


def check_lease_timing(
    lease_s: object,
    timeout_s: object,
    *,
    lease_name: str = "lease_s",
    timeout_name: str = "timeout_s",
    error: type[InvalidArgumentError] = InvalidArgumentError,
) -> None:
    """Raise ``error`` naming the field unless both are finite numbers > 0 and
    ``lease_s >= 2 * timeout_s`` (the module docstring's Timing derives the bound); the
    names let a config report its own fields. Checks only: changes nothing."""
    lease = require_finite_positive(lease_name, lease_s, error)
    timeout = require_finite_positive(timeout_name, timeout_s, error)
    if lease < 2 * timeout:
        raise error(
            f"{lease_name} must be >= 2 * {timeout_name} (a renewal may take {timeout_name} "
            f"and a write {timeout_name} more before the lease runs out), got "
            f"{lease_name}={lease_s!r} and {timeout_name}={timeout_s!r}"
        )


def owner_key(namespace: str) -> str:
    """The Redis key that names a namespace's owner (outside the ``:slot:`` keys)."""
    return f"{namespace}:owner"


class NamespaceLease:
    """This process's claim on ``namespace`` through ``client`` (a ``redis.Redis`` whose calls
    end, or raise, within ``timeout_s``).

    ``errors`` are the client's exception types (connection loss, server errors). Bad
    ``lease_s``/``timeout_s`` (see :func:`check_lease_timing`) raise
    :class:`InvalidArgumentError` before anything is sent. The constructor claims or raises
    :class:`OffloadError` naming the holder (after waiting up to ``lease_s`` for a dead
    holder's lease to run out); renewals run on a daemon thread until :meth:`release`.
    ``key`` replaces the owner key (:func:`owner_key`): a shared tier's writer holds a key of
    its own (:mod:`~kvplane.offload.tiers.shared_server`). Thread-safe.
    """

    def __init__(
        self,
        client: Any,
        namespace: str,
        lease_s: float,
        errors: tuple[type[BaseException], ...],
        *,
        timeout_s: float,
        key: str | None = None,
    ) -> None:
        check_lease_timing(lease_s, timeout_s)
        self.key = owner_key(namespace) if key is None else key
        self.namespace = namespace
        self.lease_ms = max(1, int(lease_s * 1000))
        self.timeout_s = float(timeout_s)
        self.token = f"{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:12]})"
        self._client = client
        self._errors = errors
        self._stop = threading.Event()
        self._lost = threading.Event()  # for good: the key was found gone or another's
        self._valid_until = 0.0  # the claim's send time plus the lease (as the server has it)
        self._claim(lease_s)
        self._thread = threading.Thread(
            target=self._renew_loop, name=f"kvplane-lease-{namespace}", daemon=True
        )
        self._thread.start()

    @property
    def lost(self) -> bool:
        """True while the lease may run out before a command sent now has run: less than
        ``timeout_s`` of it is left, or it was found gone (see the module docstring). A fast
        path only: the server refuses a fenced write of a lost lease anyway."""
        return self._lost.is_set() or time.monotonic() > self._valid_until - self.timeout_s

    def _claim(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            sent = time.monotonic()  # this attempt's, not the first's: a wait shortens nothing
            if self._client.set(self.key, self.token, nx=True, px=self.lease_ms):
                self._valid_until = sent + self.lease_ms / 1000.0  # the server's PX, not lease_s
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
        sent = self._valid_until - self.lease_ms / 1000.0  # the claim's send
        while not self._stop.wait(max(0.0, sent + period - time.monotonic())):
            sent = time.monotonic()
            try:
                kept = self._client.eval(_RENEW, 1, self.key, self.token, self.lease_ms)
            except self._errors:
                continue  # ``lost`` turns true by itself (the lease less one timeout)
            if not kept:
                self._lost.set()
                return
            self._valid_until = sent + self.lease_ms / 1000.0

    def mark_lost(self) -> None:
        """Record that the lease is gone for good (the server refused a fenced write: the key
        is gone or another's, and a unique token never comes back); :attr:`lost` stays true
        and renewals stop at their next try."""
        self._lost.set()

    def release(self) -> None:
        """Stop renewing and delete the owner key if it is still ours; idempotent, never
        raises for a server that is gone (the lease then simply runs out)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(*self._errors):  # deletes only a key holding our token
            self._client.eval(_RELEASE, 1, self.key, self.token)
