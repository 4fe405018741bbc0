"""NamespaceLease against a scripted client: a lease whose renewals fail for a while reads
``lost`` (one timeout before it could run out) and recovers when they succeed again; release
deletes only our own key; lease and timeout are checked against each other."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.offload.tiers.lease import NamespaceLease, check_lease_timing


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
    lease = NamespaceLease(client, "ns", 0.3, (DownError,), timeout_s=0.1)
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
    lease = NamespaceLease(client, "ns", 0.3, (DownError,), timeout_s=0.1)
    client.value = "another engine"
    wait(lambda: lease.lost)
    lease.release()
    assert lease.lost and client.value == "another engine"


class HeldByDeadEngine(Scripted):
    """The key is a dead engine's until ``free_at`` (its unrenewed lease runs out then)."""

    def __init__(self, free_at: float) -> None:
        super().__init__()
        self.value = "dead engine"
        self.free_at = free_at

    def set(self, key: str, value: str, nx: bool, px: int) -> bool:
        if self.value == "dead engine" and time.monotonic() >= self.free_at:
            self.value = None
        return super().set(key, value, nx, px)


def test_lost_turns_true_one_timeout_before_the_lease_can_run_out() -> None:
    """A write decided at ``c`` runs on the server up to ``timeout_s`` later: with renewals
    failing, ``lost`` must be true from ``lease - timeout`` after the claim was sent, not only
    once the whole lease is gone (by then a write let through could land in another's lease)."""
    client = Scripted()
    client.down.set()  # the claim (SET) goes through, every renewal fails
    start = time.monotonic()
    lease = NamespaceLease(client, "ns", 0.8, (DownError,), timeout_s=0.4)
    try:
        assert client.value == lease.token
        while time.monotonic() - start < 0.35:
            assert not lease.lost, "lost before lease - timeout had passed"
            time.sleep(0.01)
        time.sleep(0.5 - (time.monotonic() - start))  # 0.3 s of the lease left: < timeout
        assert lease.lost
    finally:
        lease.release()


def test_a_claim_that_waited_counts_its_lease_from_the_attempt_that_succeeded() -> None:
    """The claim polls while a dead holder's lease runs out: the lease it gets starts at the
    SET that succeeded, not at the first attempt (which would leave it lost at once)."""
    client = HeldByDeadEngine(free_at=time.monotonic() + 0.5)
    client.down.set()  # no renewal succeeds: only the claim counts
    lease = NamespaceLease(client, "ns", 0.8, (DownError,), timeout_s=0.2)
    try:
        claimed = time.monotonic()
        assert client.value == lease.token and claimed >= client.free_at
        assert not lease.lost  # 0.6 s usable from the SET that won, not 0.1 s
        time.sleep(max(0.0, claimed + 0.3 - time.monotonic()))
        assert not lease.lost
    finally:
        lease.release()


@pytest.mark.parametrize(
    ("lease_s", "timeout_s", "message"),
    [
        (0.3, 0.2, "lease_s must be >= 2 * timeout_s (a renewal may take timeout_s and a write "
         "timeout_s more before the lease runs out), got lease_s=0.3 and timeout_s=0.2"),
        (float("nan"), 0.1, "lease_s must be a finite number > 0 and at most 1e+06 s, got nan"),
        (1.0, True, "timeout_s must be a finite number > 0 and at most 1e+06 s, got True"),
        (1.0, float("inf"), "timeout_s must be a finite number > 0 and at most 1e+06 s, got inf"),
        (0, 0.1, "lease_s must be a finite number > 0 and at most 1e+06 s, got 0"),
    ],
)  # fmt: skip
def test_a_lease_refuses_bad_timing_before_sending_anything(
    lease_s: object, timeout_s: object, message: str
) -> None:
    client = Scripted()
    with pytest.raises(InvalidArgumentError) as info:
        NamespaceLease(client, "ns", lease_s, (DownError,), timeout_s=timeout_s)  # type: ignore[arg-type]
    assert type(info.value) is InvalidArgumentError and str(info.value) == message
    assert client.value is None  # nothing was claimed


def test_lease_timing_boundary_and_caller_names() -> None:
    check_lease_timing(10.0, 5.0)  # exactly twice: allowed (the OffloadConfig defaults)
    check_lease_timing(1, 0.5)
    with pytest.raises(ConfigError, match=r"^Cfg\.lease must be >= 2 \* Cfg\.timeout "):
        check_lease_timing(0.99, 0.5, lease_name="Cfg.lease", timeout_name="Cfg.timeout",
                           error=ConfigError)  # fmt: skip
