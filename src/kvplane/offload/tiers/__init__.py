"""Offload tiers: the byte stores (host memory, a slot file on disk, a Redis server)."""

from kvplane.offload.tiers.base import ReadOutcome, SyncPolicy, Tier, TierCounters, check_batch
from kvplane.offload.tiers.disk import DiskTier
from kvplane.offload.tiers.header import HEADER_BYTES, ChunkHeader, payload_checksum
from kvplane.offload.tiers.host import ALIGN, HostTier, round_up
from kvplane.offload.tiers.remote import RemoteTier, redis_support
from kvplane.offload.tiers.shared import SharedTier
from kvplane.offload.tiers.shared_server import PublishOutcome, PublishResult

__all__ = [
    "ALIGN",
    "HEADER_BYTES",
    "ChunkHeader",
    "DiskTier",
    "HostTier",
    "PublishOutcome",
    "PublishResult",
    "ReadOutcome",
    "RemoteTier",
    "SharedTier",
    "SyncPolicy",
    "Tier",
    "TierCounters",
    "check_batch",
    "payload_checksum",
    "redis_support",
    "round_up",
]
