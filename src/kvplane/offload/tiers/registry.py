"""The tier registry: which tier kinds exist, whether each is usable here, and opening them."""

from __future__ import annotations

from collections.abc import Callable

from kvplane.errors import ConfigError
from kvplane.layout import KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.offload.codecs.base import ChunkFormat
from kvplane.offload.codecs.coder import ChunkCoder
from kvplane.offload.codecs.registry import make_codec
from kvplane.offload.config import OffloadConfig
from kvplane.offload.tiers.base import Tier
from kvplane.offload.tiers.disk import DiskTier
from kvplane.offload.tiers.remote import RemoteTier, redis_support

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
    what: str, codec: str, layout: KVLayout | None, chunk_bytes: int
) -> ChunkCoder | None:
    """The coder of a tier configured with ``codec`` (``what`` names the setting): ``None``
    for ``raw``; else planned for chunks of ``chunk_bytes`` bytes of ``layout`` --
    ``ConfigError`` without a layout, ``UnsupportedError`` when the codec cannot code them."""
    if codec == "raw":
        return None
    if layout is None:
        raise ConfigError(f"{what} = {codec!r} needs the pool's layout to code its chunks")
    return ChunkCoder(make_codec(codec), ChunkFormat.of(layout, chunk_bytes))


def open_lower_tiers(
    config: OffloadConfig,
    chunk_bytes: int,
    fingerprint: bytes,
    metrics: MetricsRegistry | None = None,
    *,
    layout: KVLayout | None = None,
) -> list[Tier]:
    """The tiers below host that ``config`` enables (disk, then remote), opened, each with
    its configured codec (a codec other than ``raw`` needs ``layout``: :func:`tier_coder`).

    Raises ``UnsupportedError`` for a configured tier whose engine is missing and
    ``OffloadError`` for one that cannot be opened; tiers opened before the failure are closed.
    """
    disk_coder = tier_coder("OffloadConfig.disk_codec", config.disk_codec, layout, chunk_bytes)
    remote_coder = tier_coder(
        "OffloadConfig.remote_codec", config.remote_codec, layout, chunk_bytes
    )
    tiers: list[Tier] = []
    try:
        if config.disk_path is not None:
            tiers.append(
                DiskTier(
                    config.disk_path,
                    config.disk_slots,
                    chunk_bytes,
                    fingerprint,
                    sync=config.disk_sync,
                    direct_io=config.disk_direct_io,
                    metrics=metrics,
                    coder=disk_coder,
                )
            )
        if config.remote_url:
            tiers.append(
                RemoteTier(
                    config.remote_url,
                    config.remote_slots,
                    chunk_bytes,
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
