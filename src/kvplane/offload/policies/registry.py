"""The eviction policy registry: a name (from config) to a policy constructor."""

from __future__ import annotations

from collections.abc import Callable

from kvplane.errors import ConfigError
from kvplane.offload.policies.arc import ARCPolicy
from kvplane.offload.policies.base import EvictionPolicy
from kvplane.offload.policies.lru import LRUPolicy

POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "arc": ARCPolicy,
}
"""Policy name -> constructor taking the tier's slot count."""


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A fresh policy ``name`` for a tier of ``capacity`` slots (``ConfigError`` if unknown)."""
    try:
        factory = POLICIES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
    return factory(capacity)
