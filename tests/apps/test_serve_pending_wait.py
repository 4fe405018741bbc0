"""``kvplane serve prefill --offload-pending-wait S``: how long a request waits for this
worker's own in-flight store of its prefix (#30). 2 s by default, 0 never waits; from flag,
environment or config file; a value that is not a duration in [0, 1e6] s is one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.apps.serve import offload_of
from kvplane.apps.serve_config import settle
from kvplane.cli import build_parser
from kvplane.errors import ConfigError
from kvplane.serving.prefix_offload import PrefixSettings


def _settings(*argv: str, env: dict[str, str] | None = None) -> PrefixSettings | None:
    args = build_parser().parse_args(["serve", "prefill", "--offload-host-slots", "4", *argv])
    settle(args, env or {})
    return offload_of(args)


def _wait_s(*argv: str, env: dict[str, str] | None = None) -> float:
    settings = _settings(*argv, env=env)
    assert settings is not None
    return settings.pending_wait_s


def test_the_wait_comes_from_flag_env_or_file_and_0_disables_it(tmp_path: Path) -> None:
    assert _wait_s() == 2.0
    assert _wait_s("--offload-pending-wait", "0.5") == 0.5
    assert _wait_s("--offload-pending-wait", "0") == 0.0
    assert _wait_s(env={"KVPLANE_OFFLOAD_PENDING_WAIT": "0"}) == 0.0
    config = tmp_path / "serve.toml"
    config.write_text("[offload]\nhost_slots = 4\npending_wait = 3\n")
    assert _wait_s("--config", str(config)) == 3.0
    assert _wait_s("--config", str(config), "--offload-pending-wait", "1") == 1.0


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1000001"])
def test_a_wait_that_is_not_a_duration_is_one_line(value: str) -> None:
    want = r"^--offload-pending-wait must be a finite number >= 0 and at most 1e\+06 s"
    with pytest.raises(ConfigError, match=want):
        _settings("--offload-pending-wait", value)
    args = build_parser().parse_args(["serve", "prefill", "--offload-pending-wait", value])
    settle(args, {})
    with pytest.raises(ConfigError, match=want):  # refused even with the offload off
        offload_of(args)
