"""The runtime's control messages: validation bounds and fitting a stats reply to a frame."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.errors import InvalidArgumentError
from kvplane.serving.messages import (
    MAX_POOLS,
    DecodeOrder,
    Envelope,
    Generate,
    PrefillOrder,
    WorkerInfo,
    WorkerStats,
    fit_timeline,
)
from kvplane.serving.rpc import encode

_decoder = msgspec.msgpack.Decoder(Envelope)


@pytest.mark.parametrize("token", [1 << 63, (1 << 64) - 1])
@pytest.mark.parametrize(
    "make",
    [
        lambda t: PrefillOrder(request_id="r", session_id="s", decode_peer="d", token_ids=(1, t)),
        lambda t: DecodeOrder(request_id="r", session_id="s", prefill_peer="p", token_ids=(1, t)),
        lambda t: Generate(request_id="r", token_ids=(1, t)),
    ],
)
def test_token_ids_outside_int64_fail_validation(make: object, token: int) -> None:
    msg = make(token)  # type: ignore[operator]
    with pytest.raises(msgspec.ValidationError, match=r"token_ids\[1\]"):
        _decoder.decode(encode(1, msg))


def test_int64_extremes_pass_validation() -> None:
    msg = Generate(request_id="r", token_ids=((1 << 63) - 1, -(1 << 63)))
    assert _decoder.decode(encode(1, msg)).body == msg


def _stats(n: int) -> WorkerStats:
    events = tuple({"t": float(i), "mark": "order", "request_id": f"{i:0100d}"} for i in range(n))
    return WorkerStats(
        peer_id="w", counters={"a": 1}, used_blocks=0, used_slots=0, sessions_live=0,
        requests_live=0, timeline=events,
    )  # fmt: skip


def test_fit_timeline_keeps_the_newest_events_that_fit() -> None:
    small = _stats(3)
    assert fit_timeline(small, 1 << 20) is small
    big = _stats(1000)
    fitted = fit_timeline(big, 20_000)
    assert len(msgspec.msgpack.encode(fitted)) <= 20_000
    kept = len(fitted.timeline)
    assert 0 < kept < 1000 and fitted.timeline_truncated == 1000 - kept
    assert fitted.timeline == big.timeline[-kept:]  # the newest, in order
    assert fit_timeline(big, 10).timeline == ()


def _info(**kw: object) -> WorkerInfo:
    base: dict[str, object] = {
        "role": "decode", "peer_id": "d", "pd_address": "tcp://127.0.0.1:1", "incarnation": 1,
        "transport": "tcp",
    }  # fmt: skip
    return WorkerInfo(**(base | kw))  # type: ignore[arg-type]


def test_worker_info_head_ranges_travel_and_default_to_unsaid() -> None:
    said = _info(head_ranges=((2, 4), (0, 1)))
    assert _decoder.decode(encode(1, said)).body == said
    older = msgspec.msgpack.encode(  # a worker from before head_ranges: no such field
        {"type": "worker_info", "role": "decode", "peer_id": "d", "pd_address": "a",
         "incarnation": 1, "transport": "tcp"}
    )  # fmt: skip
    assert msgspec.msgpack.decode(older, type=WorkerInfo).head_ranges == ()


@pytest.mark.parametrize(
    ("ranges", "match"),
    [
        ([[2, 2]], r"head_ranges\[0\] must be a non-empty range"),
        ([[0, 1], [3, 1]], r"head_ranges\[1\] must be a non-empty range"),
        ([[-1, 2]], r"head_ranges\[0\]\[0\]"),
        ([[0, 1, 2]], r"head_ranges\[0\]"),
        ([[0, 1]] * (MAX_POOLS + 1), r"head_ranges"),
    ],
)
def test_worker_info_head_ranges_are_validated_on_decode(ranges: object, match: str) -> None:
    frame = msgspec.msgpack.encode(
        {"type": "worker_info", "role": "decode", "peer_id": "d", "pd_address": "a",
         "incarnation": 1, "transport": "tcp", "head_ranges": ranges}
    )  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match=match):
        msgspec.msgpack.decode(frame, type=WorkerInfo)


def test_worker_info_built_with_an_empty_head_range_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"head_ranges\[0\].*got \(3, 1\)"):
        _info(head_ranges=((3, 1),))
