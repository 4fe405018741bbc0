"""WorkerConfig: copy threads are validated and reach the transport `kvplane serve` builds."""

from __future__ import annotations

import pytest
import torch

from kvplane.apps.serve import config_of
from kvplane.cli import build_parser
from kvplane.errors import ConfigError
from kvplane.serving.worker import make_transport
from kvplane.serving.worker_config import WorkerConfig


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_copy_threads_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match="copy_threads must be a positive int"):
        WorkerConfig(name="w", copy_threads=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_serve_flag_sets_the_transports_copy_threads(transport: str) -> None:
    args = build_parser().parse_args(
        ["serve", "prefill", "--transport", transport, "--copy-threads", "3"]
    )
    config = config_of(args)
    assert config.copy_threads == 3
    t = make_transport(config, "w")
    try:
        assert t._copy_workers.threads == 3  # type: ignore[attr-defined]
    finally:
        t.close()


def test_default_copy_threads_follow_torch() -> None:
    config = config_of(build_parser().parse_args(["serve", "decode", "--transport", "tcp"]))
    assert config.copy_threads is None
    t = make_transport(config, "w")
    try:
        assert t._copy_workers.threads == max(1, torch.get_num_threads())  # type: ignore[attr-defined]
    finally:
        t.close()
