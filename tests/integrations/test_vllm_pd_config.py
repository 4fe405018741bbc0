"""The connector's PD settings: ``pd_*`` extra-config keys, ``KVPLANE_PD_*``, the secret."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvplane.config import MIN_SECRET_BYTES
from kvplane.errors import ConfigError
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.pd_config import (
    PDConfig,
    PDSettings,
    pd_config,
    pd_settings,
)
from kvplane.pd.timers import Timings

SECRET = "0123456789abcdef"  # exactly MIN_SECRET_BYTES


def settings(extra: dict[str, Any], env: dict[str, str] | None = None) -> PDSettings | None:
    environ = env or {}
    return pd_settings(pd_config(extra, environ), environ)


def one_line_error(extra: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        settings(extra, env)
    text = str(info.value)
    assert "\n" not in text
    return text


def test_pd_is_off_by_default() -> None:
    assert pd_config({}, {}) == PDConfig()
    assert PDConfig().transport == ""
    assert settings({}) is None
    assert settings({}, {"KVPLANE_SECRET": SECRET}) is None
    assert parse_extra_config(None, {}).pd == PDConfig()


@pytest.mark.parametrize("transport", ["tcp", "shm", "nixl", "mooncake"])
def test_a_transport_without_a_secret_is_refused_naming_pd_insecure(transport: str) -> None:
    text = one_line_error({"pd_transport": transport})
    assert "pd_insecure" in text and "secret" in text


def test_insecure_runs_without_a_secret() -> None:
    got = settings({"pd_transport": "tcp", "pd_insecure": True, "pd_name": "p"})
    assert got == PDSettings(
        transport="tcp",
        bind="tcp://127.0.0.1:0",
        host="127.0.0.1",
        name="p",
        secret=None,
        check_prompt=True,
        slice_timeout_s=30.0,
        pull_timeout_s=120.0,
        connect_timeout_s=30.0,
        timings=Timings(deadline_s=120.0, lease_s=5.0, heartbeat_s=1.0),
    )


def test_the_default_name_is_per_process() -> None:
    got = settings({"pd_transport": "tcp", "pd_insecure": True})
    assert got is not None and got.name == f"vllm-{os.getpid()}"


def test_secret_from_the_environment() -> None:
    got = settings({"pd_transport": "tcp"}, {"KVPLANE_SECRET": SECRET})
    assert got is not None and got.secret == SECRET.encode()


def test_a_short_secret_is_refused() -> None:
    text = one_line_error({"pd_transport": "tcp"}, {"KVPLANE_SECRET": SECRET[:-1]})
    want = f"KVPLANE_SECRET must hold a secret of at least {MIN_SECRET_BYTES} bytes, got 15"
    assert text == want


def test_secret_file_is_read_and_stripped_and_wins_over_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"file-secret-0123456789\n")
    got = settings(
        {"pd_transport": "shm", "pd_secret_file": str(path)},
        {"KVPLANE_SECRET": "env-secret-0123456789"},
    )
    assert got is not None and got.secret == b"file-secret-0123456789"


def test_a_short_secret_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"0123456789abcde  \n")  # 15 bytes once stripped
    text = one_line_error({"pd_transport": "tcp", "pd_secret_file": str(path)})
    assert "at least 16 bytes" in text


def test_a_missing_secret_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nope"
    text = one_line_error({"pd_transport": "tcp", "pd_secret_file": str(path)})
    assert text == f"pd_secret_file {str(path)!r} cannot be read: No such file or directory"


def test_insecure_with_a_secret_is_refused() -> None:
    text = one_line_error({"pd_transport": "tcp", "pd_insecure": True}, {"KVPLANE_SECRET": SECRET})
    assert text == "pd_insecure with a secret: choose one"


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_a_transport_that_cannot_authenticate_refuses_a_secret(transport: str) -> None:
    text = one_line_error({"pd_transport": transport}, {"KVPLANE_SECRET": SECRET})
    assert text == f"pd_transport {transport!r} cannot authenticate its data plane"
    got = settings({"pd_transport": transport, "pd_insecure": True})
    assert got is not None and got.secret is None


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"pd_transport": "udp"}, "pd_transport 'udp'"),
        ({"pd_transport": "local"}, "pd_transport 'local'"),
        ({"pd_lease_s": -1}, "pd_lease_s"),
        ({"pd_deadline_s": 0}, "pd_deadline_s"),
        ({"pd_slice_timeout_s": -0.5}, "pd_slice_timeout_s"),
        ({"pd_pull_timeout_s": float("inf")}, "pd_pull_timeout_s"),
        ({"pd_heartbeat_s": float("nan")}, "pd_heartbeat_s"),
        ({"pd_heartbeat_s": 5.0}, "pd_heartbeat_s 5.0 must be below pd_lease_s"),
        ({"pd_heartbeat_s": 2.0, "pd_lease_s": 1.0}, "must be below pd_lease_s"),
        ({"pd_lease_s": "abc"}, "lease_s"),
        ({"pd_insecure": 1}, "insecure"),
    ],
)
def test_bad_values_are_one_line_config_errors(extra: dict[str, Any], names: str) -> None:
    with pytest.raises(ConfigError) as info:
        pd_config({"pd_transport": "tcp", **extra}, {})
    assert names in str(info.value)
    assert "\n" not in str(info.value)


def test_environment_is_read_below_extra_config_keys() -> None:
    env = {
        "KVPLANE_PD_TRANSPORT": "shm",
        "KVPLANE_PD_LEASE_S": "9",
        "KVPLANE_PD_HEARTBEAT_S": "2",
        "KVPLANE_PD_INSECURE": "true",
        "KVPLANE_PD_CHECK_PROMPT": "false",
    }
    from_env = pd_config({}, env)
    assert (from_env.transport, from_env.lease_s, from_env.heartbeat_s) == ("shm", 9.0, 2.0)
    assert from_env.insecure is True and from_env.check_prompt is False
    both = pd_config({"pd_transport": "tcp", "pd_lease_s": 3, "pd_check_prompt": True}, env)
    assert (both.transport, both.lease_s, both.heartbeat_s) == ("tcp", 3.0, 2.0)
    assert both.insecure is True and both.check_prompt is True
    got = pd_settings(both, env)
    assert got is not None and got.timings == Timings(
        deadline_s=120.0, lease_s=3.0, heartbeat_s=2.0
    )


def test_a_bad_environment_value_is_a_config_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVPLANE_PD_LEASE_S"):
        pd_config({}, {"KVPLANE_PD_LEASE_S": "soon"})


def test_parse_extra_config_takes_pd_keys() -> None:
    cfg = parse_extra_config(
        {"host_slots": 4, "pd_transport": "tcp", "pd_bind": "tcp://0.0.0.0:7000", "pd_lease_s": 8},
        {"KVPLANE_PD_HEARTBEAT_S": "0.5"},
    )
    assert cfg.offload.host_slots == 4
    assert cfg.pd == PDConfig(
        transport="tcp", bind="tcp://0.0.0.0:7000", lease_s=8.0, heartbeat_s=0.5
    )


@pytest.mark.parametrize("key", ["pd_bogus", "pd_", "pd_secret"])
def test_parse_extra_config_refuses_unknown_pd_keys(key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_extra_config({key: "x"}, {})


def test_pd_config_refuses_unknown_pd_keys() -> None:
    with pytest.raises(ConfigError, match="bogus"):
        pd_config({"pd_bogus": 1}, {})
