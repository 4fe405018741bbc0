"""The KV event threads' loop rule: socket errors and bugs are counted and never stop it."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest
import zmq

from kvplane.serving.kv_publisher import keep_running

log = logging.getLogger("test_kv_publisher")


def test_socket_errors_and_bugs_are_counted_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop, counts, calls = threading.Event(), Counter[str](), [0]
    raised: list[BaseException | None] = [zmq.ZMQError(), RuntimeError("bug"), None, zmq.Again()]

    def step() -> None:
        calls[0] += 1
        exc = raised.pop(0)
        if not raised:
            stop.set()
        if exc is not None:
            raise exc

    def count(key: str) -> None:
        counts[key] += 1

    with caplog.at_level(logging.ERROR, logger="test_kv_publisher"):
        keep_running(step, stop, count, bugs="publisher_errors", logger=log)
    assert calls[0] == 4
    assert counts == Counter({"socket_errors": 1, "publisher_errors": 1})  # the last: stopping
    assert [r.getMessage() for r in caplog.records] == [
        "KV event thread error, counted as 'publisher_errors' (it keeps going)"
    ]


def test_a_stopped_loop_does_not_step() -> None:
    stop = threading.Event()
    stop.set()
    keep_running(lambda: pytest.fail("stepped"), stop, lambda key: None, bugs="x", logger=log)
