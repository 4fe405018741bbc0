"""The cores the connector's own threads run on: every core of the engine, not the model runner's.

vLLM binds its model-runner thread to one core (the CPU worker binds each OpenMP thread to a
core; the NIXL worker pins the runner per NUMA node), and a thread inherits the affinity of the
thread that starts it. Started from ``register_kv_caches``, the PD endpoint, its zmq I/O and
door threads and the transport's threads would all share the runner's core with its spin
loops: a prefill engine then took 15-40 s to answer a decode engine's handshake. Owns
:func:`engine_cpus` and :func:`spread_threads`; moves no thread that already runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["engine_cpus", "spread_threads"]


def _affinity(pid: int) -> set[int]:
    try:
        return set(os.sched_getaffinity(pid))
    except OSError:  # the thread or process ended meanwhile, or it is not ours to read
        return set()


def engine_cpus() -> set[int]:
    """Every core a thread of this process, or its parent (the engine core that started it),
    may run on: the cores vLLM gave this worker, whatever one thread was pinned to."""
    cpus = _affinity(os.getppid())
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            cpus |= _affinity(int(tid))
    return cpus or _affinity(0)


@contextlib.contextmanager
def spread_threads() -> Iterator[set[int]]:
    """Threads started inside the block may run on :func:`engine_cpus` (the calling thread's
    own affinity is restored on exit); yields those cores. Without ``sched_setaffinity``, or
    where the kernel refuses the set, threads keep the caller's affinity."""
    setter = getattr(os, "sched_setaffinity", None)
    before = _affinity(0)
    cpus = engine_cpus()
    if setter is None or not before or cpus == before:
        yield before
        return
    try:
        setter(0, cpus)
    except OSError:
        yield before
        return
    try:
        yield cpus
    finally:
        setter(0, before)
