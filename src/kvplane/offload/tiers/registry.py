"""The tier registry: which tier kinds exist, whether each is usable here, and opening them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from kvplane.errors import ConfigError
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.offload.codecs.auto import auto_codec
from kvplane.offload.codecs.base import ChunkFormat
from kvplane.offload.codecs.coder import ChunkCoder
from kvplane.offload.codecs.registry import AUTO, make_codec
from kvplane.offload.config import OffloadConfig
from kvplane.offload.tiers.base import Tier
from kvplane.offload.tiers.disk import DiskTier
from kvplane.offload.tiers.remote import RemoteTier, redis_support
from kvplane.offload.tiers.shared import SharedTier
from kvplane.offload.tiers.shared_server import replica_urls

log = logging.getLogger(__name__)

TIER_KINDS: tuple[str, ...] = ("device", "host", "disk", "remote")
"""Every place a chunk can live, fastest first (stores cascade down this list)."""

_SUPPORT: dict[str, Callable[[], str | None]] = {
    "device": lambda: None,
    "host": lambda: None,
    "disk": lambda: None,
    "remote": redis_support,
}


def tier_support(kind: str) -> str | None:
    """``None`` when tier ``kind`` can be used in this environment, else the reason it cannot."""
    try:
        return _SUPPORT[kind]()
    except KeyError:
        raise ConfigError(f"unknown tier kind {kind!r}; known: {list(TIER_KINDS)}") from None


def tier_coder(
    what: str, codec: str, layout: KVLayout | None, chunk_bytes: int, tier_gbps: float = 0.0
) -> ChunkCoder | None:
    """The coder of a tier configured with ``codec`` (``what`` names the setting): ``None``
    for ``raw``; else planned for chunks of ``chunk_bytes`` bytes of ``layout`` --
    ``ConfigError`` without a layout, ``UnsupportedError`` when the codec cannot code them.
    ``auto`` measures the lossless codecs against ``tier_gbps`` and logs its choice
    (:func:`~kvplane.offload.codecs.auto.auto_codec`)."""
    if codec == "raw":
        return None
    if layout is None:
        raise ConfigError(f"{what} = {codec!r} needs the pool's layout to code its chunks")
    fmt = ChunkFormat.of(layout, chunk_bytes)
    if codec == AUTO:
        got = auto_codec(fmt, tier_gbps)
        fits = [(f.speed.codec, round(f.store_gbps, 3), round(f.load_gbps, 3)) for f in got.fits]
        log.info("%s = 'auto' chose %s at %.3g GB/s: %s", what, got.codec, tier_gbps, fits)
        if got.codec == "raw":
            return None
        codec = got.codec
    return ChunkCoder(make_codec(codec), fmt)


def open_lower_tiers(
    config: OffloadConfig,
    chunk_bytes: int,
    fingerprint: bytes,
    metrics: MetricsRegistry | None = None,
    *,
    layout: KVLayout | None = None,
    spans: Mapping[str, int] | None = None,
) -> list[Tier]:
    """The tiers below host that ``config`` enables (disk, then remote: the shared store when
    ``remote_mode`` is ``"shared"``), opened, each with
    its configured codec (a codec other than ``raw`` needs ``layout``: :func:`tier_coder`)
    and chunks of ``spans[name]`` (default 1) times ``chunk_bytes``.

    Raises ``UnsupportedError`` for a configured tier whose engine is missing and
    ``OffloadError`` for one that cannot be opened; tiers opened before the failure are closed.
    """
    span = dict(spans or {})
    disk_bytes = chunk_bytes * span.get("disk", 1)
    remote_bytes = chunk_bytes * span.get("remote", 1)
    disk_coder = remote_coder = None
    if config.disk_path is not None:
        disk_coder = tier_coder(
            "OffloadConfig.disk_codec", config.disk_codec, layout, disk_bytes, config.disk_gbps
        )
    if config.remote_url:
        remote_coder = tier_coder(
            "OffloadConfig.remote_codec", config.remote_codec, layout, remote_bytes,
            config.remote_gbps,
        )  # fmt: skip
    tiers: list[Tier] = []
    try:
        if config.disk_path is not None:
            tiers.append(
                DiskTier(
                    config.disk_path,
                    config.disk_slots,
                    disk_bytes,
                    fingerprint,
                    sync=config.disk_sync,
                    direct_io=config.disk_direct_io,
                    metrics=metrics,
                    coder=disk_coder,
                )
            )
        if config.remote_url:
            shared = config.remote_mode == "shared"
            urls = [config.remote_url, *replica_urls(config.remote_replicas)]
            make: Callable[..., Tier] = SharedTier if shared else RemoteTier
            tiers.append(
                make(
                    urls if shared else config.remote_url,
                    config.remote_slots,
                    remote_bytes,
                    fingerprint,
                    namespace=config.remote_namespace,
                    timeout_s=config.remote_timeout_s,
                    lease_s=config.remote_lease_s,
                    metrics=metrics,
                    coder=remote_coder,
                )
            )
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers
