"""The request-book rules both PD workers share: new-request checks, stop lookup, forget."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvplane.blocks import BlockTable
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.ids import RequestId, SessionId
from kvplane.serving.worker_requests import check_fits, check_new, find_to_stop, forget


@dataclass(frozen=True)
class _Order:
    request_id: str


@dataclass(eq=False)
class _Req:
    order: _Order
    sid: SessionId
    table: BlockTable | None = None
    slot: int | None = None
    failed_at: float | None = field(default=None)


def _book(*pairs: tuple[str, str]) -> tuple[dict[RequestId, _Req], dict[SessionId, _Req]]:
    reqs = {RequestId(r): _Req(_Order(r), SessionId(s)) for r, s in pairs}
    return reqs, {q.sid: q for q in reqs.values()}


def test_check_new_refuses_a_known_request_and_a_bound_session():
    reqs, by_sid = _book(("a", "s1"))
    with pytest.raises(InvalidArgumentError, match=r"^request 'a' is already on this worker$"):
        check_new(reqs, by_sid, RequestId("a"), SessionId("s9"))
    with pytest.raises(
        InvalidArgumentError, match=r"^session 's1' is already bound to request 'a'$"
    ):
        check_new(reqs, by_sid, RequestId("b"), SessionId("s1"))
    check_new(reqs, by_sid, RequestId("b"), SessionId("s2"))


def test_check_fits_refuses_only_more_blocks_than_the_pool():
    check_fits(RequestId("a"), 4, 4)
    with pytest.raises(ConfigError, match=r"^request 'a' needs 5 blocks; the pool has 4$"):
        check_fits(RequestId("a"), 5, 4)


def test_find_to_stop_checks_the_session_and_stamps_the_first_failure_time():
    reqs, _ = _book(("a", "s1"))
    assert find_to_stop(reqs, RequestId("x"), None) is None
    assert find_to_stop(reqs, RequestId("a"), "other") is None
    assert reqs[RequestId("a")].failed_at is None
    got = find_to_stop(reqs, RequestId("a"), "s1")
    assert got is reqs[RequestId("a")] and got.failed_at is not None
    first = got.failed_at
    assert find_to_stop(reqs, RequestId("a"), None) is got and got.failed_at == first


def test_forget_drops_only_the_request_s_own_entries():
    reqs, by_sid = _book(("a", "s1"), ("b", "s2"))
    stale = _Req(_Order("b"), SessionId("s2"))
    forget(reqs, by_sid, stale)
    assert set(reqs) == {"a", "b"} and set(by_sid) == {"s1", "s2"}
    forget(reqs, by_sid, reqs[RequestId("a")])
    assert set(reqs) == {"b"} and set(by_sid) == {"s2"}
