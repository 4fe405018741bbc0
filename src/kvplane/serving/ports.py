"""Probing a listen address before anything binds it: bind and release, so a busy, foreign or
malformed address is a one-line ``ConfigError`` naming its flag or key before a process
half-starts. Used by ``kvplane serve``, the proxy and the vLLM connector's KV event sockets.
Holds no socket past a call; the address rules themselves are
:mod:`~kvplane.serving.worker_config`'s.
"""

from __future__ import annotations

import socket

from kvplane.errors import ConfigError
from kvplane.serving.worker_config import check_port, split_address


def _bind(what: str, shown: str, host: str, port: int) -> None:
    host = "0.0.0.0" if host == "*" else host
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"{what} {shown}: cannot resolve host {host!r} ({exc})") from None
    family, kind, proto, _name, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq and http.server
        try:
            sock.bind(addr)
        except OSError as exc:
            raise ConfigError(f"{what} {shown} cannot be bound here: {exc.strerror}") from None


def probe_bind(what: str, address: str) -> None:
    """Bind and release the ``tcp://HOST:PORT`` address a socket is about to listen on (any
    other scheme passes); ``ConfigError`` naming ``what`` when it is malformed, out of range,
    not this host's, or busy."""
    hostport = split_address(what, address)
    if hostport is not None:
        _bind(what, address, *hostport)


def probe_port(what: str, port: int, host: str = "127.0.0.1") -> None:
    """Bind and release ``host:port`` (``port`` 0: nothing to check, the listener is off)."""
    if check_port(what, port):
        _bind(what, str(port), host, port)
