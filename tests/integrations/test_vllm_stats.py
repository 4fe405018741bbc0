"""kvplane's counters as vLLM connector stats: exact deltas per side, sums and the log line."""

from __future__ import annotations

from pathlib import Path

from vllm_testlib import MiniEngine, disk_extra

from kvplane.integrations.vllm.stats import STATS, StatsTaker, merge, summary

PROMPT = list(range(1, 22))  # 21 tokens: blocks of 4, chunks of 2 blocks -> 2 chunks stored


def _taken(taker: StatsTaker) -> dict[str, float]:
    got = taker.take()
    got.pop("fenced_frees", None)  # 1 or 0: whether the gather was still running at the finish
    return got


def test_stats_are_each_sides_growth_since_its_last_take(tmp_path: Path) -> None:
    eng = MiniEngine(disk_extra(tmp_path))
    sched, work = StatsTaker(eng.metrics, "scheduler"), StatsTaker(eng.wmetrics, "worker")
    assert sched.take() == {} and work.take() == {}
    chunk = float(eng.worker.host.chunk_bytes)
    eng.run(PROMPT)
    eng.settle()
    assert _taken(sched) == {"query_tokens": 21.0, "stored_chunks": 2.0}
    assert work.take() == {"bytes_stored": 2 * chunk, "bytes_to_disk": 2 * chunk}
    assert _taken(sched) == {} and work.take() == {}  # nothing grew since
    eng.run(PROMPT)
    eng.settle()
    assert _taken(sched) == {"query_tokens": 21.0, "hit_tokens": 16.0, "hit_chunks_host": 2.0}
    got = work.take()
    assert got["bytes_loaded"] == 2 * chunk and set(got) == {"bytes_loaded", "load_wait_seconds"}
    eng.close()


def test_merge_sums_key_wise_and_summary_lists_every_stat() -> None:
    a = {"query_tokens": 20.0, "hit_tokens": 5.0}
    b = {"hit_tokens": 3.0, "load_wait_seconds": 0.0012345}
    both = merge(a, b)
    assert both == {"query_tokens": 20.0, "hit_tokens": 8.0, "load_wait_seconds": 0.0012345}
    line = summary(both)
    assert list(line) == [s.key for s in STATS] + ["hit_rate"]
    assert line["query_tokens"] == 20 and line["hit_tokens"] == 8 and line["bytes_loaded"] == 0
    assert line["load_wait_seconds"] == 0.001 and line["hit_rate"] == 0.4
    assert "hit_rate" not in summary({})


def test_stat_keys_are_unique() -> None:
    keys = [s.key for s in STATS]
    assert len(keys) == len(set(keys))
