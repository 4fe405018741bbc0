"""What ``kvplane serve`` checks before anything starts: the secret, the addresses, the memory.

:func:`scrub_secret_env` removes ``KVPLANE_SECRET`` once read (``config.read_secret``) so no
child inherits it;
:mod:`~kvplane.serving.ports` probes each requested socket (a busy or foreign address is a
one-line ``ConfigError`` instead of a traceback after half the process started);
:func:`check_pool_memory` refuses a pool larger than the memory this process may use
(the host's, or its cgroup's limit when lower) before it is allocated. Holds no socket past a
call.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from kvplane.config import SECRET_ENV
from kvplane.errors import ConfigError
from kvplane.serving.worker_config import split_address


def scrub_secret_env(env: MutableMapping[str, str]) -> bool:
    """Remove ``KVPLANE_SECRET`` from ``env`` (``os.environ``: no child process inherits it),
    first overwriting its value in this process's C environment with zero bytes, since
    ``/proc/<pid>/environ`` shows the environment the process started with and unsetting does
    not change that copy (Linux; elsewhere only removed). Whether it was there."""
    if SECRET_ENV not in env:
        return False
    if env is os.environ and sys.platform == "linux":
        _zero_c_env(SECRET_ENV)
    del env[SECRET_ENV]
    return True


def _zero_c_env(name: str) -> None:
    """Overwrite the value of every ``name=...`` entry of the C ``environ`` with zero bytes."""
    prefix = name.encode() + b"="
    try:
        entries = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
    except (OSError, ValueError):  # no C environment to reach: os.environ's removal stands
        return
    i = 0
    while (addr := entries[i]) is not None:
        entry = ctypes.string_at(addr)
        if entry.startswith(prefix):
            ctypes.memset(addr + len(prefix), 0, len(entry) - len(prefix))
        i += 1


def check_connect_address(what: str, address: str) -> None:
    """``address`` is one a client can connect to: ``tcp://HOST:PORT`` with a port in
    [1, 65535] (or ``ipc://``/``inproc://``); ``ConfigError`` naming ``what`` otherwise."""
    hostport = split_address(what, address)
    if hostport is not None and (hostport[1] == 0 or hostport[0] == "*"):
        raise ConfigError(f"{what} must name a host and a port in [1, 65535], got {address!r}")


CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup file systems are mounted (v2 unified here; v1's memory controller under
``memory/``)."""
PROC_CGROUP = Path("/proc/self/cgroup")
"""This process's cgroup paths (``0::/PATH`` for v2, ``N:memory:/PATH`` for v1)."""


def host_memory_bytes() -> int:
    """This host's physical memory (bytes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _own_paths(proc_cgroup: Path) -> tuple[str, str]:
    """This process's (v2, v1 memory) cgroup paths, relative ("" when not listed)."""
    v2 = v1 = ""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return v2, v1
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":
            v2 = path.strip("/")
        elif "memory" in controllers.split(","):
            v1 = path.strip("/")
    return v2, v1


def _limit(path: Path) -> int | None:
    """The byte limit in cgroup file ``path``; None when absent, unlimited or unreadable."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_memory_limit(
    cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
) -> int | None:
    """The lowest memory limit (bytes) of this process's cgroup and its ancestors, v2
    (``memory.max``) or v1 (``memory/.../memory.limit_in_bytes``), as mounted under
    ``cgroup_root``; None when there is none (no cgroup file system, or ``max``). A path that
    is not mounted (a container shows its own group as the root) is skipped."""
    v2, v1 = _own_paths(proc_cgroup)
    found: list[int] = []
    for base, own, name in (
        (cgroup_root, v2, "memory.max"),
        (cgroup_root / "memory", v1, "memory.limit_in_bytes"),
    ):
        parts = [p for p in own.split("/") if p]
        for depth in range(len(parts), -1, -1):
            limit = _limit(base.joinpath(*parts[:depth], name))
            if limit is not None:
                found.append(limit)
    return min(found) if found else None


def usable_memory_bytes(
    cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
) -> tuple[int, str]:
    """The memory this process may use (bytes): the host's, or its cgroup's limit when lower
    (:func:`cgroup_memory_limit`); and whose (``"this host's"`` or ``"its cgroup's limit"``)."""
    host = host_memory_bytes()
    limit = cgroup_memory_limit(cgroup_root, proc_cgroup)
    if limit is not None and limit < host:
        return limit, "its cgroup's limit"
    return host, "this host's"


def check_pool_memory(
    what: str, pool_bytes: int, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP
) -> None:
    """Refuse a pool that could never fit in the memory this process may use
    (:func:`usable_memory_bytes`), before allocating it: with overcommit a huge allocation
    succeeds and the first touch kills the process (or the cgroup's OOM killer does)."""
    have, whose = usable_memory_bytes(cgroup_root, proc_cgroup)
    if pool_bytes > have:
        raise ConfigError(
            f"{what} needs a KV pool of {pool_bytes} bytes, more than the {have} bytes of "
            f"memory this process may use ({whose})"
        )
