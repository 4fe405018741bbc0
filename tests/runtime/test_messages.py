"""The runtime's control messages: validation bounds and fitting a stats reply to a frame."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.runtime.messages import (
    DecodeOrder,
    Envelope,
    Generate,
    PrefillOrder,
    WorkerStats,
    fit_timeline,
)
from kvplane.runtime.rpc import encode

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
