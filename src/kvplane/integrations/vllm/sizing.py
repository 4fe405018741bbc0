"""Tier sizes in bytes: the extra-config keys that give them, and the slots derived from them.

Owns :class:`TierBytes` (the byte budget of each tier a user gave, 0 where the tier is sized
in slots), :func:`tier_bytes` (``host_gib`` / ``disk_gib`` / ``remote_gib`` and vLLM's own
``cpu_bytes_to_use`` / ``cpu_bytes_to_use_per_rank`` read from the extra config; a tier sized
twice is a one-line ``ConfigError``) and :func:`slots_for` (bytes -> chunk slots once a
chunk's size is known). Plain data: no vLLM, no tiers opened. Keys: ``docs/vllm.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.errors import ConfigError
from kvplane.offload.tiers.host import ALIGN, round_up
from kvplane.validators import finite_number

GIB = 1 << 30
TIERS = ("host", "disk", "remote")
GIB_KEYS = {f"{tier}_gib": tier for tier in TIERS}
"""``<tier>_gib``: that tier's size in GiB (binary, 2**30 bytes; a float is fine)."""
VLLM_BYTE_KEYS = {"cpu_bytes_to_use": "host", "cpu_bytes_to_use_per_rank": "host"}
"""vLLM's own offload keys (``OffloadingConnector``, ``SimpleCPUOffloadConnector``): the host
tier's bytes, engine-wide (split over the tensor-parallel ranks) and per rank."""
PER_RANK_KEYS = {"cpu_bytes_to_use_per_rank"}
"""Size keys that give one rank's budget; every other size key gives the engine's, all ranks
together (as vLLM's ``cpu_bytes_to_use``)."""
SIZE_KEYS = {**GIB_KEYS, **VLLM_BYTE_KEYS}


@dataclass(frozen=True, slots=True)
class TierBytes:
    """Byte budget per tier; 0: the tier is sized by its ``<tier>_slots`` key instead.

    Budgets are the engine's (every tensor-parallel rank's tiers together), except the host's
    when ``host_per_rank`` (vLLM's ``cpu_bytes_to_use_per_rank`` gave it)."""

    host: int = 0
    disk: int = 0
    remote: int = 0
    host_per_rank: bool = False

    @property
    def given(self) -> bool:
        """True when any tier is sized in bytes."""
        return bool(self.host or self.disk or self.remote)

    def of(self, tier: str) -> int:
        if tier not in TIERS:
            raise ConfigError(f"unknown tier {tier!r}; known: {list(TIERS)}")
        return int(getattr(self, tier))

    def per_rank(self, tier: str, ranks: int) -> int:
        """One rank's budget for ``tier`` in an engine of ``ranks`` tensor-parallel ranks."""
        budget = self.of(tier)
        return budget if tier == "host" and self.host_per_rank else budget // ranks


def _bytes(key: str, value: object) -> int:
    """``value`` of size key ``key`` in bytes (``<tier>_gib`` scaled by 2**30); a number or a
    numeric string > 0, else ``ConfigError`` naming the key."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)
    number = finite_number(value)
    if number is None or number <= 0:
        raise ConfigError(f"{key} must be a number > 0, got {value!r}")
    return int(number * GIB) if key in GIB_KEYS else int(number)


def tier_bytes(extra: Mapping[str, Any]) -> TierBytes:
    """The byte budgets ``extra`` (``kv_connector_extra_config``) gives. ``ConfigError`` in one
    line when a tier is sized twice: by slots and bytes (``host_slots`` and ``host_gib``), or
    by two byte keys (``host_gib`` and ``cpu_bytes_to_use``)."""
    given: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for key in sorted(k for k in extra if k in SIZE_KEYS):
        tier = SIZE_KEYS[key]
        if tier in given:
            raise ConfigError(
                f"the {tier} tier is sized twice: give one of {given[tier]}={extra[given[tier]]!r} "
                f"and {key}={extra[key]!r}"
            )
        given[tier] = key
        sizes[tier] = _bytes(key, extra[key])
    for tier, key in given.items():
        slots_key = f"{tier}_slots"
        if slots_key in extra:
            raise ConfigError(
                f"the {tier} tier is sized twice: give one of {slots_key}={extra[slots_key]!r} "
                f"and {key}={extra[key]!r}"
            )
    return TierBytes(**sizes, host_per_rank=given.get("host") in PER_RANK_KEYS)


def slot_cost(tier: str, chunk_bytes: int) -> int:
    """Bytes one chunk slot of ``tier`` takes: a page-aligned payload in host memory, plus a
    page of header on disk; the payload alone in Redis."""
    if tier == "host":
        return round_up(chunk_bytes)
    if tier == "disk":
        return round_up(chunk_bytes) + ALIGN
    return chunk_bytes


def slots_for(tier: str, budget: int, chunk_bytes: int) -> int:
    """Chunk slots of ``tier`` that fit in ``budget`` bytes with chunks of ``chunk_bytes``;
    ``ConfigError`` when not even one does (naming the smallest budget that holds one)."""
    cost = slot_cost(tier, chunk_bytes)
    slots = budget // cost
    if slots < 1:
        raise ConfigError(
            f"the {tier} tier's {budget} bytes hold no chunk of {chunk_bytes} bytes "
            f"(blocks_per_chunk blocks of every layer): give at least {cost} bytes"
        )
    return slots


def kv_block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one vLLM block across every layer, from vLLM's ``KVCacheConfig`` read by duck
    typing: the sum over its KV cache groups of layers x ``page_size_bytes``. ``ConfigError``
    when it is absent or names no layer (sizes in bytes then cannot be turned into slots)."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    total = sum(len(g.layer_names) * int(g.kv_cache_spec.page_size_bytes) for g in groups)
    if total <= 0:
        raise ConfigError(
            "tier sizes in bytes need vLLM's kv_cache_config (the block size in bytes); "
            "give <tier>_slots instead"
        )
    return total
