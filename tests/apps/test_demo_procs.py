"""The demo's process group: workers started together, the first to die named, all stopped."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvplane.apps.demo_procs import ProcessGroup
from kvplane.errors import WorkerDiedError

SMALL = ["--insecure", "--layers", "1", "--latent-dim", "16", "--rope-dim", "8"]


def test_start_together_announces_every_worker_and_stop_ends_them_all(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path)
    try:
        got = group.start_together({"prefill": SMALL, "decode": SMALL}, time.monotonic() + 60)
        assert [(role, info["role"]) for role, info in got.items()] == [
            ("prefill", "prefill"),
            ("decode", "decode"),
        ]
        assert all(child.alive() for child in group.children.values())
    finally:
        group.stop()
    assert [c.proc.returncode for c in group.children.values()] == [0, 0]  # SIGTERM: closed


def test_start_together_names_the_worker_that_died_while_the_other_started(
    tmp_path: Path,
) -> None:
    group = ProcessGroup(tmp_path)
    try:
        with pytest.raises(WorkerDiedError) as err:
            group.start_together(
                {"prefill": SMALL, "decode": [*SMALL, "--num-blocks", "0"]}, time.monotonic() + 60
            )
        assert str(err.value) == (
            f"the decode worker (pid {group.children['decode'].pid}) exited with code 1 while "
            "starting; its log ends:\n"
            "kvplane: error: WorkerConfig.num_blocks must be a positive int, got 0"
        )
        prefill = group.children["prefill"]  # still running: it announces, then is stopped
        assert prefill.announce(time.monotonic() + 60)["role"] == "prefill"
    finally:
        group.stop()
    assert [c.proc.returncode for c in group.children.values()] == [0, 1]
