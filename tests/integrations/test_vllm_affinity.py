"""``spread_threads``: a thread started from a pinned thread runs on every core of the engine."""

from __future__ import annotations

import os
import threading

import pytest

from kvplane.integrations.vllm.affinity import engine_cpus, spread_threads

CPUS = sorted(os.sched_getaffinity(0))


def _started_thread_affinity() -> set[int]:
    got: list[set[int]] = []
    t = threading.Thread(target=lambda: got.append(set(os.sched_getaffinity(0))))
    t.start()
    t.join()
    return got[0]


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two cores to pin one thread to one of them")
def test_a_thread_started_from_a_pinned_thread_gets_every_engine_core() -> None:
    everything = set(CPUS)
    os.sched_setaffinity(0, {CPUS[0]})  # as vLLM pins its model-runner thread
    try:
        assert engine_cpus() >= everything  # the parent process still has every core
        assert _started_thread_affinity() == {CPUS[0]}  # what the connector's threads inherited
        with spread_threads() as cpus:
            assert cpus == engine_cpus()
            assert _started_thread_affinity() == cpus
        assert os.sched_getaffinity(0) == {CPUS[0]}  # the caller's own affinity is restored
    finally:
        os.sched_setaffinity(0, everything)


def test_an_unpinned_caller_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    with spread_threads() as cpus:
        assert cpus == before or cpus == engine_cpus()
        assert _started_thread_affinity() == cpus
    assert os.sched_getaffinity(0) == before
