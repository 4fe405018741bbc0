"""Transfer jobs (worker threads that move chunk bytes, FIFO per path) and the device fence.

Workers never touch bookkeeping: the owner thread harvests :class:`JobResult` s.
:class:`BlockFence` keeps device blocks of in-flight stores out of reuse;
:func:`check_block_ids` is the package's block-id validator. See docs/offload.md.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from kvplane.blocks import BlockPool
from kvplane.blocks.hashing import BOOL_TYPES
from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.ids import BlockId, ChunkKey, JobId
from kvplane.metrics import COUNT_BUCKETS, MetricsRegistry

BlockIds = Sequence[BlockId] | npt.NDArray[np.int64]
"""Device block ids as a sequence or a 1-D int64 array (the hot paths pass arrays)."""


def check_block_ids(
    block_ids: object, num_blocks: int | None = None, what: str = "block ids"
) -> npt.NDArray[np.int64]:
    """``block_ids`` as a fresh 1-D ``int64`` array, or ``InvalidArgumentError`` naming them.

    Accepts a sequence of ints (``numpy`` integers included) or a 1-D integer array (numpy,
    or a CPU torch tensor); refuses floats, bools, strings, ``None``, scalars, nested or
    multi-dimensional input (nothing is truncated or coerced). With ``num_blocks`` every id must
    also lie in ``0..num_blocks-1``. The one check behind every block-id argument of the
    offload package (cascade, copier, fence); vectorised, no Python loop per block. An array
    costs a few microseconds; a Python sequence also one C-level pass over its items' types
    (bools hide among ints otherwise), about 0.25 ms for 8k ids: pass arrays on hot paths.
    """
    if isinstance(block_ids, (str, bytes, bytearray)) or block_ids is None:
        raise InvalidArgumentError(f"{what} must be a 1-D sequence of ints, got {block_ids!r:.80}")
    if isinstance(block_ids, Sequence):  # not an array: look at the items' types
        if not block_ids:
            return np.zeros(0, dtype=np.int64)
        if not BOOL_TYPES.isdisjoint(map(type, block_ids)):  # [1, True] would become int64 [1, 1]
            raise InvalidArgumentError(f"{what} must be ints, not bools: {block_ids!r:.80}")
    try:
        arr = np.asarray(block_ids)
    except (TypeError, ValueError, RuntimeError) as exc:  # ragged, or a tensor off the CPU
        raise InvalidArgumentError(f"{what} are not a 1-D sequence of ints: {exc}") from None
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{what} must be a 1-D sequence of ints, got {arr.ndim}-D {arr.dtype}: "
            f"{block_ids!r:.80}"
        )
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) >= 2**63:
        raise InvalidArgumentError(f"{what} must be below 2**63, got {int(arr.max())}")
    ids = arr.astype(np.int64, copy=True)
    if num_blocks is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise InvalidArgumentError(
            f"{what} must be in 0..{num_blocks - 1}, got {int(ids.min())}..{int(ids.max())}"
        )
    return ids


Work = Callable[[], Sequence[bool]]
"""Moves a job's bytes; returns one ok flag per chunk key, in order."""


@dataclass(frozen=True, slots=True)
class TransferJob:
    """One batch of chunks moving from tier ``src`` to tier ``dst`` (tier kinds, e.g. "host")."""

    job_id: JobId
    chunk_keys: tuple[ChunkKey, ...]
    src: str
    dst: str

    @property
    def path(self) -> str:
        """Metric label and worker name: ``"<src>_to_<dst>"``."""
        return f"{self.src}_to_{self.dst}"


@dataclass(frozen=True, slots=True)
class JobResult:
    """How a job ended: ``ok[i]`` for ``job.chunk_keys[i]``; ``error`` when it failed whole."""

    job: TransferJob
    ok: tuple[bool, ...]
    seconds: float
    error: str | None = None

    @property
    def all_ok(self) -> bool:
        return self.error is None and all(self.ok)


_STOP = object()


class JobRunner:
    """Runs jobs on one worker thread per path; see the module docstring.

    ``metrics`` (injected) receives, labelled ``path``: ``kvplane_offload_bytes`` (bytes of the
    chunks that moved), ``kvplane_offload_seconds`` (job wall time), the histogram
    ``kvplane_offload_chunks_per_job`` and ``kvplane_offload_failed_chunks``.
    """

    def __init__(self, metrics: MetricsRegistry | None = None) -> None:
        self._ids = itertools.count(1)
        self._queues: dict[str, queue.SimpleQueue[object]] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._done: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._in_flight = 0
        self._closed = False
        self._metrics = metrics
        if metrics is not None:
            lbl = ("path",)
            self._m_bytes = metrics.counter("offload_bytes", "Chunk bytes moved", lbl)
            self._m_secs = metrics.counter("offload_seconds", "Seconds spent in jobs", lbl)
            self._m_chunks = metrics.histogram(
                "offload_chunks_per_job", "Chunks per transfer job", lbl, COUNT_BUCKETS
            )
            self._m_failed = metrics.counter("offload_failed_chunks", "Chunks a job failed", lbl)

    @property
    def closed(self) -> bool:
        """True after :meth:`close`: :meth:`submit` refuses new jobs."""
        return self._closed

    @property
    def in_flight(self) -> int:
        """Jobs submitted whose results the owner has not harvested yet."""
        return self._in_flight

    def new_job(self, keys: Sequence[ChunkKey], src: str, dst: str) -> TransferJob:
        """A job with a fresh id (ids are unique per runner, increasing from 1)."""
        if not keys:
            raise InvalidArgumentError(f"a {src}_to_{dst} job needs at least one chunk")
        if src == dst:
            raise InvalidArgumentError(f"a job moves between two tiers, got {src} -> {dst}")
        return TransferJob(JobId(next(self._ids)), tuple(keys), src, dst)

    def submit(self, job: TransferJob, work: Work, chunk_bytes: int) -> None:
        """Queue ``work`` on ``job.path``'s worker; results arrive via :meth:`poll`."""
        if self._closed:
            raise OffloadError(f"job runner is closed; cannot run job {job.job_id}")
        if not callable(work):
            raise InvalidArgumentError(f"work for job {job.job_id} is not callable: {work!r}")
        path = job.path
        q = self._queues.get(path)
        if q is None:
            q = self._queues[path] = queue.SimpleQueue()
            t = threading.Thread(
                target=self._worker, args=(q,), name=f"kvplane-offload-{path}", daemon=True
            )
            self._threads[path] = t
            t.start()
        self._in_flight += 1
        q.put((job, work, chunk_bytes))

    def _worker(self, q: queue.SimpleQueue[object]) -> None:
        while True:
            item = q.get()
            if item is _STOP:
                return
            job, work, chunk_bytes = cast(tuple[TransferJob, Work, int], item)
            start = time.perf_counter()
            try:
                flags = tuple(bool(f) for f in work())
                if len(flags) != len(job.chunk_keys):
                    raise OffloadError(
                        f"job {job.job_id} reported {len(flags)} flags for "
                        f"{len(job.chunk_keys)} chunks"
                    )
                result = JobResult(job, flags, time.perf_counter() - start)
            except Exception as exc:  # a failed job must not kill its path's worker
                err = f"{type(exc).__name__}: {exc}"
                fail = (False,) * len(job.chunk_keys)
                result = JobResult(job, fail, time.perf_counter() - start, err)
            if self._metrics is not None:
                good = sum(result.ok)
                self._m_bytes.labels(path=job.path).inc(good * chunk_bytes)
                self._m_secs.labels(path=job.path).inc(result.seconds)
                self._m_chunks.labels(path=job.path).observe(len(job.chunk_keys))
                if good < len(result.ok):
                    self._m_failed.labels(path=job.path).inc(len(result.ok) - good)
            self._done.put(result)

    def poll(self) -> list[JobResult]:
        """Results completed since the last harvest, in completion order; never blocks."""
        out: list[JobResult] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self._in_flight -= len(out)
        return out

    def wait(self, timeout: float | None = None) -> list[JobResult]:
        """Block until at least one result (or ``timeout`` seconds), then harvest all ready."""
        if self._in_flight == 0:
            return []
        try:
            first = self._done.get(timeout=timeout)
        except queue.Empty:
            return []
        self._in_flight -= 1
        return [first, *self.poll()]

    def close(self) -> None:
        """Stop accepting jobs; workers finish what is queued, then exit (joined)."""
        self._closed = True
        for q in self._queues.values():
            q.put(_STOP)
        for t in self._threads.values():
            t.join()


class BlockFence:
    """Device blocks read by in-flight store jobs; see the module docstring for the contract.

    Holding and releasing cost O(1) Python work per job plus numpy work per block (and, with a
    pool, the pool's own ``touch``/``free``); :meth:`fenced_blocks` builds the union on demand.
    """

    def __init__(self, pool: BlockPool | None = None) -> None:
        self.pool = pool
        self._held: dict[JobId, npt.NDArray[np.int64]] = {}

    def hold(self, job_id: JobId, block_ids: BlockIds) -> None:
        """Fence ``block_ids`` for ``job_id`` (a pool reference each, when there is a pool).

        Raises ``InvalidArgumentError`` if the job already holds a fence or ``block_ids`` are
        not a 1-D integer sequence (:func:`check_block_ids`), and the pool's error (unknown
        block, free uncached block) before recording anything.
        """
        if job_id in self._held:
            raise InvalidArgumentError(f"job {job_id} already holds a fence")
        blocks = check_block_ids(block_ids)
        if self.pool is not None:
            self.pool.touch(blocks)
        self._held[job_id] = blocks

    def check(self, block_ids: BlockIds) -> None:
        """Raise what :meth:`hold` would raise for ``block_ids`` (bad ids, the pool's unknown
        or free uncached block); changes nothing. Lets a caller validate before other work."""
        blocks = check_block_ids(block_ids)
        if self.pool is not None:
            self.pool.check_touch(blocks)

    def release(self, job_id: JobId) -> None:
        """Lift ``job_id``'s fence (drop its pool references); ``InvalidArgumentError`` if none.

        The references are dropped in REVERSE order, like :meth:`BlockTable.release`: blocks
        the fence is last to hold reach the free queue tail-first, so a chain's tail is
        evicted before its shared prefix.
        """
        blocks = self._held.get(job_id)
        if blocks is None:
            raise InvalidArgumentError(f"job {job_id} holds no fence")
        if self.pool is not None:
            self.pool.free(blocks[::-1])
        del self._held[job_id]

    def fenced_blocks(self) -> frozenset[BlockId]:
        if not self._held:
            return frozenset()
        union = np.unique(np.concatenate(list(self._held.values())))
        return frozenset(BlockId(b) for b in union.tolist())

    def is_fenced(self, block_id: BlockId) -> bool:
        return any(bool((blocks == block_id).any()) for blocks in self._held.values())

    def __len__(self) -> int:
        """Jobs holding a fence."""
        return len(self._held)
