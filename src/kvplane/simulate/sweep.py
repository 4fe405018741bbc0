"""``--sweep KEY=V1,V2,...``: a cluster file's keys varied over a cross product of values.

Each point is the cluster TOML document with its overrides applied, parsed by
:func:`~kvplane.simulate.parse.parse_cluster` (one home for every key's check, so a bad key or
value is the same one-line ``ConfigError`` as in the file, prefixed with the ``--sweep`` part
that caused it). The best point minimises a goal (:data:`GOALS`); ties keep the earlier point.
"""

from __future__ import annotations

import copy
import itertools
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.errors import ConfigError
from kvplane.simulate.parse import parse_cluster
from kvplane.simulate.result import Percentiles, SimResult
from kvplane.simulate.spec import ClusterSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

_LATENCIES: dict[str, Callable[[SimResult], Percentiles]] = {
    "ttft": lambda r: r.ttft_s,
    "tpot": lambda r: r.tpot_s,
    "queue": lambda r: r.queue_s,
    "exposed_tail": lambda r: r.exposed_tail_s,
}


def _figure(get: Callable[[SimResult], Percentiles], stat: str) -> Callable[[SimResult], float]:
    return lambda r: float(getattr(get(r), stat))


GOALS: dict[str, Callable[[SimResult], float]] = {
    f"{name}_{stat}": _figure(get, stat)
    for name, get in _LATENCIES.items()
    for stat in ("p50", "p90", "p99", "mean", "max")
}
"""Goal name (``ttft_p90``, ``tpot_p50``, ``queue_mean``...) to the figure minimised, seconds."""

MAX_POINTS = 1000

Axis = tuple[str, tuple[Any, ...]]
Setting = tuple[tuple[str, Any], ...]


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One point of a sweep: its overrides ``(key, value)`` in axis order, and its result."""

    settings: Setting
    result: SimResult

    def to_dict(self) -> dict[str, Any]:
        """The point as plain JSON-ready data: ``{"settings": {key: value}, "result": {...}}``."""
        return {"settings": dict(self.settings), "result": self.result.to_dict()}


def _value(text: str) -> Any:
    """A TOML value (``4``, ``2.5e9``, ``true``, ``"x"``); a bare word is a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_sweep(texts: Sequence[str]) -> tuple[Axis, ...]:
    """``["KEY=V1,V2", ...]`` as axes ``(KEY, (v1, v2))``, values read as TOML; ``ConfigError``
    for a malformed or repeated part, or a cross product over :data:`MAX_POINTS` points."""
    axes: list[Axis] = []
    for text in texts:
        name, sep, values = text.partition("=")
        key = name.strip()
        parts = [v.strip() for v in values.split(",")]
        if not sep or not key or any(not p for p in key.split(".")) or not all(parts):
            raise ConfigError(f"--sweep must be KEY=V1,V2,... (e.g. cluster.tp=1,2), got {text!r}")
        if any(key == k for k, _ in axes):
            raise ConfigError(f"--sweep {key} is given twice")
        axes.append((key, tuple(_value(p) for p in parts)))
    points = math.prod(len(v) for _, v in axes)
    if points > MAX_POINTS:
        raise ConfigError(f"--sweep makes {points} points, more than {MAX_POINTS}")
    return tuple(axes)


def override(doc: Mapping[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``doc`` with the dotted ``key`` (``tiers.host.capacity_bytes``) set to
    ``value``; missing tables on the way are created, a non-table on the way is a
    ``ConfigError``."""
    out = copy.deepcopy(dict(doc))
    node: dict[str, Any] = out
    *path, last = key.split(".")
    for i, part in enumerate(path):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(path[: i + 1])
            raise ConfigError(f"--sweep {key}: {where} is not a table in the cluster file")
        node = child
    node[last] = value
    return out


def sweep_specs(
    doc: Mapping[str, Any], base: Path, axes: Sequence[Axis]
) -> list[tuple[Setting, ClusterSpec]]:
    """Every point of the cross product of ``axes`` (the last axis varying fastest) with its
    parsed spec; all are checked before any runs."""
    out = []
    for values in itertools.product(*(v for _, v in axes)):
        setting = tuple((k, v) for (k, _), v in zip(axes, values, strict=True))
        point: Mapping[str, Any] = doc
        for key, value in setting:
            point = override(point, key, value)
        try:
            spec = parse_cluster(point, base)
        except ConfigError as exc:
            where = ", ".join(f"{k}={v!r}" for k, v in setting)
            raise ConfigError(f"--sweep {where}: {exc}") from None
        out.append((setting, spec))
    return out


def goal_of(name: str) -> Callable[[SimResult], float]:
    """The figure goal ``name`` minimises; ``ConfigError`` listing the goals otherwise."""
    if name not in GOALS:
        raise ConfigError(f"--goal must be one of {', '.join(GOALS)}, got {name!r}")
    return GOALS[name]


def best_point(points: Sequence[SweepPoint], goal: str) -> SweepPoint:
    """The point of least ``goal`` figure (the first of equal ones)."""
    if not points:
        raise ConfigError("a sweep needs at least one point")
    figure = goal_of(goal)
    return min(points, key=lambda p: figure(p.result))
