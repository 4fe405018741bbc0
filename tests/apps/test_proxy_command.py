"""``kvplane serve proxy``'s flags: the [proxy] section from flags, environment and file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvplane.apps.proxy import ProxyConfig
from kvplane.apps.proxy_command import config_of
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
