"""Helper threads that share one large copy with the calling thread.

Theory of operation
-------------------
``torch.Tensor.copy_`` -- the physical limit the benches compare against -- runs on all of
torch's intra-op threads. A scatter of many small runs issued from Python (NumPy fancy
assignment, which releases the GIL while it copies) runs on one thread unless we split it, so a
:class:`CopyWorkers` splits an index range ``[0, n)`` into up to ``threads`` contiguous parts:
the caller runs the first part itself while helper threads run the others, and :meth:`run`
returns once every part is done (re-raising the first error). Parts must touch disjoint bytes.

Helper threads are created on first use (a transport that never copies much starts none) and
stopped by :meth:`close`; a closed instance runs everything in the calling thread. Instances
are owned by one transport each (no module-level pool) and are safe to use from many threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvplane.errors import InvalidArgumentError


class CopyWorkers:
    """Split ``fn(a, b)`` over ``[0, n)`` among the caller and ``threads - 1`` helper threads.

    ``threads`` defaults to ``torch.get_num_threads()`` (the parallelism of torch's own copies).
    """

    def __init__(self, threads: int | None = None, *, name: str = "kvplane-copy") -> None:
        if threads is None:
            threads = max(1, torch.get_num_threads())
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InvalidArgumentError(f"threads must be an int >= 1, got {threads!r}")
        self.threads = threads
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    def _executor(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed or self.threads == 1:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=self._name)
            return self._pool

    def run(self, fn: Callable[[int, int], None], n: int, min_part: int = 1) -> None:
        """Call ``fn(a, b)`` on contiguous parts covering ``[0, n)``, each at least ``min_part``
        long (except when ``n`` is smaller), in parallel; return when all are done."""
        parts = max(1, min(self.threads, n // max(1, min_part)))
        pool = self._executor() if parts > 1 else None
        if pool is None:
            if n > 0:
                fn(0, n)
            return
        bounds = [n * i // parts for i in range(parts + 1)]
        futures: list[Future[None]] = [
            pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, parts)
        ]
        error: BaseException | None = None
        try:
            fn(bounds[0], bounds[1])
        except BaseException as exc:  # still wait: helpers must not outlive the caller's buffers
            error = exc
        for fut in futures:
            try:
                fut.result()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the helper threads (after their current part); later runs use the caller only."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
