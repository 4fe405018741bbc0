"""The demo's worker processes: start, announce, watch, stop; every wait has a deadline.

:class:`Child` is one ``kvplane serve`` subprocess; :class:`ProcessGroup` raises
:class:`WorkerDiedError` as soon as one exits, and stops them all, and hands its children the
group's secret in a 0600 file (:func:`new_secret`: one per group); :func:`seed_families` reads
a child's ``/metrics``. Nothing here listens on a socket. See docs/serving.md.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import IO, Any

from prometheus_client.parser import text_string_to_metric_families

from kvplane.config import SECRET_ENV
from kvplane.errors import TransferTimeoutError, WorkerDiedError
from kvplane.metrics import SEED_METRICS

ROLES = ("prefill", "decode", "router")
"""The demo's processes: the two workers start together, then the router (it needs their
addresses)."""
ANNOUNCE_POLL_S = 0.05
"""How often :meth:`ProcessGroup.start_together` looks at children still starting."""
SCRAPE_TIMEOUT_S = 30.0
"""How long a ``/metrics`` scrape may take (the router asks its workers for their stats)."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def seed_families(port: int) -> list[str]:
    """The seed metric families (:data:`~kvplane.metrics.SEED_METRICS`) that ``/metrics`` on
    ``127.0.0.1:port`` shows, sorted; ``OSError`` when nothing answers."""
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
        text = reply.read().decode()
    names = {family.name for family in text_string_to_metric_families(text)}
    return sorted(names & set(SEED_METRICS))


def new_secret() -> bytes:
    """A fresh random shared secret for one cluster (64 hex characters)."""
    return secrets.token_hex(32).encode()


def secret_file(log_dir: Path, secret: bytes) -> Path:
    """``secret`` in ``log_dir/secret``, readable by this user only (0600): what children get
    through ``--secret-file`` (an environment variable is readable in ``/proc/PID/environ``)."""
    path = log_dir / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(secret)
    return path


class Child:
    """One ``kvplane serve`` subprocess (see the module docstring); ``secret`` goes to it in a
    0600 file named by ``--secret-file`` (``None``: none, and ``args`` must say ``--insecure``)."""

    def __init__(
        self, role: str, args: list[str], log_dir: Path, secret: bytes | None = None
    ) -> None:
        self.role = role
        self.log_path = log_dir / f"{role}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop(SECRET_ENV, None)
        if secret is not None:
            args = [*args, "--secret-file", str(secret_file(log_dir, secret))]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvplane", "serve", role, *args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._reader = threading.Thread(
            target=_pump, args=(self.proc.stdout, self._lines), name=f"demo-{role}", daemon=True
        )
        self._reader.start()
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def died(self, doing: str) -> WorkerDiedError:
        code = self.proc.poll()
        tail = self.log_tail()
        more = f"; its log ends:\n{tail}" if tail else ""
        return WorkerDiedError(
            f"the {self.role} worker (pid {self.pid}) exited with code {code} {doing}{more}"
        )

    def announce(self, deadline: float) -> dict[str, Any]:
        """The worker's announce line, waiting until ``deadline`` (monotonic)."""
        while not self.announced(deadline, wait_s=0.1):
            pass
        return self.info

    def announced(self, deadline: float, wait_s: float = 0.0) -> bool:
        """Whether the announce line has come (then in :attr:`info`), reading what the child
        printed for up to ``wait_s``; :class:`WorkerDiedError` once the child has exited first,
        ``TransferTimeoutError`` past ``deadline`` (monotonic)."""
        while not self.info:
            try:
                line = self._lines.get(timeout=wait_s)
            except queue.Empty:
                if not self.alive():
                    raise self.died("while starting") from None
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(
                        f"the {self.role} worker did not start in time"
                    ) from None
                return False
            try:
                info = json.loads(line)
            except ValueError:
                continue  # not the announce line
            if isinstance(info, dict) and "control" in info:
                self.info = info
        return True

    def terminate(self) -> None:
        """Send SIGTERM (when still running), without waiting."""
        if self.alive():
            self.proc.terminate()

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Terminate (then kill after ``timeout_s``); the exit code."""
        if self.alive():
            self.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL now (chaos)."""
        self.proc.kill()
        self.proc.wait(timeout=10)


def _pump(stream: IO[str] | None, out: queue.SimpleQueue[str]) -> None:
    if stream is None:
        return
    for line in stream:
        out.put(line)


class ProcessGroup:
    """The children of one demo run, sharing ``secret`` (``None``: insecure children)."""

    def __init__(self, log_dir: Path, secret: bytes | None = None) -> None:
        self.log_dir = log_dir
        self.secret = secret
        self.children: dict[str, Child] = {}

    def start(self, role: str, args: list[str], deadline: float) -> dict[str, Any]:
        """Start the ``role`` child with ``args`` and wait for its announce (see
        :meth:`Child.announced`)."""
        return self.start_together({role: args}, deadline)[role]

    def start_together(
        self, args: dict[str, list[str]], deadline: float
    ) -> dict[str, dict[str, Any]]:
        """Start one child per role of ``args`` at once, then wait until every one has
        announced: their announces by role. The first child to exit (or ``deadline``) raises
        :meth:`Child.announced`'s error; the others keep running until :meth:`stop`."""
        started: list[Child] = []
        for role, flags in args.items():
            started.append(Child(role, flags, self.log_dir, self.secret))
            self.children[role] = started[-1]  # stopped by stop() whatever happens next
        waiting = list(started)
        while waiting:
            waiting = [c for c in waiting if not c.announced(deadline)]
            if waiting:
                time.sleep(ANNOUNCE_POLL_S)
        return {child.role: child.info for child in started}

    def check(self, doing: str = "") -> None:
        """Raise :class:`WorkerDiedError` if any child has exited."""
        for child in self.children.values():
            if not child.alive():
                raise child.died(doing)

    def stop(self) -> None:
        """Terminate every child at once, then wait for each (killing any that outlive its
        wait): their shutdowns overlap."""
        for child in self.children.values():
            child.terminate()
        for child in reversed(list(self.children.values())):
            child.stop()
