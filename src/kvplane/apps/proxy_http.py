"""The PD proxy's HTTP front: routes, bounds and one-line errors over stdlib ``http.server``.

Owns the listening socket and its threads (at most ``2 * max_concurrent + 8`` connections), the
checks before any upstream call (404 route, 411 ``Content-Length``, 413 body cap, 503 over
``max_concurrent`` requests, 400 bad body), relaying an upstream answer (a stream chunk by chunk
as it comes) and turning every failure into a one-line JSON error, never a traceback. What a
request does upstream belongs to the :class:`Service` (:class:`~kvplane.apps.proxy.PDProxy`).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.client import HTTPResponse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kvplane.apps.proxy_requests import ClientRequest, parse_request
from kvplane.apps.proxy_upstream import MAX_ANSWER_BYTES, Call, UpstreamError, one_line
from kvplane.errors import InvalidArgumentError

log = logging.getLogger(__name__)
ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}
"""The POST paths served, and whether each is a chat request."""
_CHUNK = 64 << 10


def error_body(status: int, message: str) -> dict[str, Any]:
    """The JSON of an error answer: OpenAI's shape, the message on one line."""
    return {"error": {"message": one_line(message), "code": status}}


@dataclass(frozen=True, slots=True)
class Limits:
    """The front's bounds: requests in flight, request body bytes, client socket timeout."""

    max_concurrent: int
    max_body_bytes: int
    client_timeout_s: float


class Service(Protocol):
    """What the front asks of the proxy behind it."""

    def serve(self, h: Handler, path: str, req: ClientRequest) -> None:
        """Run ``req`` upstream and answer it through ``h`` (:meth:`Handler.relay`)."""

    def health(self) -> tuple[int, dict[str, Any]]:
        """The ``/health`` answer."""

    def models(self) -> tuple[int, bytes]:
        """The ``/v1/models`` answer (JSON bytes)."""


class Front(ThreadingHTTPServer):
    """The listening socket: a thread per connection, at most ``2 * max_concurrent + 8`` (room
    for 503 answers and health checks); a connection past that is closed at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: Service, limits: Limits) -> None:
        super().__init__(address, Handler)
        self.service, self.limits = service, limits
        self.slots = threading.BoundedSemaphore(limits.max_concurrent)
        self._connections = threading.BoundedSemaphore(2 * limits.max_concurrent + 8)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._connections.acquire(blocking=False):
            log.warning("kvplane proxy: too many connections; closed one from %s", client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("kvplane proxy: a connection from %s failed", client_address)


class Handler(BaseHTTPRequestHandler):
    """One client connection (HTTP/1.0: one request, then closed)."""

    server: Front
    server_version = "kvplane-proxy"
    committed = False
    """Whether the answer began (a failure after that can only cut the connection)."""

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.limits.client_timeout_s)
        # headers and body (or SSE chunks) are separate writes: no Nagle delay between them
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("kvplane proxy: " + format, *args)

    def reply(self, status: int, obj: dict[str, Any]) -> None:
        self.send_bytes(status, json.dumps(obj).encode())

    def send_bytes(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def relay(
        self, call: Call, stream: bool, resp: HTTPResponse, commit: Callable[[], None]
    ) -> None:
        """Relay ``call``'s answer ``resp``: a non-2xx one as a one-line error, a stream chunk
        by chunk as it comes, anything else whole. Nothing reaches the client before the
        first bytes of the body arrived and ``commit`` returned (it raises to fail instead)."""
        if not 200 <= resp.status < 300:
            raise call.refusal(resp.status, call.read(resp, _CHUNK))
        first = call.read(resp, _CHUNK if stream else MAX_ANSWER_BYTES + 1, some=stream)
        if len(first) > MAX_ANSWER_BYTES:
            raise call.upstream.fail(f"answer over {MAX_ANSWER_BYTES} bytes")
        commit()
        self.committed = True
        self.send_response(resp.status)
        self.send_header("Content-Type", resp.getheader("Content-Type", "application/json"))
        if stream:
            self.send_header("Cache-Control", "no-cache")
        else:
            self.send_header("Content-Length", str(len(first)))
        self.end_headers()
        self.wfile.write(first)
        while stream and (chunk := call.read(resp, _CHUNK, some=True)):
            self.wfile.write(chunk)

    def do_GET(self) -> None:
        service = self.server.service
        try:
            if self.path == "/health":
                self.reply(*service.health())
            elif self.path == "/v1/models":
                self.send_bytes(*service.models())
            else:
                self.reply(404, error_body(404, f"no route GET {self.path[:80]}"))
        except UpstreamError as exc:
            self.reply(exc.status, error_body(exc.status, str(exc)))

    def do_POST(self) -> None:
        chat, limits = ROUTES.get(self.path), self.server.limits
        length = self.headers.get("Content-Length")
        if chat is None:
            self.reply(404, error_body(404, f"no route POST {self.path[:80]}"))
        elif length is None or not length.isdigit():
            self.reply(411, error_body(411, "a Content-Length is required"))
        elif int(length) > limits.max_body_bytes:
            self.close_connection = True  # the body is not read
            self.reply(413, error_body(413, f"the body is over {limits.max_body_bytes} bytes"))
        elif not self.server.slots.acquire(blocking=False):
            self.close_connection = True
            self.reply(503, error_body(503, f"busy: {limits.max_concurrent} requests in flight"))
        else:
            try:
                self._post(chat, int(length))
            finally:
                self.server.slots.release()

    def _post(self, chat: bool, length: int) -> None:
        self.committed = False
        try:
            raw = self.rfile.read(length)
            self.server.service.serve(self, self.path, parse_request(raw, chat=chat))
        except InvalidArgumentError as exc:
            self._fail(400, exc)
        except UpstreamError as exc:
            self._fail(exc.status, exc)
        except OSError as exc:  # the client went away: nothing to tell it
            log.info("kvplane proxy: client %s: %s", self.client_address, exc)
            self.close_connection = True
        except Exception as exc:  # never a traceback to the client; one in our log
            log.exception("kvplane proxy: request failed")
            self._fail(500, exc, "internal error in the proxy (see its log)")

    def _fail(self, status: int, exc: Exception, message: str | None = None) -> None:
        """Answer ``status`` with one line, or (once the answer began) cut the connection."""
        if self.committed:
            log.warning("kvplane proxy: answer cut short: %s", one_line(str(exc)))
            self.close_connection = True
        else:
            self.reply(status, error_body(status, message or str(exc)))
