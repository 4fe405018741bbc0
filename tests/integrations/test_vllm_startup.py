"""Start-up messages: the failure-policy warning, a busy metrics port, the sizing note."""

from __future__ import annotations

import socket

import pytest

from kvplane.errors import ConfigError
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.startup import (
    failure_policy_warning,
    metrics_port_of,
    serve_metrics,
    sizing_note,
)
from kvplane.metrics import MetricsRegistry

REMOTE = {"remote_url": "redis://127.0.0.1:6379/0"}


def test_fail_policy_warns_only_with_a_tier_that_can_fail_a_load() -> None:
    host_only = parse_extra_config({}, {})
    assert failure_policy_warning(host_only, "fail") is None
    assert failure_policy_warning(parse_extra_config(REMOTE, {}), "recompute") is None
    both = parse_extra_config({**REMOTE, "disk_path": "/tmp/k.bin"}, {})
    text = failure_policy_warning(both, "fail")
    assert text is not None and "\n" not in text
    assert text.startswith(
        "kvplane: kv_load_failure_policy='fail' with the disk tier and the remote tier "
        "configured: a chunk that fails to load"
    )
    assert text.endswith("set kv_load_failure_policy='recompute' to recompute those tokens instead")


def _busy_port() -> socket.socket:
    held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    return held


@pytest.mark.parametrize("scheduler", [False, True])
def test_a_busy_metrics_port_is_a_config_error_naming_the_key(scheduler: bool) -> None:
    with _busy_port() as held:
        busy = held.getsockname()[1]
        base = busy - 1 if scheduler else busy
        cfg = parse_extra_config({"metrics_port": base}, {})
        with pytest.raises(ConfigError) as err:
            serve_metrics(MetricsRegistry(), cfg, scheduler=scheduler)
    side = "scheduler side (metrics_port + 1)" if scheduler else "worker side (metrics_port)"
    assert str(err.value) == (
        f"metrics_port={base}: port {busy} for the {side} is already in use on 127.0.0.1; "
        "choose another metrics_port, or 0 for no private metrics port"
    )


def test_no_metrics_port_serves_nothing_and_a_free_one_serves() -> None:
    assert serve_metrics(MetricsRegistry(), parse_extra_config({}, {}), scheduler=True) is None
    with _busy_port() as probe:
        free = probe.getsockname()[1]
    server = serve_metrics(
        MetricsRegistry(), parse_extra_config({"metrics_port": free}, {}), scheduler=False
    )
    assert server is not None and server.server_address[1] == free
    server.shutdown()
    server.server_close()


def test_each_tp_rank_worker_gets_its_own_metrics_port() -> None:
    cfg = parse_extra_config({"metrics_port": 9100}, {})
    assert metrics_port_of(cfg, scheduler=True) == 9101
    assert [metrics_port_of(cfg, scheduler=False, rank=r) for r in range(4)] == [
        9100,
        9102,
        9103,
        9104,
    ]
    high = parse_extra_config({"metrics_port": 65534}, {})
    assert metrics_port_of(high, scheduler=False) == 65534
    with pytest.raises(ConfigError) as err:
        metrics_port_of(high, scheduler=False, rank=1)
    assert str(err.value) == "metrics_port=65534: worker rank 1 would serve on port 65536"


def test_a_busy_rank_port_names_the_rank() -> None:
    with _busy_port() as held:
        busy = held.getsockname()[1]
        cfg = parse_extra_config({"metrics_port": busy - 2}, {})
        with pytest.raises(ConfigError) as err:
            serve_metrics(MetricsRegistry(), cfg, scheduler=False, rank=1)
    assert str(err.value) == (
        f"metrics_port={busy - 2}: port {busy} for the worker side of rank 1 (metrics_port + 2) "
        "is already in use on 127.0.0.1; choose another metrics_port, or 0 for no private "
        "metrics port"
    )


def test_sizing_note_names_each_byte_sized_tier() -> None:
    cfg = parse_extra_config({"host_gib": 1, "remote_gib": 0.5, **REMOTE}, {})
    chunk = 128 * 1024
    assert sizing_note(cfg.sized(chunk), chunk) == (
        "kvplane: chunks of 131072 bytes; host 8192 slots (1.000 of 1.000 GiB), "
        "remote 4096 slots (0.500 of 0.500 GiB)"
    )
    assert sizing_note(parse_extra_config({}, {}), chunk) is None
