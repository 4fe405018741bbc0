"""A private ``redis-server`` on 127.0.0.1 for benches and tests of the remote tier.

:class:`LocalRedisServer` starts the Debian ``redis-server`` binary on a free loopback port with
persistence off, waits until it answers ``PING`` and stops it (SIGTERM, then SIGKILL) on
:meth:`LocalRedisServer.stop` or when its ``with`` block ends. It never binds beyond
127.0.0.1. :func:`redis_server_support` says why one cannot be started here (no binary, no
client), so callers can skip or report "unsupported" instead of failing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from types import TracebackType

from kvplane.errors import OffloadError, UnsupportedError
from kvplane.offload.tiers.remote import redis_support


def redis_server_support() -> str | None:
    """``None`` when a private redis-server can be started, else the reason it cannot."""
    if shutil.which("redis-server") is None:
        return "no redis-server binary on PATH (Debian: apt-get install redis-server)"
    return redis_support()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedisServer:
    """A ``redis-server`` child process on ``127.0.0.1:port`` (``port`` 0 picks a free one)."""

    def __init__(self, port: int = 0, *, maxmemory_mb: int = 0, start_timeout_s: float = 10.0):
        reason = redis_server_support()
        if reason is not None:
            raise UnsupportedError(reason)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [
            "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--protected-mode", "yes",
            "--proto-max-bulk-len", "1gb",
        ]  # fmt: skip
        if maxmemory_mb:
            args += ["--maxmemory", f"{maxmemory_mb}mb"]
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + start_timeout_s
        while not self._answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise OffloadError(f"redis-server on port {self.port} did not start")
            time.sleep(0.02)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests) and reap it."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def stop(self) -> None:
        """Terminate the server and reap it; idempotent."""
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def __enter__(self) -> LocalRedisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
