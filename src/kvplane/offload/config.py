"""``[offload]`` configuration: tier sizes, policy, admission, disk and Redis settings, codecs.

Resolve it with :func:`kvplane.config.resolve` (``OffloadConfig``, section ``"offload"``), so
every field can come from a flag, ``KVPLANE_OFFLOAD_<FIELD>``, the TOML file or the default.
Tiers below the host are enabled by giving them a place: ``disk_path`` for the disk tier,
``remote_url`` for the Redis tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvplane.errors import ConfigError
from kvplane.offload.codecs.registry import check_codec_setting
from kvplane.offload.policies.registry import POLICIES
from kvplane.offload.tiers.base import SyncPolicy
from kvplane.offload.tiers.lease import check_lease_timing
from kvplane.offload.tiers.remote import NAMESPACE_BAD
from kvplane.offload.tiers.shared_server import REMOTE_MODES, replica_urls
from kvplane.validators import require_int, require_number


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """Sizes are in chunk slots; a slot holds one chunk (``blocks_per_chunk`` blocks).

    Every size is a positive int; ``remote_timeout_s`` and ``remote_lease_s`` are finite and
    > 0, and ``remote_lease_s >= 2 * remote_timeout_s``: a renewal of the lease may take up to
    ``remote_timeout_s`` to come back, and a write decided on it up to ``remote_timeout_s`` more
    to run, so a shorter lease could run out -- and another engine take the namespace -- while
    this one still writes to it (derived in :mod:`kvplane.offload.tiers.lease`; the defaults,
    10 s and 5 s, are the least lease for their timeout). ``remote_namespace`` belongs to one
    engine at a time: the open remote tier holds it by a lease of ``remote_lease_s`` seconds,
    renewed while open, so a second engine on it is refused (give each engine its own
    namespace) and a restarted one claims it back, at most ``remote_lease_s`` after a crash,
    and finds its chunks there again by content hash. ``disk_codec`` and ``remote_codec``
    name the codec each cold tier stores chunks with (:data:`~kvplane.offload.codecs.CODECS`;
    the host tier stays raw). ``disk_blocks_per_chunk`` and ``remote_blocks_per_chunk`` size
    each cold tier's chunks (0: the host's; else a multiple of it, :mod:`~kvplane.offload.spans`:
    the cascade re-chunks between tiers). A codec ``"auto"`` chooses a lossless one that keeps
    the tier's measured ``disk_gbps``/``remote_gbps`` up, else raw (0: not measured, which
    ``auto`` refuses; :mod:`~kvplane.offload.codecs.auto`). ``remote_mode = "shared"`` makes
    the Redis tier the shared store (:mod:`~kvplane.offload.tiers.shared`: many engines, one
    namespace, no lease; ``remote_lease_s`` is then each writer's registration), written to
    ``remote_url`` and the comma-separated ``remote_replicas`` too. A bad field raises
    :class:`~kvplane.errors.ConfigError` naming it (both, for the lease relation).
    """

    host_slots: int = 64
    policy: str = "lru"
    admission_min_lookups: int = 1
    pin_memory: bool = True
    disk_path: Path | None = None
    disk_slots: int = 256
    disk_sync: SyncPolicy = SyncPolicy.NONE
    disk_direct_io: bool = True
    remote_url: str = ""
    remote_slots: int = 256
    remote_namespace: str = "kvplane"
    remote_timeout_s: float = 5.0
    remote_lease_s: float = 10.0
    staging_blocks: int = 256
    disk_codec: str = "raw"
    remote_codec: str = "raw"
    disk_blocks_per_chunk: int = 0
    remote_blocks_per_chunk: int = 0
    disk_gbps: float = 0.0
    remote_gbps: float = 0.0
    remote_mode: str = "private"
    remote_replicas: str = ""

    def __post_init__(self) -> None:
        for name in ("host_slots", "disk_slots", "remote_slots", "staging_blocks"):
            require_int(f"OffloadConfig.{name}", getattr(self, name), min=1, error=ConfigError)
        for name in ("disk_blocks_per_chunk", "remote_blocks_per_chunk"):
            require_int(f"OffloadConfig.{name}", getattr(self, name), min=0, error=ConfigError)
        if self.policy not in POLICIES:
            raise ConfigError(
                f"OffloadConfig.policy {self.policy!r} is not one of {sorted(POLICIES)}"
            )
        check_codec_setting("OffloadConfig.disk_codec", self.disk_codec)
        check_codec_setting("OffloadConfig.remote_codec", self.remote_codec)
        for name in ("disk_gbps", "remote_gbps"):
            require_number(f"OffloadConfig.{name}", getattr(self, name), min=0.0, error=ConfigError)
        m = self.admission_min_lookups
        require_int("OffloadConfig.admission_min_lookups", m, min=0, error=ConfigError)
        if not isinstance(self.disk_sync, SyncPolicy):
            raise ConfigError(
                f"OffloadConfig.disk_sync must be a SyncPolicy, got {self.disk_sync!r}"
            )
        if self.remote_url and not self.remote_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(
                f"OffloadConfig.remote_url must be a redis:// URL: {self.remote_url!r}"
            )
        if not self.remote_namespace or NAMESPACE_BAD.search(self.remote_namespace):
            raise ConfigError(
                f"OffloadConfig.remote_namespace must be non-empty without ':' or a glob "
                f"character (*?[]\\): {self.remote_namespace!r}"
            )
        if self.remote_mode not in REMOTE_MODES:
            raise ConfigError(
                f"OffloadConfig.remote_mode must be one of {REMOTE_MODES}: {self.remote_mode!r}"
            )
        for url in replica_urls(self.remote_replicas):
            if not url.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError(f"OffloadConfig.remote_replicas holds a non-redis URL: {url!r}")
        if self.remote_replicas and self.remote_mode != "shared":
            raise ConfigError("OffloadConfig.remote_replicas needs remote_mode = 'shared'")
        check_lease_timing(
            self.remote_lease_s,
            self.remote_timeout_s,
            lease_name="OffloadConfig.remote_lease_s",
            timeout_name="OffloadConfig.remote_timeout_s",
            error=ConfigError,
        )
