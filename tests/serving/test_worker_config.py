"""WorkerConfig: copy threads are validated and reach the transport `kvplane serve` builds; a
secret is required unless insecure mode is explicit; a data plane that cannot prove the secret
is refused with one; addresses and ports are in range."""

from __future__ import annotations

import pytest
import torch

from kvplane.apps.serve import config_of
from kvplane.cli import build_parser
from kvplane.errors import ConfigError
from kvplane.serving.worker import make_transport
from kvplane.serving.worker_config import WorkerConfig

KEY = b"k" * 32


@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_copy_threads_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError) as caught:
        WorkerConfig(name="w", copy_threads=bad, secret=KEY)  # type: ignore[arg-type]
    assert str(caught.value) == f"WorkerConfig.copy_threads must be a positive int, got {bad!r}"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_slots", 0, "WorkerConfig.num_slots must be a positive int, got 0"),
        ("step_size", 2.0, "WorkerConfig.step_size must be a positive int, got 2.0"),
        ("hash_seed", -1, "WorkerConfig.hash_seed must be an int >= 0, got -1"),
        ("incarnation", True, "WorkerConfig.incarnation must be an int >= 0, got True"),
        ("metrics_port", -1, "WorkerConfig.metrics_port must be an int in [0, 65535], got -1"),
        ("pipelined", 1, "WorkerConfig.pipelined must be a bool, got 1"),
        ("insecure", "yes", "WorkerConfig.insecure must be a bool, got 'yes'"),
    ],
)
def test_counts_seeds_and_switches_name_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        WorkerConfig(name="w", secret=KEY, **{field: value})  # type: ignore[arg-type]
    assert str(caught.value) == message


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_serve_flag_sets_the_transports_copy_threads(transport: str) -> None:
    args = build_parser().parse_args(
        ["serve", "prefill", "--transport", transport, "--copy-threads", "3", "--insecure"]
    )
    config = config_of(args)
    assert config.copy_threads == 3
    t = make_transport(config, "w")
    try:
        assert t._copy_workers.threads == 3  # type: ignore[attr-defined]
    finally:
        t.close()


def test_default_copy_threads_follow_torch() -> None:
    args = ["serve", "decode", "--transport", "tcp", "--insecure"]
    config = config_of(build_parser().parse_args(args))
    assert config.copy_threads is None
    t = make_transport(config, "w")
    try:
        assert t._copy_workers.threads == max(1, torch.get_num_threads())  # type: ignore[attr-defined]
    finally:
        t.close()


def test_a_secret_is_required_unless_insecure_is_explicit() -> None:
    with pytest.raises(ConfigError, match=r"secret is required .*insecure=True"):
        WorkerConfig(name="w")
    assert WorkerConfig(name="w", insecure=True).secret is None
    assert WorkerConfig(name="w", secret=KEY).insecure is False
    with pytest.raises(ConfigError, match="contradicts a secret"):
        WorkerConfig(name="w", secret=KEY, insecure=True)
    with pytest.raises(ConfigError, match="insecure must be a bool"):
        WorkerConfig(name="w", insecure=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
def test_a_data_plane_that_cannot_authenticate_is_refused_with_a_secret(transport: str) -> None:
    with pytest.raises(ConfigError, match=f"transport '{transport}' cannot authenticate"):
        WorkerConfig(name="w", transport=transport, secret=KEY)
    assert WorkerConfig(name="w", transport=transport, insecure=True).transport == transport


def test_the_secret_reaches_the_tcp_data_plane() -> None:
    t = make_transport(WorkerConfig(name="w", secret=KEY), "w")
    try:
        assert t._secret == KEY  # type: ignore[attr-defined]
    finally:
        t.close()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("pd_bind", "tcp://127.0.0.1:99999", r"pd_bind's port must be an int in \[0, 65535\]"),
        ("control_bind", "tcp://127.0.0.1:-1", "control_bind must be tcp://HOST:PORT"),
        ("control_bind", "tcp://:5", "control_bind must be tcp://HOST:PORT"),
        ("control_bind", "udp://127.0.0.1:5", "must be a tcp://, ipc:// or inproc://"),
        ("metrics_port", 65536, r"metrics_port must be an int in \[0, 65535\]"),
    ],
)
def test_addresses_and_ports_out_of_range_are_refused(
    field: str, value: object, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        WorkerConfig(name="w", secret=KEY, **{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_first_byte_timeout_comes_from_flag_env_or_file_and_reaches_the_data_plane(
    transport: str, tmp_path, monkeypatch
) -> None:
    """Before, ``first_byte_timeout_s`` of the data plane had no flag and no config field: 1 s
    whatever the operator said. Now ``--first-byte-timeout`` is ``[worker] first_byte_timeout``
    and ``KVPLANE_WORKER_FIRST_BYTE_TIMEOUT``, through the same resolver (flag > env > file)."""
    path = tmp_path / "serve.toml"
    path.write_text("[worker]\nfirst_byte_timeout = 0.5\n")
    base = ["serve", "decode", "--transport", transport, "--insecure"]
    env = "KVPLANE_WORKER_FIRST_BYTE_TIMEOUT"
    cases: list[tuple[list[str], str | None, float]] = [
        ([], None, 1.0),
        (["--config", str(path)], None, 0.5),
        (["--config", str(path)], "0.25", 0.25),
        (["--config", str(path), "--first-byte-timeout", "2"], "0.25", 2.0),
    ]
    for extra, value, want in cases:
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
        config = config_of(build_parser().parse_args(base + extra))
        assert config.first_byte_timeout_s == want
        t = make_transport(config, "w")
        try:
            assert t.limits.first_byte_timeout_s == want  # type: ignore[attr-defined]
        finally:
            t.close()


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_a_first_byte_timeout_that_is_not_finite_and_positive_names_the_field(bad: str) -> None:
    args = ["serve", "prefill", "--insecure", f"--first-byte-timeout={bad}"]
    with pytest.raises(ConfigError, match="first_byte_timeout_s"):
        config_of(build_parser().parse_args(args))
