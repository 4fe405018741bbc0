"""What every model config shares: the :class:`Family` enum and typed fields of an HF
``config.json`` dict (each reader returns the validated value or raises
:class:`~kvplane.errors.CheckpointError` naming the key)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from kvplane.errors import CheckpointError
from kvplane.validators import require_bool, require_int, require_number

_MISSING = object()


class Family(enum.Enum):
    """Which model class serves a config (the loader's registry key)."""

    LLAMA = "llama"
    DEEPSEEK = "deepseek"
    BAMBA = "bamba"


def int_field(d: Mapping[str, Any], key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    value = d.get(key, default)
    if value is None and default is not _MISSING:
        value = default  # JSON null means "unset"
    if value is _MISSING or value is None:
        raise CheckpointError(f"config.json has no {key!r}")
    return require_int(f"config.json {key!r}", value, min=minimum, error=CheckpointError)


def opt_int_field(d: Mapping[str, Any], key: str) -> int | None:
    return None if d.get(key) is None else int_field(d, key)


def float_field(d: Mapping[str, Any], key: str, default: float) -> float:
    """``d[key]`` (or ``default``) as a finite float >= 0; ``CheckpointError`` otherwise."""
    value = d.get(key, default)
    return require_number(f"config.json {key!r}", value, min=0, error=CheckpointError)


def bool_field(d: Mapping[str, Any], key: str, default: bool) -> bool:
    value = d.get(key, default)
    if value is None:
        return default
    return require_bool(f"config.json {key!r}", value, error=CheckpointError)


def require_silu(d: Mapping[str, Any]) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"config.json hidden_act {act!r} is not supported (only 'silu')")
