"""The proxy's upstream calls: URLs, error lines, cancellation (against real sockets)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvplane.apps.proxy_upstream import Call, Upstream, UpstreamError, error_message, one_line
from kvplane.errors import ConfigError


@pytest.mark.parametrize(
    ("url", "host", "port"),
    [("http://127.0.0.1:8000", "127.0.0.1", 8000), ("http://h-1.example:1/", "h-1.example", 1),
     ("http://[::1]:65535", "::1", 65535)],
)  # fmt: skip
def test_urls_parse_to_host_and_port(url: str, host: str, port: int) -> None:
    up = Upstream.from_url("decode", url, 3.0)
    assert (up.host, up.port, up.timeout_s) == (host, port, 3.0)


@pytest.mark.parametrize("url", ["https://h:1", "http://h", "http://h:0", "http://h:1/v1", "h:1"])
def test_other_urls_are_refused_naming_the_flag(url: str) -> None:
    with pytest.raises(ConfigError) as err:
        Upstream.from_url("prefill", url, 1.0)
    assert str(err.value) == f"--prefill must be http://HOST:PORT, got {url!r}"


@pytest.mark.parametrize(
    ("raw", "line"),
    [(b'{"error": {"message": "a\\nb"}}', "a b"), (b'{"error": "x"}', "x"),
     (b'{"detail": [1]}', "[1]"), (b'{"message": "m"}', "m"), (b"Trace\n  back", "Trace back"),
     (b"{}", "{}")],
)  # fmt: skip
def test_error_messages_are_one_line(raw: bytes, line: str) -> None:
    assert error_message(raw) == line


def test_one_line_cuts_long_text() -> None:
    assert one_line("x" * 300, 10) == "xxxxxxx..."


def test_cancel_from_another_thread_ends_a_blocked_read() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        up = Upstream("decode", "127.0.0.1", listener.getsockname()[1], 30.0)
        call = Call(up, "/v1/completions", {"prompt": [1]}, {})
        call.send()  # accepted by the backlog; never answered
        timer = threading.Timer(0.2, call.cancel)
        t0 = time.monotonic()
        timer.start()
        with pytest.raises(UpstreamError) as err:
            call.response()
        assert time.monotonic() - t0 < 5.0
        assert (err.value.status, str(err.value)) == (502, f"decode server {up.url}: cancelled")
        call.close()


def test_a_timeout_names_the_server_and_the_seconds() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        up = Upstream("prefill", "127.0.0.1", listener.getsockname()[1], 0.3)
        with Call(up, "/v1/completions", {}, {}) as call:
            call.send()
            with pytest.raises(UpstreamError) as err:
                call.answer()
        assert str(err.value) == f"prefill server {up.url}: no answer within 0.3 s"
