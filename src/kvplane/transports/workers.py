"""Helper threads of transports: :class:`CopyWorkers` share one large copy with the calling
thread, :class:`JobThread` runs an engine adapter's submitted jobs in order.

:meth:`CopyWorkers.run` returns only once no part runs; each transport owns its instance. See
docs/transports.md.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

from kvplane.validators import require_int

J = TypeVar("J")


class JobThread(Generic[J]):
    """One daemon thread running ``loop(jobs)``, which takes jobs from ``jobs`` until it takes
    ``None``; :meth:`stop` queues that ``None``."""

    def __init__(self, name: str, loop: Callable[[queue.SimpleQueue[J | None]], None]) -> None:
        self.jobs: queue.SimpleQueue[J | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=loop, args=(self.jobs,), name=name, daemon=True)
        self.thread.start()

    def put(self, job: J) -> None:
        self.jobs.put(job)

    def stop(self, timeout_s: float) -> bool:
        """Ask the loop to end after the jobs queued before; wait up to ``timeout_s`` for it.
        False if the thread still runs then (stuck in a job)."""
        self.jobs.put(None)
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


class CopyWorkers:
    """Split ``fn(a, b)`` over ``[0, n)`` among the caller and ``threads - 1`` helper threads.

    ``threads`` defaults to ``torch.get_num_threads()`` (the parallelism of torch's own copies).
    """

    def __init__(self, threads: int | None = None, *, name: str = "kvplane-copy") -> None:
        if threads is None:
            threads = max(1, torch.get_num_threads())
        self.threads = require_int("threads", threads, min=1)
        self._name = name
        self._lock = threading.Condition()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._running = 0
        """Runs holding the pool (``close`` waits for them before shutting it down)."""

    def _acquire(self) -> ThreadPoolExecutor | None:
        """The pool, counted as in use until :meth:`_release`; None when closed or single."""
        with self._lock:
            if self._closed or self.threads == 1:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=self._name)
            self._running += 1
            return self._pool

    def _release(self) -> None:
        with self._lock:
            self._running -= 1
            self._lock.notify_all()

    def run(self, fn: Callable[[int, int], None], n: int, min_part: int = 1) -> None:
        """Call ``fn(a, b)`` on contiguous parts covering ``[0, n)``, each at least ``min_part``
        long (except when ``n`` is smaller), in parallel; return when all are done."""
        parts = max(1, min(self.threads, n // max(1, min_part)))
        pool = self._acquire() if parts > 1 else None
        if pool is None:
            if n > 0:
                fn(0, n)
            return
        try:
            self._run_parts(pool, fn, [n * i // parts for i in range(parts + 1)])
        finally:
            self._release()

    @staticmethod
    def _run_parts(
        pool: ThreadPoolExecutor, fn: Callable[[int, int], None], bounds: list[int]
    ) -> None:
        """Parts 1.. on helpers (any that cannot be handed over on the caller), part 0 on the
        caller; returns or raises (the first error) only once every part has ended."""
        futures: list[Future[None]] = []
        mine = [0]
        for i in range(1, len(bounds) - 1):
            try:
                futures.append(pool.submit(fn, bounds[i], bounds[i + 1]))
            except RuntimeError:  # the pool is shutting down: the caller does the rest
                mine.extend(range(i, len(bounds) - 1))
                break
        error: BaseException | None = None
        for i in mine:
            try:
                fn(bounds[i], bounds[i + 1])
            except BaseException as exc:  # still wait: helpers must not outlive the buffers
                error = error or exc
                break
        for fut in futures:
            try:
                fut.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the helper threads once the runs in progress have ended; later runs use the
        caller only. Must not be called from inside ``fn``."""
        with self._lock:
            self._closed = True
            while self._running:
                self._lock.wait()
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
