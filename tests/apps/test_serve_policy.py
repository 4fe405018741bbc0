"""``kvplane serve router --policy``: round-robin by default, cache-aware by flag, env or
config file; any other name refused before anything starts."""

from __future__ import annotations

import pytest

from kvplane.apps.serve_config import settle
from kvplane.cli import build_parser
from kvplane.errors import ConfigError
from kvplane.serving.router.route_policy import RoutePolicy


def _router(*argv: str) -> object:
    return build_parser().parse_args(["serve", "router", *argv])


def test_the_policy_defaults_to_round_robin_and_is_taken_from_flag_or_env() -> None:
    assert settle(_router(), {}).policy == "round-robin"  # type: ignore[arg-type]
    args = settle(_router("--policy", "cache-aware"), {})  # type: ignore[arg-type]
    assert RoutePolicy.parse(args.policy) is RoutePolicy.CACHE_AWARE
    args = settle(_router(), {"KVPLANE_ROUTER_POLICY": "cache-aware"})  # type: ignore[arg-type]
    assert args.policy == "cache-aware"


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(SystemExit):
        _router("--policy", "least-loaded")
    with pytest.raises(ConfigError, match=r"\[router\] policy must be one of"):
        settle(_router(), {"KVPLANE_ROUTER_POLICY": "random"})  # type: ignore[arg-type]
