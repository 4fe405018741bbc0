"""The block table of one request: its tokens, its blocks and which token ranges are cached.

A table splits the request's tokens into the cached prefix (shared through the pool's prefix
cache at admission), the range computed by this run and the range still to compute; block ``i``
holds tokens ``[i*block_size, (i+1)*block_size)``. It holds the chained hashes of every full
block, each computed once, and is the one place other parts read them from. Leading blocks
no layer reads any more (out of every window) can be dropped to the pool's null block; a table
admitted with a :class:`Growth` grows step by step (:meth:`BlockTable.grow_to`) on blocks the
pool reserves for it. Lifecycle ``NEW -> ADMITTED -> RELEASED``; a call that returns
``None``/``False`` or raises changes neither the table nor the pool. See docs/offload.md and
docs/attention.md.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvplane.blocks.hashing import (
    BlockHasher,
    ExtraKey,
    TokenIds,
    canonical_token_ids,
    encode_extra_keys,
)
from kvplane.blocks.pool import BlockPool
from kvplane.errors import BlockStateError, InvalidArgumentError
from kvplane.ids import BlockHash, BlockId, RequestId, TokenRange
from kvplane.validators import require_int


def consecutive_runs(values: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    """``[start, stop)`` positions of the maximal runs of consecutive increasing values of
    ``values`` (e.g. block ids that sit back to back in a pool); vectorised."""
    if values.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(values) != 1) + 1
    bounds = np.concatenate(([0], cuts, [values.size]))
    return [(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


class TableState(enum.Enum):
    """Where a block table is in its lifecycle."""

    NEW = "new"
    ADMITTED = "admitted"
    RELEASED = "released"


@dataclass(frozen=True, slots=True)
class AdmitResult:
    """What :meth:`BlockTable.admit` did: blocks (prefix hits first) and the two token ranges."""

    block_ids: tuple[BlockId, ...]
    num_cached_blocks: int
    cached_range: TokenRange
    new_range: TokenRange

    @property
    def num_new_blocks(self) -> int:
        return len(self.block_ids) - self.num_cached_blocks


@dataclass(frozen=True, slots=True)
class Growth:
    """Admit a table step by step: blocks for tokens ``[0, upto)`` now, the rest by
    :meth:`BlockTable.grow_to`, with the pool reserving what it needs to hold ``peak`` blocks
    at once (a window group's chunked prefill: its window span plus a step's blocks)."""

    upto: int
    peak: int

    def __post_init__(self) -> None:
        require_int("Growth.upto", self.upto, min=1)
        require_int("Growth.peak", self.peak, min=1)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockTable:
    """Blocks and token accounting of one request in one :class:`BlockPool` (not thread-safe)."""

    def __init__(
        self,
        request_id: RequestId,
        block_size: int,
        hasher: BlockHasher,
        extra_keys: tuple[ExtraKey, ...] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError(f"request_id must be a non-empty str, got {request_id!r}")
        require_int("block_size", block_size, min=1)
        if not isinstance(hasher, BlockHasher):
            raise InvalidArgumentError(f"hasher must be a BlockHasher, got {hasher!r}")
        encode_extra_keys(extra_keys)  # validate now, not at the first admit
        self._request_id = request_id
        self._block_size = block_size
        self._hasher = hasher
        self._extra_keys = tuple(extra_keys)
        self._state = TableState.NEW
        self._pool: BlockPool | None = None
        self._reset()

    def _reset(self) -> None:
        self._tokens = np.zeros(0, dtype="<i8")  # capacity buffer; valid prefix [:_num_tokens]
        self._num_tokens = 0
        self._block_ids: list[BlockId] = []
        self._hashes: list[BlockHash] = []
        self._num_cached_tokens = 0
        self._num_computed_tokens = 0
        self._num_registered = 0  # blocks [0, n) are in the pool's cache map (hit or cached here)
        self._num_dropped = 0  # entries [0, n) point at the pool's null block
        self._partial = False  # admitted with dropped blocks: its KV is partial, never cached
        self._peak: int | None = None  # admitted with a Growth: the most blocks it holds
        self._reserved = 0  # blocks the pool reserves for its growth

    # -- properties ------------------------------------------------------------------------
    @property
    def request_id(self) -> RequestId:
        return self._request_id

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def extra_keys(self) -> tuple[ExtraKey, ...]:
        return self._extra_keys

    @property
    def state(self) -> TableState:
        return self._state

    @property
    def token_ids(self) -> np.ndarray:
        """A read-only int64 ``[num_tokens]`` view of the request's tokens."""
        view = self._tokens[: self._num_tokens]
        view.flags.writeable = False
        return view

    @property
    def block_ids(self) -> tuple[BlockId, ...]:
        return tuple(self._block_ids)

    @property
    def num_dropped_blocks(self) -> int:
        """Leading entries that point at the pool's null block (their blocks were freed)."""
        return self._num_dropped

    @property
    def num_held_blocks(self) -> int:
        """Blocks the table holds in its pool: every entry but the dropped ones."""
        return len(self._block_ids) - self._num_dropped

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks the pool reserves for this table's growth (:class:`Growth`; else 0)."""
        return self._reserved

    @property
    def num_covered_tokens(self) -> int:
        """Leading tokens its entries cover (all but a :class:`Growth` table's not grown yet)."""
        return min(self._num_tokens, len(self._block_ids) * self._block_size)

    @property
    def block_hashes(self) -> tuple[BlockHash, ...]:
        """Chained hashes of the full blocks, ``num_tokens // block_size`` of them."""
        return tuple(self._hashes)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached_tokens

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV is in the pool: cached prefix plus computed by this run."""
        return self._num_computed_tokens

    @property
    def cached_range(self) -> TokenRange:
        return TokenRange(0, self._num_cached_tokens)

    @property
    def computed_range(self) -> TokenRange:
        return TokenRange(self._num_cached_tokens, self._num_computed_tokens)

    @property
    def new_range(self) -> TokenRange:
        return TokenRange(self._num_computed_tokens, self._num_tokens)

    # -- checks ----------------------------------------------------------------------------
    def _check_pool(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise InvalidArgumentError(f"expected a BlockPool, got {pool!r}")
        if pool.block_size != self._block_size:
            raise InvalidArgumentError(
                f"request {self._request_id!r} has block_size {self._block_size}, "
                f"the pool has {pool.block_size}"
            )
        if self._pool is not None and pool is not self._pool:
            raise InvalidArgumentError(
                f"request {self._request_id!r} is bound to another pool than {pool!r}"
            )

    def _require(self, state: TableState, action: str) -> None:
        if self._state is not state:
            raise BlockStateError(
                f"cannot {action} request {self._request_id!r}: table is {self._state.value}"
            )

    # -- lifecycle -------------------------------------------------------------------------
    def admit(
        self,
        pool: BlockPool,
        token_ids: TokenIds,
        *,
        drop_before: int = 0,
        max_cached_blocks: int | None = None,
        grow: Growth | None = None,
    ) -> AdmitResult | None:
        """Match the longest cached prefix, share it and allocate blocks for the rest.

        ``token_ids`` (non-empty; see :func:`canonical_token_ids`) become the table's tokens.
        Full blocks are hashed; leading blocks found by ``pool.lookup`` (at most
        ``(len - 1) // block_size``) are touched, and ``ceil(len / block_size) - hits`` fresh
        blocks are allocated. Returns ``None`` with nothing changed when the pool cannot supply
        the fresh blocks (a hit that is currently free counts against the free blocks, since
        touching it takes it out of the free queue; ``pool.lookup`` prefers a copy in use, so
        a free copy is counted only when no in-use copy of that block exists). Raises
        :class:`BlockStateError` unless the table is NEW, :class:`InvalidArgumentError` for bad
        tokens or a mismatched pool.

        ``drop_before > 0`` (a receiver that gets only a window's KV, from that position on): no
        prefix is matched, the table never caches a block (its KV is partial), and the entries
        of the blocks wholly before it point at ``pool.null_block`` from the start (not
        allocated). ``InvalidArgumentError`` for a position past the tokens, or for one
        that drops a block in a pool without a null block.

        ``max_cached_blocks`` caps the prefix hits (a model's KV cache groups, one table each,
        use the prefix every group holds). ``grow``: allocate blocks only for tokens
        ``[0, grow.upto)`` (and the prefix hits) and reserve in the pool what the table needs
        to reach ``grow.peak`` held blocks (at most the blocks it lacks), all counted against the
        pool's available blocks (:attr:`BlockPool.num_available_blocks`).
        """
        self._require(TableState.NEW, "admit")
        self._check_pool(pool)
        tokens = canonical_token_ids(token_ids)
        n = int(tokens.size)
        if n == 0:
            raise InvalidArgumentError(f"request {self._request_id!r} admitted with no tokens")
        bs = self._block_size
        first = require_int("drop_before", drop_before, min=0, max=n)
        limit = (n - 1) // bs if first == 0 else 0
        if max_cached_blocks is not None:
            limit = min(limit, require_int("max_cached_blocks", max_cached_blocks, min=0))
        dropped = first // bs
        nulls = [self._null_of(pool)] * dropped if dropped else []
        hashes = self._hasher.hash_blocks(tokens, bs, self._extra_keys)
        hits: list[BlockId] = []
        for h in hashes[:limit]:
            block = pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        if grow is not None and not isinstance(grow, Growth):
            raise InvalidArgumentError(f"grow must be a Growth, got {grow!r}")
        total = _ceil_div(n, bs)
        cover = total if grow is None else min(total, _ceil_div(grow.upto, bs))
        num_new = max(cover - len(hits) - dropped, 0)
        held = len(hits) + num_new
        reserve = 0 if grow is None else max(0, min(grow.peak - held, total - held - dropped))
        taken_from_free = sum(1 for b in hits if pool.ref_count(b) == 0)
        if pool.num_available_blocks - taken_from_free < num_new + reserve:
            return None
        pool.touch(hits)
        pool.reserve(reserve)
        fresh = pool.allocate(num_new)
        if fresh is None:  # pragma: no cover - availability was checked just above
            pool.free(hits)
            raise BlockStateError("pool shrank between the availability check and allocate")
        self._pool = pool
        self._tokens = tokens
        self._num_tokens = n
        self._block_ids = hits + nulls + fresh
        self._hashes = hashes
        self._num_cached_tokens = self._num_computed_tokens = len(hits) * bs
        self._num_registered = len(hits)
        self._num_dropped, self._partial = dropped, first > 0
        self._peak, self._reserved = (None if grow is None else grow.peak), reserve
        self._state = TableState.ADMITTED
        return AdmitResult(
            block_ids=tuple(self._block_ids),
            num_cached_blocks=len(hits),
            cached_range=self.cached_range,
            new_range=self.new_range,
        )

    def append_tokens(self, pool: BlockPool, token_ids: TokenIds) -> bool:
        """Grow the request by ``token_ids`` (e.g. decoded tokens), allocating blocks as needed.

        The new tokens join ``new_range``; only the newly full blocks are hashed, chained on
        the last hash (every block of a request is hashed once). Returns ``False`` with nothing
        changed, and nothing hashed, when the pool is short of blocks. Raises
        :class:`BlockStateError` unless ADMITTED, :class:`InvalidArgumentError` for bad tokens
        or another pool.
        """
        self._require(TableState.ADMITTED, "append to")
        self._check_pool(pool)
        tokens = canonical_token_ids(token_ids)
        k = int(tokens.size)
        if k == 0:
            return True
        bs = self._block_size
        total = self._num_tokens + k
        n = self._num_tokens
        if self._tokens.size < total:  # grow geometrically: amortised O(1) per decoded token
            candidate = np.zeros(max(total, 2 * self._tokens.size), dtype="<i8")
            candidate[:n] = self._tokens[:n]
        else:
            candidate = self._tokens
        candidate[n:total] = tokens  # past the valid prefix: invisible until committed below
        need = _ceil_div(total, bs) - len(self._block_ids)
        if pool.num_available_blocks < need:  # before hashing: a refused append hashes nothing
            return False
        done = len(self._hashes)
        parent = self._hashes[-1] if self._hashes else None
        new_hashes = self._hasher.hash_blocks(  # only the newly full blocks, chained on
            candidate[done * bs : (total // bs) * bs], bs, self._extra_keys, parent
        )
        fresh = pool.allocate(need)
        if fresh is None:  # pragma: no cover - availability was checked just above
            return False
        self._tokens = candidate
        self._num_tokens = total
        self._block_ids += fresh
        self._hashes += new_hashes
        return True

    def mark_computed(self, pool: BlockPool, num_tokens: int) -> None:
        """Record that the next ``num_tokens`` tokens of ``new_range`` now have KV in the pool.

        Every block that becomes full and computed is registered with ``pool.cache_block``
        under its hash. Raises :class:`InvalidArgumentError` unless ``0 <= num_tokens`` and
        the tokens lie in ``new_range`` and the covered ones, :class:`BlockStateError` unless
        ADMITTED.
        """
        self._require(TableState.ADMITTED, "mark computed tokens of")
        self._check_pool(pool)
        remaining = self.num_covered_tokens - self._num_computed_tokens
        require_int("num_tokens", num_tokens)
        if not 0 <= num_tokens <= remaining:
            raise InvalidArgumentError(
                f"request {self._request_id!r}: cannot mark {num_tokens} tokens computed, "
                f"{remaining} remain in {self.new_range}"
            )
        self._num_computed_tokens += num_tokens
        if self._partial:
            return
        full = self._num_computed_tokens // self._block_size
        for i in range(self._num_registered, full):
            pool.cache_block(self._block_ids[i], self._hashes[i])
        self._num_registered = max(self._num_registered, full)

    def drop_before(self, pool: BlockPool, position: int) -> int:
        """Free every held block wholly before ``position`` and point its entry at the pool's
        null block; return how many were freed (0: nothing to drop, no null block needed).

        The caller vouches that no step reads or writes positions below ``position`` again
        (:meth:`~kvplane.layout.KVLayout.window_start` of the positions computed). Freed
        blocks keep their cache hash (another request may still match them); the table never
        caches a dropped entry. Raises :class:`BlockStateError` unless ADMITTED,
        :class:`InvalidArgumentError` for another pool, a position beyond the table's tokens or
        a pool without a null block, before changing anything.
        """
        self._require(TableState.ADMITTED, "drop blocks of")
        self._check_pool(pool)
        require_int("position", position, min=0, max=self._num_tokens)
        upto = min(position // self._block_size, len(self._block_ids))
        if upto <= self._num_dropped:
            return 0
        null = self._null_of(pool)
        gone = self._block_ids[self._num_dropped : upto]
        pool.free(gone)
        self._block_ids[self._num_dropped : upto] = [null] * len(gone)
        self._num_dropped = upto
        self._num_registered = max(self._num_registered, upto)
        self._sync_reserve(pool)
        return len(gone)

    def grow_to(self, pool: BlockPool, end: int) -> bool:
        """Cover tokens ``[0, end)`` with blocks (a :class:`Growth` table's next step), drawn
        on its reservation first, then on the pool's available blocks; its reservation is then
        what it still lacks to hold its peak. Returns False, changing nothing, when the pool is
        short. :class:`BlockStateError` unless ADMITTED, :class:`InvalidArgumentError` for
        another pool or ``end`` beyond the tokens, before any change.
        """
        self._require(TableState.ADMITTED, "grow")
        self._check_pool(pool)
        require_int("end", end, min=0, max=self._num_tokens)
        fresh = max(0, _ceil_div(end, self._block_size) - len(self._block_ids))
        draw = min(fresh, self._reserved)
        got = pool.allocate(fresh, reserved=draw)
        if got is None:
            return False
        self._reserved -= draw
        self._block_ids += got
        self._sync_reserve(pool)
        return True

    def _sync_reserve(self, pool: BlockPool) -> None:
        """A :class:`Growth` table's reservation: what it still lacks to hold its peak, at most
        the blocks it has no entry for yet (as much of a rise as the pool has available)."""
        if self._peak is None:
            return
        lacking = _ceil_div(self._num_tokens, self._block_size) - len(self._block_ids)
        want = max(0, min(self._peak - self.num_held_blocks, lacking))
        if want < self._reserved:
            pool.unreserve(self._reserved - want)
        else:
            want = self._reserved + min(want - self._reserved, pool.num_available_blocks)
            pool.reserve(want - self._reserved)
        self._reserved = want

    def _null_of(self, pool: BlockPool) -> BlockId:
        null = pool.null_block
        if null is None:
            raise InvalidArgumentError(
                f"request {self._request_id!r}: dropping blocks needs a pool with a null block"
            )
        return null

    def release(self, pool: BlockPool) -> None:
        """Free every block in REVERSE order (the tail is evicted before the shared prefix)
        and return its reservation.

        Idempotent: releasing a NEW or RELEASED table only marks it RELEASED. Afterwards the
        table holds no tokens and no blocks. Raises :class:`InvalidArgumentError` for another
        pool (nothing is freed then).
        """
        if self._state is TableState.ADMITTED:
            self._check_pool(pool)
            pool.free(self._block_ids[self._num_dropped :][::-1])
            pool.unreserve(self._reserved)
        self._reset()
        self._state = TableState.RELEASED

    # -- KV addressing -------------------------------------------------------------------------
    def slot_mapping(self, token_range: TokenRange) -> torch.Tensor:
        """Flat slot of each token of ``token_range``: ``block_id * block_size + offset``.

        Returns an int64 CPU tensor of shape ``[len(token_range)]``; token ``t`` maps to
        ``block_ids[t // block_size] * block_size + t % block_size``. The range must lie in
        ``[0, num_tokens)`` past the dropped blocks (:class:`InvalidArgumentError`); the table
        must be ADMITTED.
        """
        self._require(TableState.ADMITTED, "map slots of")
        if not isinstance(token_range, TokenRange):
            raise InvalidArgumentError(f"expected a TokenRange, got {token_range!r}")
        covered = self.num_covered_tokens
        held = TokenRange(min(self._num_dropped * self._block_size, covered), covered)
        if not held.contains(token_range):
            raise InvalidArgumentError(
                f"token range {token_range} is outside request {self._request_id!r}'s "
                f"held tokens {held}"
            )
        if token_range.empty:
            return torch.zeros(0, dtype=torch.int64)
        bs = self._block_size
        first = token_range.start // bs
        last = (token_range.end - 1) // bs
        blocks = np.asarray(self._block_ids[first : last + 1], dtype=np.int64)
        pos = np.arange(token_range.start, token_range.end, dtype=np.int64)
        slots = blocks[pos // bs - first] * bs + pos % bs
        return torch.from_numpy(slots)
