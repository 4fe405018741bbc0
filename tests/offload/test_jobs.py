"""JobRunner (FIFO per path, paths overlap, failures are results) and BlockFence on a pool."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from offload_testlib import BAD_IDS, keys

from kvplane.blocks import BlockPool
from kvplane.errors import BlockStateError, InvalidArgumentError, OffloadError, UnknownBlockError
from kvplane.ids import BlockId, JobId
from kvplane.metrics import MetricsRegistry
from kvplane.offload import jobs
from kvplane.offload.jobs import BlockFence, JobRunner


def drain(runner: JobRunner) -> list:  # type: ignore[type-arg]
    out = []
    while runner.in_flight:
        got = runner.wait(timeout=10)
        assert got, "a job did not finish"
        out += got
    return out


def test_fifo_per_path_and_results_per_job() -> None:
    m = MetricsRegistry()
    runner = JobRunner(m)
    ran: list[int] = []
    jobs = [runner.new_job(keys(i, i + 10), "device", "host") for i in range(5)]
    for i, job in enumerate(jobs):

        def work(i: int = i) -> list[bool]:
            time.sleep(0.002 * (5 - i))  # later jobs are quicker: order must still hold
            ran.append(i)
            return [True, i != 3]

        runner.submit(job, work, chunk_bytes=100)
    results = drain(runner)
    assert ran == [0, 1, 2, 3, 4]
    assert [r.job.job_id for r in results] == [j.job_id for j in jobs]
    assert [r.ok for r in results] == [(True, True)] * 3 + [(True, False), (True, True)]
    assert results[3].error is None and not results[3].all_ok and results[0].all_ok
    assert jobs[0].path == "device_to_host" and [j.job_id for j in jobs] == [1, 2, 3, 4, 5]
    lbl = {"path": "device_to_host"}
    assert m.value("offload_bytes", lbl, "_total") == 9 * 100
    assert m.value("offload_failed_chunks", lbl, "_total") == 1
    assert m.value("offload_chunks_per_job", lbl, "_count") == 5
    assert m.value("offload_chunks_per_job", lbl, "_sum") == 10
    runner.close()


def test_paths_overlap_and_a_failed_job_does_not_stop_its_worker() -> None:
    runner = JobRunner()
    gate = threading.Event()
    store = runner.new_job(keys(0), "device", "host")
    disk = runner.new_job(keys(1), "host", "disk")
    runner.submit(store, lambda: [gate.wait(timeout=10)], 1)  # blocks until the other path runs

    def open_gate() -> list[bool]:
        gate.set()
        return [True]

    runner.submit(disk, open_gate, 1)
    boom = runner.new_job(keys(2), "device", "host")
    runner.submit(boom, lambda: 1 / 0, 1)  # type: ignore[arg-type,return-value]
    short = runner.new_job(keys(3, 4), "device", "host")
    runner.submit(short, lambda: [True], 1)  # one flag for two chunks
    after = runner.new_job(keys(5), "device", "host")
    runner.submit(after, lambda: [True], 1)
    results = {r.job.job_id: r for r in drain(runner)}
    assert results[store.job_id].all_ok  # it saw the gate open: the paths ran concurrently
    assert results[boom.job_id].ok == (False,) and "ZeroDivisionError" in str(
        results[boom.job_id].error
    )
    assert results[short.job_id].ok == (False, False) and "2 chunks" in str(
        results[short.job_id].error
    )
    assert results[after.job_id].all_ok
    runner.close()
    with pytest.raises(OffloadError, match="closed"):
        runner.submit(runner.new_job(keys(6), "device", "host"), lambda: [True], 1)
    with pytest.raises(InvalidArgumentError):
        runner.new_job([], "device", "host")
    with pytest.raises(InvalidArgumentError):
        runner.new_job(keys(1), "host", "host")


def test_fence_keeps_blocks_of_an_in_flight_store_out_of_reuse() -> None:
    pool = BlockPool(4, 16)
    fence = BlockFence(pool)
    request = pool.allocate(4)
    assert request == [0, 1, 2, 3]
    fence.hold(JobId(1), [BlockId(0), BlockId(1)])  # a store job reads blocks 0 and 1
    pool.free(request)  # the request finishes before the job does
    assert fence.fenced_blocks() == {0, 1} and fence.is_fenced(BlockId(1))
    assert pool.allocate(3) is None  # only 2 and 3 are free
    reuse = pool.allocate(2)
    assert reuse is not None and sorted(reuse) == [2, 3]
    fence.release(JobId(1))  # the job completed
    assert fence.fenced_blocks() == frozenset() and len(fence) == 0
    again = pool.allocate(2)
    assert again is not None and sorted(again) == [0, 1]
    pool.free(reuse + again)
    pool.check_integrity()
    assert pool.num_free_blocks == 4


def test_fence_misuse_changes_nothing() -> None:
    pool = BlockPool(2, 16)
    fence = BlockFence(pool)
    with pytest.raises(BlockStateError):
        fence.hold(JobId(1), [BlockId(0)])  # a free, uncached block holds no KV to read
    with pytest.raises(UnknownBlockError):
        fence.hold(JobId(1), [BlockId(5)])
    assert len(fence) == 0 and pool.num_free_blocks == 2
    blocks = pool.allocate(1)
    assert blocks is not None
    fence.hold(JobId(1), blocks)
    with pytest.raises(InvalidArgumentError):
        fence.hold(JobId(1), blocks)
    with pytest.raises(InvalidArgumentError):
        fence.release(JobId(2))
    fence.release(JobId(1))
    pool.free(blocks)
    pool.check_integrity()
    plain = BlockFence()  # no pool: the fenced set is advisory for the caller's allocator
    plain.hold(JobId(7), [BlockId(3), BlockId(3)])
    assert plain.fenced_blocks() == {3}
    plain.release(JobId(7))
    assert not plain.fenced_blocks()


def test_fence_release_frees_tail_first_like_a_block_table() -> None:
    pool = BlockPool(4, 16)
    fence = BlockFence(pool)
    request = pool.allocate(4)
    assert request == [0, 1, 2, 3]
    fence.hold(JobId(1), request)
    pool.free(request)  # the request ends first: the fence holds the last references
    fence.release(JobId(1))
    assert pool.free_queue_order() == [3, 2, 1, 0]  # the prefix is evicted last
    pool.check_integrity()


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_block_ids_must_be_a_1d_integer_sequence(bad: object) -> None:
    fence = BlockFence()  # no pool: nothing else would refuse them
    with pytest.raises(InvalidArgumentError, match="block ids"):
        fence.hold(JobId(1), bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="block ids"):
        fence.check(bad)  # type: ignore[arg-type]
    assert len(fence) == 0
    with pytest.raises(InvalidArgumentError, match="block ids"):
        jobs.check_block_ids(bad)


def test_check_block_ids_exact_values() -> None:
    for good in ([3, np.int64(4)], (3, 4), range(3, 5), np.array([3, 4], dtype=np.uint8),
                 torch.tensor([3, 4], dtype=torch.int32)):  # fmt: skip
        out = jobs.check_block_ids(good, 5)
        assert out.dtype == np.int64 and out.tolist() == [3, 4]
    src = np.array([1, 2], dtype=np.int64)
    out = jobs.check_block_ids(src)
    src[0] = 9
    assert out.tolist() == [1, 2]  # a fresh copy
    assert jobs.check_block_ids([]).shape == (0,)
    with pytest.raises(InvalidArgumentError, match=r"0\.\.4, got 0\.\.5"):
        jobs.check_block_ids([0, 5], 5)
    with pytest.raises(InvalidArgumentError, match=r"0\.\.4"):
        jobs.check_block_ids([-1], 5)
    with pytest.raises(InvalidArgumentError, match=r"2\*\*63"):
        jobs.check_block_ids(np.array([2**63], dtype=np.uint64))
