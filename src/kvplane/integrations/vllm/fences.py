"""Fences on vLLM blocks that in-flight gathers still read after vLLM freed them.

Owns :class:`Fences`: per freed block, the count of store jobs whose gather reads it, and which
jobs are fenced. vLLM frees a request's blocks when it finishes (never delayed for a store) and,
with a sliding window, the blocks that left the window while it runs; a step that writes a
fenced block first flushes the gathers (``SchedulerSide.build_step``). Plain data only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Fences:
    """Fenced blocks and the store jobs fencing them; not thread-safe."""

    def __init__(self) -> None:
        self._blocks: dict[int, int] = {}  # freed block -> fenced gathers still reading it
        self._jobs: set[int] = set()

    def fence(self, job_id: int, block_ids: Sequence[int]) -> None:
        """Job ``job_id``'s gather reads ``block_ids``, which vLLM may reuse: fence them until
        :meth:`release` (a job is fenced once)."""
        if job_id in self._jobs:
            return
        self._jobs.add(job_id)
        for b in block_ids:
            self._blocks[b] = self._blocks.get(b, 0) + 1

    def release(self, job_id: int, block_ids: Sequence[int]) -> None:
        """Job ``job_id``'s gather ended: its fences (if any) fall."""
        if job_id not in self._jobs:
            return
        self._jobs.discard(job_id)
        for b in block_ids:
            left = self._blocks[b] - 1
            if left:
                self._blocks[b] = left
            else:
                del self._blocks[b]

    def hit(self, block_ids: Iterable[int]) -> bool:
        """True when any of ``block_ids`` is fenced."""
        return any(int(b) in self._blocks for b in block_ids)

    @property
    def blocks(self) -> list[int]:
        """The fenced blocks, sorted."""
        return sorted(self._blocks)

    def __bool__(self) -> bool:
        return bool(self._blocks)
