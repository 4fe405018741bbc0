"""The worker side on vLLM-shaped KV tensors, driven with the scheduler side like vLLM does.

Blocks "computed" by the test hold a deterministic function of their token prefix
(``vllm_testlib.block_content``): every block the connector loads must hold exactly that.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm_testlib import MiniEngine, block_content

from kvplane.errors import OffloadError
from kvplane.ids import SlotId
from kvplane.integrations.vllm.messages import IDLE_WAIT_S, StepMeta
from kvplane.integrations.vllm.scheduler import RequestView, ScheduledRequest
from kvplane.integrations.vllm.worker import FINISHED_WINDOW
from kvplane.testing.redis_server import LocalRedisServer, redis_server_support

PROMPT = list(range(1, 22))  # 21 tokens: blocks of 4, chunks of 2 blocks -> 2 chunks offered


def extra(tmp_path: Path, **more: object) -> dict[str, object]:
    return {
        "blocks_per_chunk": 2,
        "host_slots": 8,
        "disk_path": str(tmp_path / "chunks.bin"),
        "disk_slots": 8,
        "disk_direct_io": False,
        **more,
    }


def test_second_request_loads_the_stored_prefix_from_host(tmp_path: Path) -> None:
    eng = MiniEngine(extra(tmp_path))
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
    one = MiniEngine(extra(tmp_path))
    one.run(PROMPT)
    one.close()  # drains: the write-through to disk is complete

    two = MiniEngine(extra(tmp_path))
    assert dict(two.worker.index.tiers)["disk"] != ()
    got = two.run(PROMPT)
    assert got.loaded == 16 and got.failed_blocks == set()
    assert two.metrics.value("vllm_hit_chunks", {"tier": "disk"}, "_total") == 2
    two.close()

    three = MiniEngine(extra(tmp_path))
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


def test_finished_sending_only_for_delayed_finished_requests(tmp_path: Path) -> None:
    eng = MiniEngine(extra(tmp_path))
    w = eng.worker
    w.start_loads(StepMeta())
    w.submit_stores(StepMeta(delayed=("x",)))
    assert w.finished_sending([]) == set()  # not finished yet in vLLM's eyes
    assert w.finished_sending(["x", "y"]) == {"x"}
    assert w.finished_sending(["x"]) == set()  # reported once
    # the delay may reach the worker a step after vLLM named the request finished
    assert w.finished_sending(["z"]) == set()
    w.submit_stores(StepMeta(delayed=("z",)))
    assert w.finished_sending([]) == {"z"}
    # a finished id no delay claims is forgotten after FINISHED_WINDOW steps
    assert w.finished_sending(["old"]) == set()
    for _ in range(FINISHED_WINDOW):
        assert w.finished_sending([]) == set()
    w.submit_stores(StepMeta(delayed=("old",)))
    assert w.finished_sending([]) == set()
    assert w.finished_sending(["old"]) == {"old"}
    eng.close()


def test_a_delayed_finished_request_is_reported_however_long_its_gather_runs(
    tmp_path: Path,
) -> None:
    eng = MiniEngine(extra(tmp_path))
    gate = threading.Event()
    gather = eng.worker.copier.gather

    def slow_gather(blocks: object, slots: object) -> None:
        gate.wait(30.0)
        gather(blocks, slots)  # type: ignore[arg-type]

    eng.worker.copier.gather = slow_gather  # type: ignore[method-assign]
    r = eng.run(PROMPT, req_id="slow")  # its gather is still waiting for the gate
    assert r.held and eng.held == {"slow": r}
    for _ in range(FINISHED_WINDOW + 4):  # far longer than the window of unclaimed finishes
        assert eng.idle_step() == set()
    gate.set()
    eng.worker.drain()
    assert eng.idle_step() == {"slow"}  # its blocks go back to vLLM
    assert eng.held == {} and eng.sched.tracked_requests() == []
    eng.close()


def test_an_idle_step_waits_for_an_in_flight_gather_instead_of_spinning(tmp_path: Path) -> None:
    eng = MiniEngine(extra(tmp_path))
    w, gate = eng.worker, threading.Event()
    gather, wait = w.copier.gather, w.jobs.wait

    def slow_gather(*args: object) -> None:
        gate.wait(30.0)
        gather(*args)  # type: ignore[arg-type]

    def recording_wait(timeout: float) -> object:
        waits.append(timeout)
        gate.set()  # the job finishes while the idle step waits for it
        return wait(30.0)

    waits: list[float] = []
    w.copier.gather = slow_gather  # type: ignore[method-assign]
    w.jobs.wait = recording_wait  # type: ignore[method-assign,assignment]
    r = eng.run(PROMPT, req_id="slow")
    assert r.held and w.busy
    w.submit_stores(eng.step([]))  # the scheduler's delay of "slow" reaches the worker
    assert w.finished_sending(["slow"]) == set() and waits == []  # a busy step never waits
    assert w.finished_sending([], idle=True) == {"slow"}
    assert waits == [IDLE_WAIT_S]
    eng.release(eng.held.pop("slow"))  # as vLLM frees its blocks
    eng.finished_ids.clear()
    w.jobs.wait = wait  # type: ignore[method-assign]
    w.drain()
    eng.sched.apply(w.take_report())
    assert w.finished_sending([], idle=True) == set() and waits == [IDLE_WAIT_S]  # nothing left
    eng.close()


def test_host_slots_are_reused_after_eviction(tmp_path: Path) -> None:
    eng = MiniEngine(extra(tmp_path, host_slots=2, disk_slots=3))
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
    eng = MiniEngine(extra(tmp_path))
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
