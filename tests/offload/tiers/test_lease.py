"""NamespaceLease against a scripted client: a lease whose renewals fail for a while reads
``lost`` and recovers when they succeed again; release deletes only our own key."""

from __future__ import annotations

import threading
import time
from typing import Any

from kvplane.offload.tiers.lease import NamespaceLease


class DownError(Exception):
    """The scripted server does not answer."""


class Scripted:
    """A one-key Redis stand-in: ``down`` makes every call raise; ``expire`` drops the key."""

    def __init__(self) -> None:
        self.value: str | None = None
        self.down = threading.Event()
        self.renewals = 0

    def set(self, key: str, value: str, nx: bool, px: int) -> bool:
        if self.value is not None:
            return False
        self.value = value
        return True

    def get(self, key: str) -> bytes | None:
        return None if self.value is None else self.value.encode()

    def eval(self, script: str, n: int, key: str, token: str, *args: Any) -> int:
        if self.down.is_set():
            raise DownError("no answer")
        if self.value != token:
            return 0
        if "PEXPIRE" in script:
            self.renewals += 1
            return 1
        self.value = None
        return 1


def wait(cond: Any, timeout_s: float = 3.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_failing_renewals_make_the_lease_lost_until_one_succeeds() -> None:
    client = Scripted()
    lease = NamespaceLease(client, "ns", 0.3, (DownError,))
    try:
        wait(lambda: client.renewals >= 1)
        assert not lease.lost
        client.down.set()
        wait(lambda: lease.lost)  # one lease after the last renewal that succeeded
        client.down.clear()
        wait(lambda: not lease.lost)  # the key still holds our token: nobody held it
        assert client.value == lease.token
    finally:
        lease.release()
    assert client.value is None  # released even after a lost spell


def test_a_key_found_gone_is_lost_for_good_and_release_touches_no_other_owner() -> None:
    client = Scripted()
    lease = NamespaceLease(client, "ns", 0.3, (DownError,))
    client.value = "another engine"
    wait(lambda: lease.lost)
    lease.release()
    assert lease.lost and client.value == "another engine"
