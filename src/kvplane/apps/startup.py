"""What ``kvplane serve`` checks before anything starts: the secret, the addresses, the memory.

:func:`read_secret` takes the shared secret from ``--secret-file`` or ``KVPLANE_SECRET`` (never
the command line); :func:`probe_bind` and :func:`probe_port` bind and release each requested
socket, so a busy or foreign address is a one-line ``ConfigError`` instead of a traceback after
half the process started; :func:`check_pool_memory` refuses a pool larger than this host's
memory before it is allocated. Holds no socket past a call.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path

from kvplane.errors import ConfigError
from kvplane.serving.worker_config import check_port, split_address

SECRET_ENV = "KVPLANE_SECRET"
MIN_SECRET_BYTES = 16
"""A shorter secret is refused: it could be guessed (``openssl rand -hex 32`` gives 64)."""


def read_secret(secret_file: str | None, env: Mapping[str, str]) -> bytes | None:
    """The shared secret: the contents of ``secret_file`` (trailing whitespace stripped) when
    given, else ``env[KVPLANE_SECRET]``, else ``None``. ``ConfigError`` for an unreadable or
    empty file, or a secret shorter than :data:`MIN_SECRET_BYTES`."""
    if secret_file is not None:
        try:
            secret = Path(secret_file).read_bytes().rstrip()
        except OSError as exc:
            raise ConfigError(
                f"--secret-file {secret_file!r} cannot be read: {exc.strerror}"
            ) from None
        where = f"--secret-file {secret_file!r}"
    else:
        text = env.get(SECRET_ENV, "")
        if not text:
            return None
        secret, where = text.encode(), SECRET_ENV
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{where} must hold a secret of at least {MIN_SECRET_BYTES} bytes, got {len(secret)}"
        )
    return secret


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


def check_connect_address(what: str, address: str) -> None:
    """``address`` is one a client can connect to: ``tcp://HOST:PORT`` with a port in
    [1, 65535] (or ``ipc://``/``inproc://``); ``ConfigError`` naming ``what`` otherwise."""
    hostport = split_address(what, address)
    if hostport is not None and (hostport[1] == 0 or hostport[0] == "*"):
        raise ConfigError(f"{what} must name a host and a port in [1, 65535], got {address!r}")


def host_memory_bytes() -> int:
    """This host's physical memory (bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_pool_memory(what: str, pool_bytes: int) -> None:
    """Refuse a pool that could never fit in this host's memory (before allocating it: with
    overcommit a huge allocation succeeds and the first touch kills the process)."""
    have = host_memory_bytes()
    if pool_bytes > have:
        raise ConfigError(
            f"{what} needs a KV pool of {pool_bytes} bytes, more than this host's {have} bytes "
            "of memory"
        )
