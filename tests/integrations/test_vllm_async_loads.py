"""Asynchronous loads without vLLM: the request waits (``WAITING_FOR_REMOTE_KVS``) while its load
runs on the copy threads; ``get_finished`` names it once every chunk is in place.

The test plays vLLM's engine loop around the real scheduler and worker sides (``MiniEngine``):
idle steps while the request waits, ``end_step`` as ``get_finished``, load errors taken in the
same step. Copies are held at a gate to pin down what happens while a load is in flight.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from vllm_testlib import MiniEngine, disk_extra

from kvplane.integrations.vllm.messages import JobReport, LoadOp, StepMeta
from kvplane.integrations.vllm.scheduler import RequestView
from kvplane.integrations.vllm.wakeup import end_step
from kvplane.integrations.vllm.worker import WorkerSide
from kvplane.offload.slots import SlotStatus

PROMPT = list(range(1, 22))  # 21 tokens: blocks of 4, chunks of 2 blocks -> 2 chunks offered


def gate(obj: object, name: str) -> threading.Event:
    """Holds every call of ``obj.name`` until the returned event is set."""
    event, real = threading.Event(), getattr(obj, name)

    def held(*args: object) -> object:
        assert event.wait(30.0), f"{name} held for 30 s"
        return real(*args)

    setattr(obj, name, held)
    return event


def stored_on_disk(tmp_path: Path) -> None:
    one = MiniEngine(disk_extra(tmp_path))
    one.run(PROMPT)
    one.close()  # drains: PROMPT's two chunks are on disk


def begin(eng: MiniEngine, req_id: str, tokens: list[int]) -> tuple[LoadOp, list[int], StepMeta]:
    """vLLM admits the request with an asynchronous load and runs the step that emits it (the
    request itself is not scheduled: it waits for its KV)."""
    view = RequestView(req_id, tokens)
    matched, load_async = eng.sched.match(view, 0)
    assert (matched, load_async) == (16, True)
    blocks = eng.take_blocks(-(-len(tokens) // 4))
    op = eng.sched.allocated(view, blocks, 16)
    assert op is not None
    meta = eng.step([])  # begin_step, start_loads, wait_loads: returns with the load running
    eng.worker.submit_stores(meta)
    assert meta.loads == (op,)
    return op, blocks, meta


def idle(w: WorkerSide) -> set[str]:
    """One idle step's ``get_finished``: the requests it names finished receiving."""
    sent, got = end_step([w], [], True, w.wake)
    assert sent == set()
    return got


def test_a_host_hit_loads_asynchronously_and_is_named_once_in_place(tmp_path: Path) -> None:
    eng = MiniEngine(disk_extra(tmp_path, load_mode="async"))
    eng.run(PROMPT)
    eng.settle()
    w = eng.worker
    held = gate(w.copier, "scatter")
    op, blocks, _ = begin(eng, "b", [*PROMPT[:16], 50, 51, 52])
    assert op == LoadOp(op.job_id, "b", op.keys, (0, 1), tuple(blocks[:4]), load_async=True)
    assert end_step([w], [], False, w.wake) == (set(), set())  # not in place: not named
    assert (w.loads.in_flight, w.jobs.in_flight, eng.sched.jobs_in_flight) == (1, 1, 1)
    assert w.take_report().jobs == () and w.take_load_errors() == set()
    assert [eng.sched.book.host.status(k) for k in op.keys] == [SlotStatus.LOADING] * 2
    held.set()
    assert idle(w) == {"b"}  # the idle step waits for the scatter
    assert w.take_load_errors() == set()
    report = w.take_report()
    assert report.jobs == (JobReport(op.job_id, "device", (True, True)),)
    eng.sched.apply(report)
    assert [eng.sched.book.host.status(k) for k in op.keys] == [SlotStatus.READY] * 2
    assert eng.metrics.value("vllm_hit_tokens", suffix="_total") == 16
    done = eng.complete(RequestView("b", [*PROMPT[:16], 50, 51, 52]), blocks, 16, set())
    assert done.failed_blocks == set()
    assert idle(w) == set()  # named once
    assert eng.metrics.value("vllm_loads", {"mode": "async"}, "_total") == 1
    assert eng.wmetrics.value("vllm_load_wait_seconds", suffix="_total") == 0  # no forward waited
    eng.close()


def test_a_disk_load_runs_over_several_steps_while_other_requests_compute(
    tmp_path: Path,
) -> None:
    stored_on_disk(tmp_path)
    eng = MiniEngine(disk_extra(tmp_path))  # load_mode "auto": a disk hit loads asynchronously
    w = eng.worker
    held = gate(w.lower["disk"], "read")
    op, blocks, _ = begin(eng, "b", PROMPT)
    assert [(p.index, p.tier) for p in op.promotions] == [(0, "disk"), (1, "disk")]
    assert [eng.sched.book.host.status(k) for k in op.keys] == [SlotStatus.STORING] * 2
    other = eng.run([t + 50 for t in PROMPT])  # a miss computes, stores, is done meanwhile
    assert other.loaded == 0 and other.done
    while w.jobs.in_flight > 1:  # the other's write-through lands; the read is still held
        w.wait(1.0)
    for _ in range(3):
        assert idle(w) == set()
        eng.sched.apply(w.take_report())
        assert (w.loads.in_flight, w.jobs.in_flight, eng.sched.jobs_in_flight) == (1, 1, 1)
    held.set()
    errors = eng.receive("b")
    assert errors == set()
    eng.check_blocks(PROMPT, blocks[:4])
    chunk = 2 * eng.pool.bytes_per_block
    wm = eng.wmetrics
    assert wm.value("offload_bytes", {"path": "disk_to_host"}, "_total") == 2 * chunk
    assert wm.value("offload_bytes", {"path": "host_to_device"}, "_total") == 2 * chunk
    assert eng.metrics.value("vllm_hit_chunks", {"tier": "disk"}, "_total") == 2
    eng.complete(RequestView("b", PROMPT), blocks, 16, errors)
    eng.close()


def test_a_request_aborted_mid_load_is_named_only_after_its_copy(tmp_path: Path) -> None:
    stored_on_disk(tmp_path)
    eng = MiniEngine(disk_extra(tmp_path))
    w = eng.worker
    held = gate(w.lower["disk"], "read")
    _op, blocks, _ = begin(eng, "b", PROMPT)
    eng.sched.finished("b")  # aborted in WAITING_FOR_REMOTE_KVS: vLLM keeps the blocks
    assert eng.sched.fenced_blocks == [] and eng.sched.tracked_requests() == []
    assert eng.sched.jobs_in_flight == 1
    assert idle(w) == set() and idle(w) == set()  # the copy may still write the blocks
    held.set()
    assert eng.receive("b") == set()
    eng.check_blocks(PROMPT, blocks[:4])  # written before the name: vLLM may free them now
    eng.free.extend(blocks)
    assert eng.metrics.value("vllm_hit_tokens", suffix="_total") == 16  # counted at its report
    again = eng.run(PROMPT)  # reuses the blocks; the chunks stayed in host
    assert again.loaded == 16 and again.failed_blocks == set()
    assert eng.metrics.value("vllm_loads", {"mode": "sync"}, "_total") == 1  # host: auto is sync
    eng.close()


@pytest.mark.parametrize("bad_slot", [0, 1])
def test_a_failed_async_load_reports_its_blocks_with_its_name(
    tmp_path: Path, bad_slot: int
) -> None:
    stored_on_disk(tmp_path)
    eng = MiniEngine(disk_extra(tmp_path))
    disk: Any = eng.worker.lower["disk"]
    slot = dict(dict(eng.worker.index.tiers)["disk"])
    key = sorted(slot, key=lambda k: slot[k])[bad_slot]  # stored first: chunk 0, then chunk 1
    with open(disk.path, "r+b") as fh:
        fh.seek(slot[key] * disk.slot_stride + 5)
        byte = fh.read(1)
        fh.seek(slot[key] * disk.slot_stride + 5)
        fh.write(bytes([byte[0] ^ 0x40]))
    w = eng.worker
    _op, blocks, _ = begin(eng, "b", PROMPT)
    errors: set[int] = set()
    for _ in range(500):
        got = idle(w)
        errors = w.take_load_errors()
        eng.sched.apply(w.take_report())
        if got:
            break
        assert errors == set()  # no error is reported before the name
    assert got == {"b"}
    assert errors == set(blocks[2 * bad_slot : 4])  # from the failed chunk on, in that step
    done = eng.complete(RequestView("b", PROMPT), blocks, 16, errors)
    assert done.failed_blocks == errors
    assert eng.metrics.value("vllm_hit_tokens", suffix="_total") == 8 * bad_slot
    again = eng.run(PROMPT)  # the recomputed chunk was stored again
    assert again.loaded == 16 and again.failed_blocks == set()
    eng.close()
