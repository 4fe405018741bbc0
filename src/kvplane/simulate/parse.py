"""The cluster TOML file as a :class:`~kvplane.simulate.spec.ClusterSpec`.

Checks the file's structure before anything runs: known sections and keys only, required keys
present, tables where tables belong; each value is then checked by its spec class. Every error
is one ``ConfigError`` line naming the section and key. Keys: docs/simulate.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvplane.config import load_toml
from kvplane.errors import ConfigError
from kvplane.simulate.geometry import model_geometry
from kvplane.simulate.spec import (
    TIER_ORDER,
    ClusterSpec,
    DecodeSpec,
    FailureSpec,
    PoissonSpec,
    PrefillSpec,
    TierSpec,
    TransportSpec,
)
from kvplane.validators import require_int

SECTIONS = ("model", "cluster", "prefill", "decode", "transport", "tiers", "failures", "poisson")

T = TypeVar("T")


def _table(doc: Mapping[str, Any], name: str, *, required: bool = True) -> dict[str, Any]:
    value = doc.get(name)
    if value is None and not required:
        return {}
    if value is None:
        raise ConfigError(f"the cluster file has no [{name}] section")
    if not isinstance(value, dict):
        raise ConfigError(f"[{name}] must be a table, got {type(value).__name__}")
    return value


def _build(cls: type[T], section: str, table: Mapping[str, Any], **fixed: Any) -> T:
    """``cls(**table, **fixed)`` after refusing unknown and missing keys of ``section``."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    known = [f.name for f in fields if f.name not in fixed]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"[{section}] has unknown key {unknown[0]!r} (known: {', '.join(known)})")
    for f in fields:
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and f.name not in table and f.name not in fixed:
            raise ConfigError(f"[{section}] {f.name} is missing")
    return cls(**table, **fixed)


def _tiers(doc: Mapping[str, Any]) -> tuple[TierSpec, ...]:
    table = _table(doc, "tiers", required=False)
    unknown = sorted(set(table) - set(TIER_ORDER))
    if unknown:
        raise ConfigError(f"[tiers.{unknown[0]}] is not a tier (tiers: {', '.join(TIER_ORDER)})")
    out = []
    for name in TIER_ORDER:
        if name in table:
            section = _table(table, name)
            fixed: dict[str, Any] = {"name": name}
            if "shared" not in section:
                fixed["shared"] = name == "remote"
            out.append(_build(TierSpec, f"tiers.{name}", section, **fixed))
    return tuple(out)


def _failures(doc: Mapping[str, Any]) -> tuple[FailureSpec, ...]:
    items = doc.get("failures", [])
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise ConfigError("failures must be an array of tables ([[failures]])")
    return tuple(_build(FailureSpec, "[failures]", item) for item in items)


def parse_cluster(doc: Mapping[str, Any], base: Path) -> ClusterSpec:
    """The spec of a parsed cluster document; ``base`` is the folder relative paths start from."""
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}] (sections: {', '.join(SECTIONS)})")
    cluster = _table(doc, "cluster")
    tp = require_int("[cluster] tp", cluster.get("tp", 1), min=1, error=ConfigError)
    settings = {k: v for k, v in cluster.items() if k != "tp"}
    return _build(
        ClusterSpec,
        "cluster",
        settings,
        geometry=model_geometry(_table(doc, "model"), tp, base),
        prefill=_build(PrefillSpec, "prefill", _table(doc, "prefill")),
        decode=_build(DecodeSpec, "decode", _table(doc, "decode")),
        transport=_build(TransportSpec, "transport", _table(doc, "transport")),
        tiers=_tiers(doc),
        failures=_failures(doc),
        poisson=_build(PoissonSpec, "poisson", _table(doc, "poisson", required=False)),
    )


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and check a cluster TOML file (``ConfigError`` for anything wrong in it)."""
    p = Path(path)
    return parse_cluster(load_toml(p), p.parent)
