"""One HTTP call from ``kvplane serve proxy`` to a vLLM server, cancellable from another thread.

Owns the upstream side of the proxy: parsing ``http://HOST:PORT``, sending a JSON request with
a timeout on every socket operation, reading a bounded answer, turning a failure (refused,
timed out, a non-2xx status) into one line with the status the client gets, and
:meth:`Call.cancel`, which closes the socket so vLLM aborts the request. Stdlib ``http.client``
only; it must not decide what to send (:mod:`~kvplane.apps.proxy_requests` does).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.errors import ConfigError, IntegrationError

MAX_ANSWER_BYTES = 64 << 20
"""A non-streamed upstream answer larger than this is a failure (a completion is far smaller)."""
_URL_RE = re.compile(r"^http://([A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:]{2,45}\]):(\d{1,5})/?$")


class UpstreamError(IntegrationError):
    """An upstream call failed: ``status`` is what the client gets (the upstream's own 4xx for
    a request it refused, else 502), the message one line naming the server."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def one_line(text: str, limit: int = 200) -> str:
    """``text`` on one line of at most ``limit`` characters (no traceback reaches a client)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def error_message(raw: bytes) -> str:
    """The message of an error answer: OpenAI's ``{"error": {"message"}}``, FastAPI's
    ``{"detail"}``, a ``{"message"}``, or the raw text; one line."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return one_line(raw.decode("utf-8", "replace"))
    if isinstance(data, dict):
        err = data.get("error")
        for value in (err.get("message") if isinstance(err, dict) else err,
                      data.get("message"), data.get("detail")):  # fmt: skip
            if value:
                return one_line(str(value))
    return one_line(raw.decode("utf-8", "replace"))


@dataclass(frozen=True, slots=True)
class Upstream:
    """A vLLM OpenAI server: ``name`` (``prefill``/``decode``, for messages), host and port,
    and the timeout of each connect, send and read on its sockets."""

    name: str
    host: str
    port: int
    timeout_s: float

    @classmethod
    def from_url(cls, name: str, url: str, timeout_s: float) -> Upstream:
        """``http://HOST:PORT`` as an upstream; ``ConfigError`` naming ``--name`` otherwise."""
        m = _URL_RE.match(url) if isinstance(url, str) else None
        if m is None or not 1 <= int(m.group(2)) <= 65535:
            raise ConfigError(f"--{name} must be http://HOST:PORT, got {url!r:.80}")
        return cls(name, m.group(1).strip("[]"), int(m.group(2)), timeout_s)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def fail(self, why: str, status: int = 502) -> UpstreamError:
        return UpstreamError(status, one_line(f"{self.name} server {self.url}: {why}"))

    def get(self, path: str, timeout_s: float) -> tuple[int, bytes]:
        """GET ``path``: (status, body up to :data:`MAX_ANSWER_BYTES`); ``UpstreamError`` when
        the server cannot be reached."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read(MAX_ANSWER_BYTES)
        except (OSError, http.client.HTTPException) as exc:
            raise self.fail(str(exc) or type(exc).__name__) from None
        finally:
            conn.close()


class Call:
    """One POST of a JSON ``body`` to ``upstream``: :meth:`send`, then :meth:`response` or
    :meth:`answer`; :meth:`cancel` may come from any thread at any time, and makes every
    later step raise ``UpstreamError``. Close it (or use ``with``)."""

    def __init__(
        self, upstream: Upstream, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> None:
        self.upstream = upstream
        self._path, self._body, self._headers = path, body, dict(headers)
        self._conn = http.client.HTTPConnection(
            upstream.host, upstream.port, timeout=upstream.timeout_s
        )
        self._lock = threading.Lock()
        self._cancelled = False

    def __enter__(self) -> Call:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self) -> None:
        """Connect and send the request (the response is read later)."""
        data = json.dumps(self._body).encode()
        headers = {**self._headers, "Content-Type": "application/json"}
        try:
            self._conn.connect()
            with self._lock:
                if self._cancelled:
                    raise self.upstream.fail("cancelled")
            self._conn.request("POST", self._path, data, headers)
        except (OSError, http.client.HTTPException) as exc:
            raise self._failure(exc) from None

    def response(self) -> http.client.HTTPResponse:
        """The response's status and headers (its body is read by the caller, in chunks)."""
        try:
            return self._conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise self._failure(exc) from None

    def answer(self) -> dict[str, Any]:
        """The whole JSON object of a 2xx answer; ``UpstreamError`` otherwise (the upstream's
        own status for a 4xx refusal, 502 for anything else)."""
        resp = self.response()
        raw = self.read(resp, MAX_ANSWER_BYTES + 1)
        if not 200 <= resp.status < 300:
            raise self.refusal(resp.status, raw)
        if len(raw) > MAX_ANSWER_BYTES:
            raise self.upstream.fail(f"answer over {MAX_ANSWER_BYTES} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict):
            raise self.upstream.fail("answer is not a JSON object")
        return data

    def read(self, resp: http.client.HTTPResponse, limit: int, *, some: bool = False) -> bytes:
        """Up to ``limit`` bytes of ``resp``'s body: all of it up to ``limit``, or (``some``)
        what has arrived, waiting for at least one byte; ``b""`` at its end."""
        try:
            return resp.read1(limit) if some else resp.read(limit)
        except (OSError, http.client.HTTPException) as exc:
            raise self._failure(exc) from None

    def refusal(self, status: int, raw: bytes) -> UpstreamError:
        """The error for a non-2xx answer ``status`` with body ``raw``."""
        return self.upstream.fail(
            f"HTTP {status}: {error_message(raw)}", status if 400 <= status < 500 else 502
        )

    def _failure(self, exc: BaseException) -> UpstreamError:
        if self._cancelled:
            return self.upstream.fail("cancelled")
        if isinstance(exc, TimeoutError | socket.timeout):
            return self.upstream.fail(f"no answer within {self.upstream.timeout_s:g} s")
        return self.upstream.fail(str(exc) or type(exc).__name__)

    def cancel(self) -> None:
        """Close the connection now (idempotent, any thread): a blocked read returns, and vLLM
        aborts the request when it sees the connection gone."""
        with self._lock:
            self._cancelled = True
            sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def close(self) -> None:
        self._conn.close()
