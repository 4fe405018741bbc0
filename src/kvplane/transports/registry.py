"""The transport registry: names to classes (imported lazily), construction, availability.

``TRANSPORTS`` maps each name to its implementation class; a class is imported only when first
looked up, so ``import kvplane`` never imports an optional engine. ``available()`` says, per
name, whether the transport can be constructed here (``None``) or why not, with the install hint
(an optional engine that is missing is reported, never raised as ImportError).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from kvplane.errors import ConfigError, UnsupportedError
from kvplane.transports.base import Transport

_PATHS: dict[str, tuple[str, str]] = {
    "local": ("kvplane.transports.local", "LocalTransport"),
    "shm": ("kvplane.transports.shm", "ShmTransport"),
    "tcp": ("kvplane.transports.tcp", "TcpTransport"),
    "nixl": ("kvplane.transports.nixl", "NixlTransport"),
    "mooncake": ("kvplane.transports.mooncake", "MooncakeTransport"),
}
CROSS_PROCESS: frozenset[str] = frozenset({"shm", "tcp", "nixl", "mooncake"})
"""Transports that connect different processes (``local`` stays inside one)."""


class _LazyClasses(Mapping[str, type]):
    """Read-only name -> class mapping that imports a module on first lookup."""

    def __getitem__(self, name: str) -> type:
        if name not in _PATHS:
            raise KeyError(name)
        module, cls = _PATHS[name]
        found: type = getattr(importlib.import_module(module), cls)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(_PATHS)

    def __len__(self) -> int:
        return len(_PATHS)


TRANSPORTS: Mapping[str, type] = _LazyClasses()


def create_transport(name: str, **options: Any) -> Transport:
    """Construct transport ``name``; ``ConfigError`` for an unknown name or option,
    ``UnsupportedError`` (with the install hint) when its engine is missing."""
    if name not in _PATHS:
        raise ConfigError(f"unknown transport {name!r}; known: {', '.join(_PATHS)}")
    reason = available().get(name)
    if reason is not None:
        raise UnsupportedError(f"transport {name!r} is unavailable: {reason}")
    try:
        transport: Transport = TRANSPORTS[name](**options)
    except TypeError as exc:
        raise ConfigError(f"bad options for transport {name!r}: {exc}") from None
    return transport


def import_engine(module: str, hint: str) -> ModuleType:
    """An optional engine's ``module``, imported; ``UnsupportedError`` with ``hint`` and the
    cause when it cannot be (not installed, or its native library is broken)."""
    try:
        return importlib.import_module(module)
    except Exception as exc:
        raise UnsupportedError(f"{hint} ({type(exc).__name__}: {exc})") from None


def engine_missing(module: str, hint: str) -> str | None:
    """None if :func:`import_engine` of ``module`` succeeds here, else its error's text."""
    try:
        import_engine(module, hint)
    except UnsupportedError as exc:
        return str(exc)
    return None


def available() -> dict[str, str | None]:
    """Per transport: ``None`` if usable here, else the reason and how to get it."""
    out: dict[str, str | None] = {"local": None, "tcp": None}
    out["shm"] = None if sys.platform.startswith("linux") else "shm needs Linux (memfd, SCM_RIGHTS)"
    for name in ("nixl", "mooncake"):
        probe = importlib.import_module(_PATHS[name][0]).probe
        out[name] = probe()
    return out
