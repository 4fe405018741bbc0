"""OffloadConfig: validation and resolution through kvplane.config (flag > env > file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.config import Source, resolve
from kvplane.errors import ConfigError
from kvplane.offload.config import OffloadConfig
from kvplane.offload.tiers import SyncPolicy


def test_resolve_from_env_file_and_flags() -> None:
    cfg, src = resolve(
        OffloadConfig,
        "offload",
        file={"offload": {"host_slots": 16, "policy": "arc", "disk_path": "/tmp/kv"}},
        env={"KVPLANE_OFFLOAD_DISK_SYNC": "data", "KVPLANE_OFFLOAD_HOST_SLOTS": "32"},
        flags={"remote_url": "redis://127.0.0.1:6399/0"},
    )
    assert cfg.host_slots == 32 and src["host_slots"] is Source.ENV
    assert cfg.policy == "arc" and cfg.disk_path == Path("/tmp/kv")
    assert cfg.disk_sync is SyncPolicy.DATA and cfg.remote_url.endswith("6399/0")
    assert src["remote_url"] is Source.FLAG and src["admission_min_lookups"] is Source.DEFAULT
    assert (cfg.disk_codec, cfg.remote_codec) == ("raw", "raw")  # the default: no codec


def test_codecs_resolve_per_tier() -> None:
    cfg, _ = resolve(
        OffloadConfig, "offload", file={"offload": {"disk_codec": "lz4"}},
        env={"KVPLANE_OFFLOAD_REMOTE_CODEC": "fp8"},
    )  # fmt: skip
    assert (cfg.disk_codec, cfg.remote_codec) == ("lz4", "fp8")


@pytest.mark.parametrize(
    "kw",
    [
        {"host_slots": 0},
        {"policy": "fifo"},
        {"admission_min_lookups": -1},
        {"remote_url": "http://x"},
        {"remote_namespace": "a:b"},
        {"remote_timeout_s": 0.0},
        {"remote_lease_s": 0.0},
        {"remote_lease_s": float("nan")},
        {"disk_sync": "data"},
        {"staging_blocks": True},
        {"disk_codec": "gzip"},
        {"remote_codec": 8},
    ],
)
def test_bad_values_name_the_field(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(kw))):
        OffloadConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0, "5"])
def test_remote_timeout_must_be_finite_and_positive(value: object) -> None:
    with pytest.raises(ConfigError, match="remote_timeout_s must be a finite number > 0"):
        OffloadConfig(remote_timeout_s=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", ["nan", "inf"])
def test_remote_timeout_from_the_environment_refuses_nan_and_inf(raw: str) -> None:
    with pytest.raises(ConfigError, match="remote_timeout_s"):
        resolve(OffloadConfig, "offload", env={"KVPLANE_OFFLOAD_REMOTE_TIMEOUT_S": raw})
    cfg, _ = resolve(OffloadConfig, "offload", env={"KVPLANE_OFFLOAD_REMOTE_TIMEOUT_S": "0.5"})
    assert cfg.remote_timeout_s == 0.5


def test_a_lease_shorter_than_two_timeouts_is_refused_naming_both() -> None:
    """A renewal may take ``remote_timeout_s`` and a write decided on it ``remote_timeout_s``
    more: a shorter lease could run out while this engine still writes to the namespace."""
    with pytest.raises(ConfigError) as info:
        OffloadConfig(remote_lease_s=9.0, remote_timeout_s=5.0)
    assert type(info.value) is ConfigError
    assert str(info.value) == (
        "OffloadConfig.remote_lease_s must be >= 2 * OffloadConfig.remote_timeout_s (a renewal "
        "may take OffloadConfig.remote_timeout_s and a write OffloadConfig.remote_timeout_s more "
        "before the lease runs out), got OffloadConfig.remote_lease_s=9.0 and "
        "OffloadConfig.remote_timeout_s=5.0"
    )
    with pytest.raises(ConfigError, match=r"remote_lease_s must be >= 2 \* "):
        resolve(OffloadConfig, "offload", env={"KVPLANE_OFFLOAD_REMOTE_TIMEOUT_S": "6"})


def test_a_lease_of_exactly_two_timeouts_is_allowed() -> None:
    cfg = OffloadConfig(remote_lease_s=1.0, remote_timeout_s=0.5)
    assert (cfg.remote_lease_s, cfg.remote_timeout_s) == (1.0, 0.5)
    assert OffloadConfig().remote_lease_s == 2 * OffloadConfig().remote_timeout_s  # defaults
