"""Start-up checks of ``kvplane serve``: the KV pool against the cgroup's memory limit (fake
cgroup trees), and the secret's environment variable removed once read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvplane.apps.serve import secret_of
from kvplane.apps.startup import (
    cgroup_memory_limit,
    check_pool_memory,
    host_memory_bytes,
    scrub_secret_env,
    usable_memory_bytes,
)
from kvplane.cli import build_parser
from kvplane.config import SECRET_ENV
from kvplane.errors import ConfigError

MIB = 1 << 20
SECRET = "s" * 32


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_lowest_v2_limit_on_the_process_path_is_the_pool_bound(tmp_path: Path) -> None:
    proc = _tree(tmp_path, {"self-cgroup": "0::/a/b\n"}) / "self-cgroup"
    root = _tree(
        tmp_path / "cg",
        {"memory.max": "max\n", "a/memory.max": f"{2 * MIB}\n", "a/b/memory.max": "max\n"},
    )
    assert cgroup_memory_limit(root, proc) == 2 * MIB
    assert usable_memory_bytes(root, proc) == (2 * MIB, "its cgroup's limit")
    check_pool_memory("--num-blocks 8", MIB, root, proc)  # fits
    want = (
        f"--num-blocks 9 needs a KV pool of {3 * MIB} bytes, more than the {2 * MIB} bytes of "
        "memory this process may use (its cgroup's limit)"
    )
    with pytest.raises(ConfigError) as err:
        check_pool_memory("--num-blocks 9", 3 * MIB, root, proc)
    assert str(err.value) == want


def test_a_v1_memory_limit_is_read_where_the_group_is_mounted(tmp_path: Path) -> None:
    # a container shows its own group as the mount's root: the listed path is not mounted
    proc = _tree(tmp_path, {"self-cgroup": "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n"})
    root = _tree(tmp_path / "cg", {"memory/memory.limit_in_bytes": f"{MIB}\n"})
    assert cgroup_memory_limit(root, proc / "self-cgroup") == MIB
    with pytest.raises(ConfigError, match="its cgroup's limit"):
        check_pool_memory("pool", MIB + 1, root, proc / "self-cgroup")


def test_no_cgroup_or_an_unlimited_one_leaves_the_host_memory(tmp_path: Path) -> None:
    assert cgroup_memory_limit(tmp_path / "none", tmp_path / "missing") is None
    unlimited = _tree(tmp_path / "cg", {"memory/memory.limit_in_bytes": "9223372036854771712"})
    assert cgroup_memory_limit(unlimited, tmp_path / "missing") == 9223372036854771712
    host = host_memory_bytes()
    assert usable_memory_bytes(unlimited, tmp_path / "missing") == (host, "this host's")
    with pytest.raises(ConfigError, match=rf"more than the {host} bytes .* \(this host's\)"):
        check_pool_memory("pool", host + 1, unlimited, tmp_path / "missing")


def test_the_secret_variable_is_gone_for_children_once_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    args = build_parser().parse_args(["serve", "decode"])
    assert secret_of(args) == SECRET.encode()
    assert SECRET_ENV not in os.environ
    child = subprocess.run(
        [sys.executable, "-c", f"import os; print(os.environ.get({SECRET_ENV!r}))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert child.stdout.strip() == "None"
    assert secret_of(args) == SECRET.encode()  # read once, kept in the parsed flags
    assert not scrub_secret_env(os.environ)  # nothing left to remove


def test_a_secret_file_wins_and_the_variable_still_leaves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    key = tmp_path / "k"
    key.write_text("f" * 32 + "\n")
    monkeypatch.setenv(SECRET_ENV, SECRET)
    args = build_parser().parse_args(["serve", "decode", "--secret-file", str(key)])
    assert secret_of(args) == b"f" * 32
    assert SECRET_ENV not in os.environ
