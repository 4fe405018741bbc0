"""``kvplane serve proxy``'s flags: the [proxy] section from flags, environment and file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvplane.apps.proxy import ProxyConfig
from kvplane.apps.proxy_command import config_of
from kvplane.apps.proxy_routing import RoutingConfig
from kvplane.apps.serve_config import settle
from kvplane.cli import build_parser
from kvplane.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", "proxy", *argv])


def test_flags_over_environment_over_file_over_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[proxy]\nprefill = "http://10.0.0.1:8100"\ndecode = "http://10.0.0.2:8200"\n'
        'mode = "pipelined"\nprefill_pd = "tcp://10.0.0.1:7000"\nmax_concurrent = 8\n'
    )
    env = {"KVPLANE_PROXY_MAX_CONCURRENT": "16", "KVPLANE_PROXY_TIMEOUT": "30"}
    args = settle(_args("--config", str(path), "--port", "9000"), env)
    assert config_of(args) == ProxyConfig(
        prefill="http://10.0.0.1:8100", decode="http://10.0.0.2:8200",
        prefill_pd="tcp://10.0.0.1:7000", mode="pipelined", port=9000, max_concurrent=16,
        timeout_s=30.0,
    )  # fmt: skip
    args = settle(_args("--prefill", "http://a:1", "--decode", "http://b:2"), {})
    assert config_of(args) == ProxyConfig(prefill="http://a:1", decode="http://b:2", port=8000)


def test_a_bad_value_from_the_environment_names_the_field() -> None:
    args = _args("--prefill", "http://a:1", "--decode", "http://b:2")
    with pytest.raises(ConfigError, match=r"\[proxy\] mode must be one of"):
        settle(args, {"KVPLANE_PROXY_MODE": "push"})


def test_routing_flags_build_the_routing_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[proxy]\nkey_root = "00ff"\nblock_size = 32\nkv_events_insecure = true\n')
    env = {"KVPLANE_PROXY_ENGINES": "http://a:1,http://b:2"}
    args = _args(
        "--config", str(path), "--mode", "direct", "--policy", "cache-aware",
        "--kv-events", "tcp://a:5000,tcp://b:5000", "--hash-seed", "7",
    )  # fmt: skip
    config = config_of(settle(args, env))
    assert config == ProxyConfig(
        mode="direct", engines="http://a:1,http://b:2", port=8000,
        routing=RoutingConfig(
            policy="cache-aware", kv_events="tcp://a:5000,tcp://b:5000", kv_events_insecure=True,
            key_root="00ff", hash_seed=7, block_size=32,
        ),
    )  # fmt: skip
    assert config.routed == ("http://a:1", "http://b:2")
    assert [(s.address, s.replay_address) for s in config.routing.sources()] == [
        ("tcp://a:5000", "tcp://a:5001"), ("tcp://b:5000", "tcp://b:5001"),
    ]  # fmt: skip


def test_several_servers_per_role_and_their_pd_groups() -> None:
    args = _args(
        "--prefill", "http://a:1,http://b:2", "--decode", "http://c:3", "--mode", "pipelined",
        "--prefill-pd", "tcp://a:7000;tcp://b:7000,tcp://b:7001",
    )  # fmt: skip
    config = config_of(settle(args, {}))
    assert config.routed == ("http://a:1", "http://b:2")
    assert config.prefill_pd_groups == (("tcp://a:7000",), ("tcp://b:7000", "tcp://b:7001"))
    assert config.prefill_pd_ranks == ("tcp://a:7000",)
