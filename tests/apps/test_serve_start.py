"""``kvplane serve`` start-up as a user runs it: secure by default, config as documented, and
bad input refused in one line (exit 1) before anything starts -- against real processes."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from kvplane.apps.serve import DISK_SLOT_FILE, offload_of
from kvplane.apps.serve_config import settle
from kvplane.cli import build_parser
from kvplane.config import SECRET_ENV
from kvplane.errors import ConfigError
from kvplane.serving.messages import Generate, InfoQuery, RequestResult, WorkerInfo
from kvplane.serving.router.router import Router
from kvplane.serving.rpc import RpcClient
from kvplane.testing.cluster import TEST_SECRET, Proc, child_env, free_port, wait_for

SMALL = ["--layers", "1", "--latent-dim", "16", "--rope-dim", "8"]


def _metrics(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


@dataclass(frozen=True)
class Insecure:
    """An insecure prefill and decode worker; the decode worker's ``/metrics`` port."""

    prefill: Proc
    decode: Proc
    decode_metrics: int


@pytest.fixture(scope="module")
def insecure(
    start_procs: Callable[..., list[Proc]], stop_procs: Callable[[Sequence[Proc]], None]
) -> Iterator[Insecure]:
    """Both ``--insecure`` workers, started at once, for the two insecure-mode tests."""
    port = free_port()
    started: list[Proc] = []
    try:
        pre, dec = start_procs(
            started,
            partial(Proc, "prefill", [*SMALL, "--insecure"], secret=None),
            partial(Proc, "decode", [*SMALL, "--insecure", "--metrics-port", str(port)],
                    secret=None),
        )  # fmt: skip
        yield Insecure(pre, dec, port)
    finally:
        stop_procs(started)


def test_insecure_mode_is_explicit_and_says_so_in_the_log_and_metrics(insecure: Insecure) -> None:
    assert insecure.decode.proc.stderr is not None
    warning = insecure.decode.proc.stderr.readline()
    assert "--insecure" in warning and "any local process" in warning
    assert "kvplane_insecure 1.0" in _metrics(insecure.decode_metrics)


def test_an_insecure_router_says_so_in_its_metrics(procs: list[Proc], insecure: Insecure) -> None:
    port = free_port()
    flags = ["--prefill", insecure.prefill.control, "--decode", insecure.decode.control]
    router = Proc("router", [*flags, "--insecure", "--metrics-port", str(port)], secret=None)
    procs.append(router)
    client = RpcClient(router.control, timeout_s=20)  # no secret: the router runs insecure
    try:
        got = client.call(Generate(request_id="r", token_ids=tuple(range(40))))
        assert isinstance(got, RequestResult) and got.state == "success"
    finally:
        client.close()
    assert "kvplane_insecure 1.0" in _metrics(port)


def test_a_prompt_larger_than_the_host_tier_is_counted_and_logged(
    procs: list[Proc], start_procs: Callable[..., list[Proc]]
) -> None:
    port = free_port()
    offload = ["--offload-host-slots", "1", "--blocks-per-chunk", "1", "--metrics-port", str(port)]
    pre, dec = start_procs(
        procs, partial(Proc, "prefill", [*SMALL, *offload]), partial(Proc, "decode", SMALL)
    )
    router = Router([pre.control], [dec.control], timeout_s=20, secret=TEST_SECRET)
    try:
        router.connect()
        for i in range(2):  # 70 tokens: 4 full chunks of one 16-token block, one host slot
            assert router.generate(f"r{i}", list(range(i, 70 + i))).state == "success"
        counter = "kvplane_prefill_prefix_chunks_unstored_total 6.0"
        wait_for(lambda: counter in _metrics(port), what="the unstored chunks counted")
    finally:
        router.close()
    pre.stop()
    assert pre.proc.stderr is not None
    told = [line for line in pre.proc.stderr.read().splitlines() if "exceeds the host" in line]
    assert len(told) == 1  # logged once


def test_a_secret_from_the_environment_leaves_it_with_a_warning(procs: list[Proc]) -> None:
    """Issue 27 leftover: ``KVPLANE_SECRET`` stayed readable in ``/proc/PID/environ`` by any
    process of the same user, and was inherited by every child, with nothing said."""
    p = Proc("decode", SMALL)  # the secret comes in KVPLANE_SECRET
    procs.append(p)
    environ = Path(f"/proc/{p.proc.pid}/environ").read_bytes()
    assert TEST_SECRET not in environ
    assert p.proc.stderr is not None
    warning = p.proc.stderr.readline()
    assert "$KVPLANE_SECRET" in warning and "prefer --secret-file" in warning
    client = RpcClient(p.control, timeout_s=20, secret=TEST_SECRET)  # it still holds it
    try:
        assert isinstance(client.call(InfoQuery()), WorkerInfo)
    finally:
        client.close()


def test_a_secret_file_and_a_config_file_with_env_over_file(
    procs: list[Proc], tmp_path: Path
) -> None:
    key = tmp_path / "kvplane.key"
    key.write_text(TEST_SECRET.decode() + "\n")
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(
        f'[worker]\nname = "from-file"\nmetrics_port = {port}\n[pool]\nblock_size = 8\n'
    )
    p = Proc(
        "decode", [*SMALL, "--secret-file", str(key), "--config", str(config)], secret=None,
        env={"KVPLANE_WORKER_NAME": "from-env"},
    )  # fmt: skip
    procs.append(p)
    assert p.info["name"] == "from-env"  # environment over file
    assert "kvplane_insecure 0.0" in _metrics(port)  # the file's metrics port, a secret


Case = tuple[list[str], dict[str, str], bytes | None, str]
"""``kvplane serve`` flags, environment on top, the secret in ``KVPLANE_SECRET`` (``None``:
none) and what the one error line must say."""


class _StartedError(Exception):
    """Raised in place of the start-up warning: every check passed and serving would begin."""


def _bad_cases(tmp_path: Path, busy_port: int) -> list[Case]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    short = tmp_path / "short.key"
    short.write_text("abc")
    ok = "tcp://127.0.0.1:5"
    return [
        (["decode", "--control", "tcp://192.0.2.1:5555"], {}, TEST_SECRET, "cannot be bound"),
        (["decode", "--metrics-port", str(busy_port)], {}, TEST_SECRET, "in use"),
        (["router", "--prefill", "garbage", "--decode", ok], {}, TEST_SECRET, "--prefill must"),
        (["prefill", "--compute-ms-per-step", "inf"], {}, TEST_SECRET, "compute_s_per_step"),
        (["prefill", "--compute-ms-per-step", "nan"], {}, TEST_SECRET, "compute_s_per_step"),
        (["decode", "--pd", "tcp://127.0.0.1:99999"], {}, TEST_SECRET, "pd_bind's port"),
        (["decode", "--metrics-port", "70000"], {}, TEST_SECRET, "metrics_port"),
        (["decode"], {"KVPLANE_POOL_NUM_BLOCKS": "-3"}, TEST_SECRET, "num_blocks"),
        (["decode"], {"KVPLANE_POOL_BLOCK_SIZE": "x"}, TEST_SECRET, "KVPLANE_POOL_BLOCK_SIZE"),
        (["decode"], {"KVPLANE_WORKER_FIRST_BYTE_TIMEOUT": "nan"}, TEST_SECRET,
         "first_byte_timeout_s"),
        (["decode", "--config", str(tmp_path)], {}, TEST_SECRET, "is a directory"),
        (["decode"], {}, None, "no secret"),
        (["router", "--prefill", ok, "--decode", ok], {}, None, "no secret"),
        (["decode", "--secret-file", str(short)], {}, None, "at least 16 bytes"),
        (["decode", "--transport", "nixl"], {}, TEST_SECRET, "cannot authenticate"),
        (["prefill", "--offload-host-slots", "2", "--offload-disk", str(a_file)], {},
         TEST_SECRET, "must be a directory"),
    ]  # fmt: skip


def _check_refused(case: Case, code: int, out: str, err: str) -> None:
    argv, _env, _secret, want = case
    lines = err.strip().splitlines()
    assert (code, out) == (1, ""), f"{argv}: {code} {err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("kvplane: error: "), (argv, err)
    assert want in lines[0], (argv, lines[0])


def test_bad_input_is_one_line_and_exit_1_from_a_real_process() -> None:
    """The process path once: exit status 1, nothing on stdout, one line on stderr (the other
    refusals run in-process below, through the same ``main``)."""
    case: Case = (["decode", "--num-blocks", "1000000000000"], {}, TEST_SECRET, "KV pool of")
    _check_refused(case, *_refusal(case))


def test_bad_input_is_one_line_and_exit_1_before_anything_starts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each bad flag, variable or file through ``kvplane.cli.main`` as ``python -m kvplane``
    runs it: ``main`` returns 1 with one ``kvplane: error:`` line on stderr, nothing on stdout
    and no warning logged (a process would print it on stderr too), before the start-up
    warning that follows every check (made to raise here: a case that starts fails)."""
    from kvplane.apps import serve
    from kvplane.cli import main

    def started(args: object) -> None:
        raise _StartedError

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        for case in _bad_cases(tmp_path, busy.getsockname()[1]):
            argv, env, secret, _want = case
            small = [] if argv[0] == "router" else SMALL
            caplog.clear()
            with monkeypatch.context() as mp:
                mp.setattr(serve, "_warn_at_start", started)
                mp.delenv(SECRET_ENV, raising=False)
                if secret is not None:
                    mp.setenv(SECRET_ENV, secret.decode())
                for name, value in env.items():
                    mp.setenv(name, value)
                code = main(["serve", argv[0], *small, *argv[1:]])
            out, err = capsys.readouterr()
            _check_refused(case, code, out, err)
            assert [r for r in caplog.records if r.levelno >= logging.WARNING] == [], argv
    finally:
        busy.close()


def _refusal(case: Case) -> tuple[int, str, str]:
    """Run ``kvplane serve`` with ``case``'s flags, environment and secret; its exit code,
    stdout and stderr (-1 when it was still running after 120 s: it started instead)."""
    argv, env, secret, _want = case
    small = [] if argv[0] == "router" else SMALL
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplane", "serve", argv[0], *small, *argv[1:]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**child_env(secret), **env},
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -1, out, err
    return proc.returncode, out, err


def _args(*argv: str) -> object:
    return build_parser().parse_args(["serve", *argv])


def test_precedence_flag_over_env_over_file_over_default(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[pool]\nnum_blocks = 64\nblock_size = 32\n[pd]\nlease = 9.0\n")
    env = {"KVPLANE_POOL_NUM_BLOCKS": "48", "KVPLANE_PD_HEARTBEAT": "2"}
    args = settle(_args("decode", "--config", str(path), "--num-blocks", "16"), env)  # type: ignore[arg-type]
    assert (args.num_blocks, args.block_size, args.lease, args.heartbeat) == (16, 32, 9.0, 2.0)
    args = settle(_args("decode", "--config", str(path)), env)  # type: ignore[arg-type]
    assert (args.num_blocks, args.block_size) == (48, 32)
    args = settle(_args("decode"), {})  # type: ignore[arg-type]
    assert (args.num_blocks, args.block_size, args.lease, args.layer_ops) == (512, 16, 5.0, False)
    args = settle(_args("router"), {"KVPLANE_ROUTER_PREFILL": "tcp://a:1, tcp://b:2"})  # type: ignore[arg-type]
    assert args.prefill == ["tcp://a:1", "tcp://b:2"] and args.decode == []


@pytest.mark.parametrize(
    ("text", "env", "match"),
    [
        ("[pool]\nnum_block = 3\n", {}, r"unknown key\(s\) \['num_block'\]"),
        ("[poool]\n", {}, r"unknown section\(s\) \['poool'\]"),
        ("", {"KVPLANE_SYNTHETIC_LAYOUT": "xyz"}, r"\[synthetic\] layout must be one of"),
        ("[pool]\nnum_blocks = 1.5\n", {}, r"\[pool\]\.num_blocks: expected int"),
    ],
)
def test_bad_config_values_name_the_field(
    tmp_path: Path, text: str, env: dict[str, str], match: str
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        settle(_args("prefill", "--config", str(path)), env)  # type: ignore[arg-type]


def test_offload_disk_is_a_directory_holding_the_slot_file(tmp_path: Path) -> None:
    where = tmp_path / "tiers" / "disk"
    args = _args("prefill", "--offload-host-slots", "2", "--offload-disk", str(where))
    settings = offload_of(args)  # type: ignore[arg-type]
    assert settings is not None and settings.offload.disk_path == where / DISK_SLOT_FILE
    assert where.is_dir()


def test_offload_codec_flags_reach_the_tiers_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    where = tmp_path / "disk"
    args = _args(
        "prefill", "--offload-host-slots", "2", "--offload-disk", str(where),
        "--offload-disk-codec", "zstd", "--offload-remote-codec", "int8",
    )  # fmt: skip
    settings = offload_of(args)  # type: ignore[arg-type]
    assert settings is not None
    assert (settings.offload.disk_codec, settings.offload.remote_codec) == ("zstd", "int8")
    plain = offload_of(_args("prefill", "--offload-host-slots", "2"))  # type: ignore[arg-type]
    assert plain is not None and (plain.offload.disk_codec, plain.offload.remote_codec) == (
        "raw",
        "raw",
    )
    bad = _args("prefill", "--offload-host-slots", "2", "--offload-disk-codec", "gzip")
    with pytest.raises(ConfigError, match=r"OffloadConfig.disk_codec 'gzip' is not one of"):
        offload_of(bad)  # type: ignore[arg-type]
