"""The intrusive LRU free queue of a block pool: O(1), no object per block.

A circular doubly linked list on ``prev``/``next`` int arrays with one sentinel node, and no
``-1`` convention. Owned by one :class:`~kvplane.blocks.pool.BlockPool`. See docs/offload.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvplane.errors import BlockStateError
from kvplane.ids import BlockId
from kvplane.validators import require_int


class FreeBlockQueue:
    """O(1) LRU queue of block ids ``0 .. num_blocks-1``; starts holding all of them in order.

    Not thread-safe: the owning :class:`~kvplane.blocks.pool.BlockPool` serialises access.
    Methods raise :class:`BlockStateError` when asked to link a linked block or unlink an
    unlinked one, before changing anything; block ids are range-checked by the pool.
    """

    __slots__ = ("_len", "_linked", "_next", "_num_blocks", "_prev", "_sentinel")

    def __init__(self, num_blocks: int) -> None:
        n = require_int("num_blocks", num_blocks, min=1)
        self._num_blocks = n
        self._sentinel = n
        # Node i links to i-1 and i+1; the sentinel n closes the ring (n+1 nodes in all).
        self._prev: list[int] = [n, *range(n)]
        self._next: list[int] = [*range(1, n + 1), 0]
        self._linked: list[bool] = [True] * n
        self._len = n

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: object) -> bool:
        return (
            isinstance(block_id, int)
            and 0 <= block_id < self._num_blocks
            and self._linked[block_id]
        )

    def __iter__(self) -> Iterator[BlockId]:
        """Block ids from head (evicted first) to tail (most recently freed)."""
        node = self._next[self._sentinel]
        while node != self._sentinel:
            yield BlockId(node)
            node = self._next[node]

    def order(self) -> list[BlockId]:
        """Block ids from head to tail (a snapshot, for tests and diagnostics)."""
        return list(self)

    def append(self, block_id: BlockId) -> None:
        """Link ``block_id`` at the tail (it becomes the most recently freed)."""
        if self._linked[block_id]:
            raise BlockStateError(f"block {block_id} is already in the free queue")
        s = self._sentinel
        tail = self._prev[s]
        self._prev[block_id] = tail
        self._next[block_id] = s
        self._next[tail] = block_id
        self._prev[s] = block_id
        self._linked[block_id] = True
        self._len += 1

    def extend(self, block_ids: Iterable[BlockId]) -> None:
        """``append`` each block in order (the first one ends up nearest the head)."""
        for block_id in block_ids:
            self.append(block_id)

    def remove(self, block_id: BlockId) -> None:
        """Unlink ``block_id`` from wherever it is in the queue."""
        if not self._linked[block_id]:
            raise BlockStateError(f"block {block_id} is not in the free queue")
        p = self._prev[block_id]
        n = self._next[block_id]
        self._next[p] = n
        self._prev[n] = p
        self._prev[block_id] = block_id
        self._next[block_id] = block_id
        self._linked[block_id] = False
        self._len -= 1

    def popleft(self) -> BlockId | None:
        """Unlink and return the head (least recently freed block); ``None`` when empty."""
        head = self._next[self._sentinel]
        if head == self._sentinel:
            return None
        self.remove(BlockId(head))
        return BlockId(head)

    def check_integrity(self) -> None:
        """Raise :class:`BlockStateError` unless the ring is consistent in both directions.

        Checks: walking ``next`` from the sentinel visits exactly the linked blocks, once each,
        and returns to the sentinel; ``prev`` mirrors ``next``; the length matches; unlinked
        blocks are parked on themselves.
        """
        s = self._sentinel
        seen: set[int] = set()
        node = s
        for _ in range(self._num_blocks + 1):
            nxt = self._next[node]
            if self._prev[nxt] != node:
                raise BlockStateError(
                    f"free queue: next[{node}]={nxt} but prev[{nxt}]={self._prev[nxt]}"
                )
            if nxt == s:
                break
            if nxt in seen or not self._linked[nxt]:
                raise BlockStateError(f"free queue: block {nxt} reached twice or not marked linked")
            seen.add(nxt)
            node = nxt
        else:
            raise BlockStateError("free queue: the ring does not return to the sentinel")
        if len(seen) != self._len:
            raise BlockStateError(f"free queue: length {self._len} but {len(seen)} blocks linked")
        for block in range(self._num_blocks):
            if not self._linked[block] and block not in seen:
                if self._prev[block] != block or self._next[block] != block:
                    raise BlockStateError(f"free queue: unlinked block {block} still points away")
            elif self._linked[block] != (block in seen):
                raise BlockStateError(f"free queue: block {block} marked linked but not reachable")
