"""The worker side on vLLM-shaped KV tensors, driven with the scheduler side like vLLM does.

Blocks "computed" by the test hold a deterministic function of their token prefix
(``vllm_testlib.block_content``): every block the connector loads must hold exactly that.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_testlib import MiniEngine, block_content, disk_extra

from kvplane.errors import OffloadError
from kvplane.ids import SlotId
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest
from kvplane.integrations.vllm.wakeup import IDLE_WAIT_S, Wakeup, end_step
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.testing.redis_server import LocalRedisServer, redis_server_support

PROMPT = list(range(1, 22))  # 21 tokens: blocks of 4, chunks of 2 blocks -> 2 chunks offered


def test_second_request_loads_the_stored_prefix_from_host(tmp_path: Path) -> None:
    eng = MiniEngine(disk_extra(tmp_path))
    first = eng.run(PROMPT)
    assert first.loaded == 0
    second = eng.run([*PROMPT[:16], 50, 51, 52])
    assert second.loaded == 16  # two chunks, checked byte for byte by the engine
    assert eng.wmetrics.value("offload_bytes", {"path": "host_to_device"}, "_total") == (
        2 * 2 * eng.pool.bytes_per_block
    )
    eng.close()


def test_a_restarted_engine_loads_from_disk_and_a_corrupt_chunk_is_recomputed(
    tmp_path: Path,
) -> None:
    one = MiniEngine(disk_extra(tmp_path))
    one.run(PROMPT)
    one.close()  # drains: the write-through to disk is complete

    two = MiniEngine(disk_extra(tmp_path))
    assert dict(two.worker.index.tiers)["disk"] != ()
    got = two.run(PROMPT)
    assert got.loaded == 16 and got.failed_blocks == set()
    assert two.metrics.value("vllm_hit_chunks", {"tier": "disk"}, "_total") == 2
    two.close()

    three = MiniEngine(disk_extra(tmp_path))
    disk = three.worker.lower["disk"]
    slot = dict(dict(three.worker.index.tiers)["disk"])
    key1 = sorted(slot, key=lambda k: slot[k])[1]
    with open(disk.path, "r+b") as fh:  # flip a payload byte of the second chunk
        at = slot[key1] * disk.slot_stride + 5
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x40]))
    got = three.run(PROMPT)
    # chunk 0 loaded (checked), chunk 1 failed: its blocks and all after it recomputed
    assert got.loaded == 16
    assert got.failed_blocks == set(got.blocks[2:4])
    assert three.wmetrics.value("vllm_load_error_blocks", suffix="_total") == 2
    assert (
        three.wmetrics.value(
            "offload_corrupt_chunks", {"tier": "disk", "reason": "checksum"}, "_total"
        )
        == 1
    )
    # the recomputed chunk was stored again, so a later request loads both chunks
    again = three.run(PROMPT)
    assert again.loaded == 16 and again.failed_blocks == set()
    three.close()


def _gate_gathers(w: WorkerSide) -> tuple[list[float], Callable[[], None]]:
    """Gathers block until the worker's first ``jobs.wait`` (its timeouts are recorded in the
    returned list); the callable puts the real ``wait`` back."""
    gate, waits = threading.Event(), list[float]()
    gather, wait = w.copier.gather, w.jobs.wait

    def slow_gather(*args: object) -> None:
        gate.wait(30.0)
        gather(*args)  # type: ignore[arg-type]

    def recording_wait(timeout: float) -> object:
        waits.append(timeout)
        gate.set()  # the job finishes while the worker waits for it
        return wait(30.0)

    def restore() -> None:
        w.jobs.wait = wait  # type: ignore[method-assign]

    w.copier.gather = slow_gather  # type: ignore[method-assign]
    w.jobs.wait = recording_wait  # type: ignore[method-assign,assignment]
    return waits, restore


def test_a_reused_block_of_a_finished_request_waits_for_its_gather(tmp_path: Path) -> None:
    eng = MiniEngine(disk_extra(tmp_path), num_blocks=7)  # 6 blocks: the next request reuses them
    waits, restore = _gate_gathers(eng.worker)
    eng.run(PROMPT, req_id="slow")  # finished: its blocks are free, its gather still waits
    assert eng.free == [1, 2, 3, 4, 5, 6] and eng.sched.fenced_blocks == [1, 2, 3, 4]
    other = eng.run([t + 50 for t in PROMPT])  # reuses blocks 1-6: the step flushes first
    assert other.loaded == 0 and waits == [60.0]
    restore()
    eng.settle()
    assert eng.sched.fenced_blocks == []
    again = eng.run(PROMPT)  # what "slow" stored was read before the blocks were overwritten
    assert again.loaded == 16 and again.failed_blocks == set()
    eng.close()


class RecordingWakeup(Wakeup):
    """Records each idle wait's timeout and runs ``on_wait`` (the job it waits for ends)."""

    def __init__(self, on_wait: Callable[[], None]) -> None:
        super().__init__()
        self.waits: list[float] = []
        self.on_wait = on_wait

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.on_wait()
        return super().wait(30.0)


def test_an_idle_step_waits_for_an_in_flight_gather_instead_of_spinning(tmp_path: Path) -> None:
    eng = MiniEngine(disk_extra(tmp_path))
    w = eng.worker
    gate = threading.Event()
    gather = w.copier.gather

    def slow_gather(*args: object) -> None:
        gate.wait(30.0)
        gather(*args)  # type: ignore[arg-type]

    w.copier.gather = slow_gather  # type: ignore[method-assign]
    w.wake = wake = RecordingWakeup(gate.set)
    eng.run(PROMPT, req_id="slow")
    assert w.busy and eng.sched.fenced_blocks == [1, 2, 3, 4]
    assert end_step([w], [], False, wake) == (set(), set())
    assert wake.waits == []  # a busy step never waits
    assert end_step([w], [], True, wake) == (set(), set())
    assert wake.waits == [IDLE_WAIT_S]  # woken by the gather's end, which is harvested
    assert w.has_news
    assert end_step([w], [], True, wake) == (set(), set())
    assert wake.waits == [IDLE_WAIT_S]  # news to hand over: no wait
    report = w.take_report()
    assert [(r.job_id, r.tier) for r in report.jobs][:1] == [(1, "host")]
    eng.sched.apply(report)
    assert eng.sched.fenced_blocks == []
    eng.settle()
    assert not w.busy and not w.has_news
    end_step([w], [], True, wake)
    assert wake.waits == [IDLE_WAIT_S]  # nothing in flight: no wait
    eng.close()


def test_host_slots_are_reused_after_eviction(tmp_path: Path) -> None:
    eng = MiniEngine(disk_extra(tmp_path, host_slots=2, disk_slots=3))
    for base in (100, 200, 300):
        eng.run([base + i for i in range(17)])
        eng.settle()  # the write-through lands: host copies are unpinned, hence evictable
    assert eng.metrics.value("offload_evictions", {"tier": "host"}, "_total") == 4
    assert eng.metrics.value("offload_evictions", {"tier": "disk"}, "_total") == 3
    got = eng.run([300 + i for i in range(17)])
    assert got.loaded == 16
    assert eng.worker.host.slot(SlotId(0)).numel() == 2 * eng.pool.bytes_per_block
    eng.close()


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 14), st.integers(0, 3)),
        min_size=1,
        max_size=7,
    ),
    host_slots=st.integers(1, 6),
    with_disk=st.booleans(),
)
def test_any_request_sequence_loads_only_correct_kv(
    tmp_path_factory: object,
    requests: list[tuple[int, int, int]],
    host_slots: int,
    with_disk: bool,
) -> None:
    """Shared prefixes, tight host tiers, evictions and restarts: every loaded block holds the
    KV of its own token prefix, and the engine ends balanced (no busy slot, no leaked block)."""
    tmp = tmp_path_factory.mktemp("prop")  # type: ignore[attr-defined]
    cfg = {"blocks_per_chunk": 2, "host_slots": host_slots}
    if with_disk:
        cfg.update(disk_path=str(tmp / "c.bin"), disk_slots=4, disk_direct_io=False)
    eng = MiniEngine(cfg)
    prefixes = [[7] * 12, [7] * 8 + [9] * 4, list(range(30, 42))]
    for prefix, extra_len, restart in requests:
        tokens = prefixes[prefix] + [60 + i for i in range(extra_len)]
        got = eng.run(tokens)
        assert got.loaded % 8 == 0 and got.loaded < len(tokens)
        if with_disk and restart == 3:
            eng.close()
            eng = MiniEngine(cfg)
    eng.close()


def test_remote_tier_serves_a_restarted_engine(tmp_path: Path) -> None:
    """Write-through to Redis; an engine without the disk file loads the chunks from Redis."""
    url = os.environ.get("KVPLANE_TEST_REDIS_URL")
    server = None
    if url is None:
        reason = redis_server_support()
        if reason is not None:
            pytest.skip(reason)
        server = LocalRedisServer()
        url = server.url
    try:
        ns = f"vllm-test-{os.getpid()}-{tmp_path.name}"
        cfg = {"blocks_per_chunk": 2, "host_slots": 8, "remote_url": url, "remote_namespace": ns}
        one = MiniEngine(cfg)
        one.run(PROMPT)
        one.close()
        two = MiniEngine(cfg)
        got = two.run(PROMPT)
        assert got.loaded == 16 and got.failed_blocks == set()
        assert two.metrics.value("vllm_hit_chunks", {"tier": "remote"}, "_total") == 2
        # a second live engine on the same namespace would overwrite two's slots: refused
        with pytest.raises(
            OffloadError, match=f"namespace '{ns}' is in use by .*pid {os.getpid()}"
        ):
            MiniEngine({**cfg, "remote_lease_s": 0.2, "remote_timeout_s": 0.1})
        two.close()
    finally:
        if server is not None:
            server.stop()


def test_a_flush_finishes_in_flight_gathers_before_the_forward(tmp_path: Path) -> None:
    eng = MiniEngine(disk_extra(tmp_path))
    view = RequestView("p", PROMPT)
    blocks = eng.free[:6]
    eng.free = eng.free[6:]
    assert eng.sched.matched_tokens(view, 0) == 0
    eng.sched.allocated(view, blocks, 0)
    meta = eng.step([ScheduledRequest(view, len(PROMPT), blocks)])
    for i, b in enumerate(blocks):
        eng.layout_view()[b] = block_content(PROMPT, i, 4, eng.block_shape())
    eng.worker.submit_stores(meta)  # the gather of 2 chunks is now in flight
    flush = eng.sched.build_step([], preempted=["p"])
    assert flush.flush is True
    eng.worker.begin_step(flush)  # vLLM may reuse p's blocks in this step's forward
    report = eng.worker.take_report()
    assert (meta.stores[0].job_id, "host", (True, True)) in [
        (j.job_id, j.tier, j.ok) for j in report.jobs
    ]
    eng.sched.apply(report)
    eng.free.extend(blocks)  # preempted: vLLM freed the blocks
    for b in blocks:
        eng.layout_view()[b] = 0.0
    again = eng.run(PROMPT)
    assert again.loaded == 16  # what was gathered before the flush is intact
    eng.close()


def test_a_lossless_disk_codec_restores_the_exact_kv_after_a_restart(tmp_path: Path) -> None:
    """The worker opens its disk tier with the pool's layout, so a configured codec codes
    chunks; a restarted engine loads them back byte for byte (the run checks every block)."""
    pytest.importorskip("zstandard")
    one = MiniEngine(disk_extra(tmp_path, disk_codec="zstd"))
    one.run(PROMPT)
    one.close()
    two = MiniEngine(disk_extra(tmp_path, disk_codec="zstd"))
    got = two.run(PROMPT)
    assert got.loaded == 16 and got.failed_blocks == set()
    assert two.metrics.value("vllm_hit_chunks", {"tier": "disk"}, "_total") == 2
    two.close()
    raw = MiniEngine(disk_extra(tmp_path))  # another codec: the chunks are misses, not garbage
    assert raw.run(PROMPT).loaded == 0
    raw.close()
