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
