"""Frozen, validated per-component configuration and the one way to resolve it.

Owns the L0 config dataclasses (:class:`PoolConfig`, :class:`HashConfig`, :class:`ChunkConfig`),
TOML loading, and :func:`resolve`: flag > ``KVPLANE_<SECTION>_<FIELD>`` env > TOML file >
default, from explicit sources only (it never reads ``os.environ`` itself). Scalar checks live
in :mod:`kvplane.validators`; how values resolve is told in ``docs/serving.md``
("Configuration"). Must not import anything above L0.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvplane.errors import ConfigError
from kvplane.validators import is_int, require_int

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "KVPLANE_"
"""Environment variables are named ``KVPLANE_<SECTION>_<FIELD>`` in upper case."""

C = TypeVar("C")


class Source(enum.Enum):
    """Where a resolved value came from (for ``kvplane config show``-style diagnostics)."""

    DEFAULT = "default"
    FILE = "file"
    ENV = "env"
    FLAG = "flag"


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """A paged KV pool: ``num_blocks`` blocks of ``block_size`` tokens each."""

    num_blocks: int = 1024
    block_size: int = 16

    def __post_init__(self) -> None:
        require_int("PoolConfig.num_blocks", self.num_blocks, min=1, error=ConfigError)
        require_int("PoolConfig.block_size", self.block_size, min=1, error=ConfigError)


@dataclass(frozen=True, slots=True)
class HashConfig:
    """Block hashing: the seed that roots every hash chain (stable across processes)."""

    seed: int = 0

    def __post_init__(self) -> None:
        require_int("HashConfig.seed", self.seed, min=0, error=ConfigError)


@dataclass(frozen=True, slots=True)
class ChunkConfig:
    """Chunking: how many consecutive full blocks make one transfer/storage chunk."""

    blocks_per_chunk: int = 4

    def __post_init__(self) -> None:
        require_int("ChunkConfig.blocks_per_chunk", self.blocks_per_chunk, min=1, error=ConfigError)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML config file. ``ConfigError`` when it is missing, not a regular file,
    unreadable, not UTF-8 or not valid TOML."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {str(p)!r} does not exist") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"config file {str(p)!r} is a directory") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text: {exc.reason}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror}") from exc


def env_name(section: str, field: str) -> str:
    """The environment variable that sets ``field`` of ``section``."""
    return f"{ENV_PREFIX}{section}_{field}".upper()


def _field_type(cls: type[Any], name: str) -> Any:
    hints = typing.get_type_hints(cls)
    tp = hints[name]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_str_list(tp: Any) -> bool:
    return typing.get_origin(tp) is list and typing.get_args(tp) == (str,)


def _parse_str(raw: str, tp: Any, where: str) -> Any:
    """Convert an environment/flag string to ``tp`` (a ``list[str]`` from comma-separated
    items); raise ``ConfigError`` naming ``where``."""
    if _is_str_list(tp):
        return [item.strip() for item in raw.split(",") if item.strip()]
    try:
        if tp is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {raw!r}")
        if tp is int:
            return int(raw, 0)
        if tp is float:
            return float(raw)
        if tp is str:
            return raw
        if tp is Path:
            if not raw.strip():  # Path("") is the working directory: never what was meant
                raise ValueError("an empty path")
            return Path(raw)
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            for member in tp:
                if raw in (member.value, member.name, member.name.lower()):
                    return member
            choices = ", ".join(str(m.value) for m in tp)
            raise ValueError(f"{raw!r} is not one of {choices}")
    except ValueError as exc:
        tname = getattr(tp, "__name__", tp)
        raise ConfigError(f"{where}: cannot read {raw!r} as {tname}: {exc}") from exc
    raise ConfigError(f"{where}: fields of type {tp!r} cannot be set from a string")


def _check_type(value: Any, tp: Any, where: str) -> Any:
    """Values from TOML or typed flags must already have the field's type (ints widen to float)."""
    if _is_str_list(tp):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{where}: expected a list of strings, got {value!r}")
        return list(value)
    if isinstance(value, str) and tp is not str:
        return _parse_str(value, tp, where)
    if tp is float and is_int(value):
        return float(value)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def resolve(
    cls: type[C],
    section: str,
    *,
    file: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> tuple[C, dict[str, Source]]:
    """Build ``cls`` from flags > env > file[section] > defaults.

    ``flags`` holds only the flags the user actually gave (``None`` values are ignored); an
    environment variable whose value is ``""`` is ignored the same way. Returns the validated
    instance and, per field, the source its value came from.
    Raises ``ConfigError`` for unknown keys, unreadable values or values the dataclass rejects.
    """
    if not dataclasses.is_dataclass(cls):
        raise ConfigError(f"{cls!r} is not a config dataclass")
    names = [f.name for f in dataclasses.fields(cls)]
    raw_section = (file or {}).get(section, {})
    if not isinstance(raw_section, Mapping):
        raise ConfigError(f"config section [{section}] must be a table, got {raw_section!r}")
    file_section = dict(raw_section)
    unknown = sorted(set(file_section) - set(names))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in config section [{section}]; known: {names}")
    given_flags = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown_flags = sorted(set(given_flags) - set(names))
    if unknown_flags:
        raise ConfigError(f"unknown flag(s) {unknown_flags} for [{section}]; known: {names}")
    environ = env or {}
    kwargs: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for name in names:
        tp = _field_type(cls, name)
        var = env_name(section, name)
        if name in given_flags:
            kwargs[name] = _check_type(given_flags[name], tp, f"flag --{name}")
            sources[name] = Source.FLAG
        elif environ.get(var, "") != "":
            kwargs[name] = _parse_str(environ[var], tp, f"environment {var}")
            sources[name] = Source.ENV
        elif name in file_section:
            kwargs[name] = _check_type(file_section[name], tp, f"[{section}].{name}")
            sources[name] = Source.FILE
        else:
            sources[name] = Source.DEFAULT
    try:
        return cls(**kwargs), sources
    except TypeError as exc:  # pragma: no cover - guarded by the unknown-key checks above
        raise ConfigError(f"[{section}]: {exc}") from exc


SECRET_ENV = "KVPLANE_SECRET"
MIN_SECRET_BYTES = 16
"""A shorter secret is refused: it could be guessed (``openssl rand -hex 32`` gives 64)."""


def read_secret(
    secret_file: str | None, env: Mapping[str, str], *, flag: str = "--secret-file"
) -> bytes | None:
    """The shared secret: the contents of ``secret_file`` (trailing whitespace stripped) when
    given (``flag`` names it in errors), else ``env[KVPLANE_SECRET]``, else ``None``.
    ``ConfigError`` for an unreadable or empty file, or a secret shorter than
    :data:`MIN_SECRET_BYTES`."""
    if secret_file is not None:
        try:
            secret = Path(secret_file).read_bytes().rstrip()
        except OSError as exc:
            raise ConfigError(f"{flag} {secret_file!r} cannot be read: {exc.strerror}") from None
        where = f"{flag} {secret_file!r}"
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


def secret_or_insecure(
    secret_file: str | None,
    env: Mapping[str, str],
    *,
    prefix: str,
    insecure: bool,
    needs: str,
    so_that: str,
    otherwise: str,
) -> bytes | None:
    """The secret of a vLLM extra-config section named ``prefix`` (``<prefix>_secret_file``,
    else ``KVPLANE_SECRET``), or None when ``<prefix>_insecure`` asked for none: secure by
    default. ``ConfigError`` for both; for neither, ``"<needs> a secret (...) so that <so_that>;
    set <prefix>_insecure=true <otherwise>"``; and as :func:`read_secret`."""
    secret = read_secret(secret_file or None, env, flag=f"{prefix}_secret_file")
    if secret is not None and insecure:
        raise ConfigError(f"{prefix}_insecure with a secret: choose one")
    if secret is None and not insecure:
        raise ConfigError(
            f"{needs} a secret ({prefix}_secret_file or {SECRET_ENV}, >= {MIN_SECRET_BYTES} "
            f"bytes) so that {so_that}; set {prefix}_insecure=true {otherwise}"
        )
    return secret
