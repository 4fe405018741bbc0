"""``pd_pinning``: which rank worker threads go back to their rank's cores, and finding the
rank workers. The core choice is a pure function; the process part runs on real children
whose command lines carry vLLM's rank worker titles."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvplane.errors import ConfigError
from kvplane.integrations.vllm.pd_pinning import (
    child_pids,
    pin_rank_workers,
    rank_of,
    rank_runs,
    repin_to,
)

CPUS = sorted(os.sched_getaffinity(0))


def test_rank_runs_read_vllms_core_lists() -> None:
    assert rank_runs("0|1") == [{0}, {1}]
    assert rank_runs("0-3|4-7") == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert rank_runs("0,2|1,3") == [{0, 2}, {1, 3}]
    assert rank_runs("5") == [{5}]
    for bad in ("auto", "nobind", "0|", "3-1|4", "0-|1", "a|b"):
        with pytest.raises(ConfigError, match="not core lists"):
            rank_runs(bad)


def test_only_a_thread_holding_no_core_of_its_rank_moves_onto_the_run() -> None:
    """NIXL's runner moved to the node's last core (rank 0 of "0|1" onto core 1) goes back;
    vLLM's per-core OpenMP binds and kvplane's threads spread over the engine stay."""
    assert repin_to({1}, {0}) == {0}  # rank 0's runner, moved by NIXL
    assert repin_to({1}, {1}) is None  # rank 1's runner: the last core is its own
    assert repin_to({0, 1}, {0}) is None  # kvplane's spread threads (affinity.spread_threads)
    assert repin_to({2}, {0, 1, 2, 3}) is None  # an OpenMP thread bound to one core of its run
    assert repin_to({7}, {0, 1, 2, 3}) == {0, 1, 2, 3}  # "0-3|4-7": moved to node 0's last core


SLEEP = "import time; time.sleep(30)"


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Two children whose command lines say ``VLLM::Worker_TP1`` and ``VLLM::Worker_TP0`` (as
    vLLM's title does) and one other, each started pinned to the last core (as NIXL leaves a
    runner)."""
    last = str(CPUS[-1])
    procs = [
        subprocess.Popen(["taskset", "-c", last, sys.executable, "-c", SLEEP, title])
        for title in ("VLLM::Worker_TP1", "VLLM::Worker_TP0", "other")
    ]
    deadline = time.monotonic() + 20.0
    while [rank_of(p.pid) for p in procs] != [1, 0, None]:  # taskset exec'd python
        assert time.monotonic() < deadline, "the children never started"
        time.sleep(0.02)
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two cores: a run per rank")
def test_pin_rank_workers_moves_each_ranks_threads_onto_its_run_and_nothing_else(
    workers: list[subprocess.Popen[bytes]],
) -> None:
    tp1, tp0, other = workers
    assert child_pids(os.getpid()) == sorted(p.pid for p in workers)
    assert [rank_of(p.pid) for p in workers] == [1, 0, None]
    binds = f"{CPUS[0]}|{CPUS[-1]}"
    got = pin_rank_workers(binds)
    assert got["rank_cores"] == [[CPUS[0]], [CPUS[-1]]]
    assert got["workers"] == {
        "0": {"pid": tp0.pid, "threads_repinned": 1, "moved_from": [[CPUS[-1]]]},
        "1": {"pid": tp1.pid, "threads_repinned": 0, "moved_from": []},
    }
    assert os.sched_getaffinity(tp0.pid) == {CPUS[0]}
    assert os.sched_getaffinity(tp1.pid) == {CPUS[-1]}
    assert os.sched_getaffinity(other.pid) == {CPUS[-1]}  # not a rank worker: left alone
    again = pin_rank_workers(binds)["workers"]
    assert [again[r]["threads_repinned"] for r in ("0", "1")] == [0, 0]
