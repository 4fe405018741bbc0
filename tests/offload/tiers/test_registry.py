"""The tier registry: support checks, and opening the configured lower tiers (all or none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.errors import ConfigError, OffloadError
from kvplane.offload.config import OffloadConfig
from kvplane.offload.tiers import DiskTier, RemoteTier, SharedTier
from kvplane.offload.tiers.registry import TIER_KINDS, open_lower_tiers, tier_support
from kvplane.testing.redis_server import free_port

FP = bytes(range(16))


def test_support() -> None:
    assert TIER_KINDS == ("device", "host", "disk", "remote")
    assert tier_support("host") is None and tier_support("disk") is None
    assert tier_support("remote") is None  # the redis client is installed in the test env
    with pytest.raises(ConfigError, match="tape"):
        tier_support("tape")


def test_open_lower_tiers(tmp_path: Path, redis_url: str, redis_namespace: str) -> None:
    assert open_lower_tiers(OffloadConfig(), 4096, FP) == []
    cfg = OffloadConfig(
        disk_path=tmp_path / "slots", disk_slots=3, remote_url=redis_url,
        remote_slots=5, remote_namespace=redis_namespace,
    )  # fmt: skip
    tiers = open_lower_tiers(cfg, 4096, FP)
    assert [type(t) for t in tiers] == [DiskTier, RemoteTier]
    assert [t.num_slots for t in tiers] == [3, 5]
    for t in tiers:
        t.close()


def test_a_tier_that_cannot_open_closes_the_ones_before_it(tmp_path: Path) -> None:
    cfg = OffloadConfig(
        disk_path=tmp_path / "slots", remote_url=f"redis://127.0.0.1:{free_port()}/0",
        remote_timeout_s=1.0,
    )  # fmt: skip
    with pytest.raises(OffloadError, match="unreachable"):
        open_lower_tiers(cfg, 4096, FP)
    DiskTier(tmp_path / "slots", 2, 4096, FP).close()  # the disk file's lock was released


def test_shared_mode_opens_the_shared_store_with_its_replicas(
    redis_url: str, redis_namespace: str
) -> None:
    cfg = OffloadConfig(
        remote_url=redis_url, remote_mode="shared", remote_replicas=f" {redis_url} ,",
        remote_slots=5, remote_namespace=redis_namespace,
    )  # fmt: skip
    [tier] = open_lower_tiers(cfg, 4096, FP)
    assert isinstance(tier, SharedTier) and tier.name == "remote"
    assert tier.urls == (redis_url, redis_url) and tier.num_slots == 5
    tier.close()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"remote_mode": "pooled"}, "remote_mode"),
        ({"remote_mode": "shared", "remote_replicas": "http://x"}, "non-redis"),
        ({"remote_replicas": "redis://127.0.0.1:1/0"}, "needs remote_mode"),
    ],
)
def test_shared_mode_settings_are_checked(fields: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        OffloadConfig(**fields)  # type: ignore[arg-type]
