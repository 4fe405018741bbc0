"""The block tables of one request across a model's KV cache groups: one table per group's pool.

Owns the rules every user of KV cache groups shares: admission with the prefix every group holds
(:func:`admit_groups`; a window group's chunked prefill step by step within
:func:`window_peak` blocks), growth by decoded tokens in every group at once
(:func:`grow_groups`, :func:`short_group`), and the upkeep after a step: computed tokens
marked, and in each pool with a null block the blocks no later step reads dropped
(:func:`after_step`, :func:`drop_windows`). Knows windows only through each group's
``window_start`` (a :class:`~kvplane.layout.KVLayout`); holds no state and owns no tensors.
See docs/attention.md, "KV cache groups".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvplane.blocks.hashing import BlockHasher, TokenIds, canonical_token_ids
from kvplane.blocks.pool import BlockPool
from kvplane.blocks.table import BlockTable, Growth
from kvplane.errors import InvalidArgumentError
from kvplane.ids import RequestId, TokenRange
from kvplane.validators import require_int


class Windowed(Protocol):
    """What the upkeep reads of a group's layout: the first position its layers still read
    once ``num_tokens`` tokens are in the pool (:meth:`~kvplane.layout.KVLayout.window_start`)."""

    def window_start(self, num_tokens: int) -> int: ...


@dataclass(frozen=True, slots=True)
class GroupShort:
    """Expected shortage: KV cache group ``group``'s pool lacks free blocks (nothing is held
    or changed by the call that returned it)."""

    group: int


def _check_groups(what: str, n: int, **parts: Sequence[object] | None) -> None:
    """``InvalidArgumentError`` unless every given sequence has one entry per group."""
    for name, seq in parts.items():
        if seq is not None and len(seq) != n:
            raise InvalidArgumentError(f"{what}: {n} KV cache groups but {len(seq)} {name}")


def admit_groups(
    pools: Sequence[BlockPool],
    hashers: Sequence[BlockHasher],
    request_id: RequestId,
    tokens: TokenIds,
    *,
    drop_before: Sequence[int] | None = None,
    grow: Sequence[Growth | None] | None = None,
) -> list[BlockTable] | GroupShort:
    """One admitted :class:`BlockTable` per KV cache group (``pools[g]``, ``hashers[g]``) for
    ``tokens``, each with the prefix every group holds cached: the tables are admitted in
    order, each capped at the hits so far (``max_cached_blocks``), then a group that matched
    more is admitted again with the final cap. ``drop_before[g]``: a receiver's first position
    of group ``g`` (:meth:`BlockTable.admit`; its blocks before it are the null block);
    ``grow[g]``: group ``g``'s table grows step by step on a reservation (a :class:`Growth`;
    None: all its blocks now).

    Returns :class:`GroupShort` naming the first group whose pool lacked free blocks, with
    every table released (each pool's free count as before). ``InvalidArgumentError`` before
    any change for no groups, mismatched lengths or empty tokens; any error from
    :meth:`BlockTable.admit` releases what was admitted and propagates.
    """
    n = len(pools)
    if n == 0:
        raise InvalidArgumentError("admit_groups needs at least one KV cache group")
    _check_groups("admit_groups", n, hashers=hashers, drop_before=drop_before, grow=grow)
    ids = canonical_token_ids(tokens)
    if ids.size == 0:
        raise InvalidArgumentError(f"request {request_id!r} admitted with no tokens")
    firsts = [0] * n if drop_before is None else list(drop_before)
    grows: list[Growth | None] = [None] * n if grow is None else list(grow)
    tables: list[BlockTable | None] = [None] * n

    def admit(g: int, cap_tokens: int | None) -> bool:
        pool = pools[g]
        table = BlockTable(request_id, pool.block_size, hashers[g])
        cap = None if cap_tokens is None else cap_tokens // pool.block_size
        got = table.admit(pool, ids, drop_before=firsts[g], max_cached_blocks=cap, grow=grows[g])
        if got is None:
            return False
        tables[g] = table
        return True

    def release() -> None:
        for g, table in enumerate(tables):
            if table is not None:
                table.release(pools[g])
                tables[g] = None

    try:
        cap: int | None = None
        for g in range(n):
            if not admit(g, cap):
                release()
                return GroupShort(g)
            cap = _held(tables[g]).num_cached_tokens
        for g in range(n):  # a group that matched more than all: the common prefix
            if _held(tables[g]).num_cached_tokens != cap:
                _held(tables[g]).release(pools[g])
                tables[g] = None
                if not admit(g, cap):  # fewer shared blocks: more to allocate
                    release()
                    return GroupShort(g)
    except BaseException:
        release()
        raise
    return [_held(t) for t in tables]


def _held(table: BlockTable | None) -> BlockTable:
    if table is None:  # pragma: no cover - admitted tables are set before they are read
        raise InvalidArgumentError("a KV cache group has no admitted table")
    return table


def window_peak(
    layout: Windowed, num_tokens: int, block_size: int, step: int, store: int = 0
) -> int:
    """The most blocks a window group's table holds while ``num_tokens`` tokens are prefilled
    in steps of at most ``step`` tokens, each step's blocks grown just before it and, after
    it, the blocks wholly before the next step's window (``layout.window_start``, largest
    window ``W``) dropped. It holds the blocks of at most ``D`` consecutive positions, so
    ``(D - 2) // block_size + 2`` blocks whatever their alignment: ``D = step + W - 1``, or
    with a prefix store of ``store``-token units (its chunks issued after each step, held until
    the job ends, the step before's still in flight) ``D = step + max(W, step) - 1 + store``.
    A window the prompt does not outgrow: all its blocks. ``InvalidArgumentError`` for a bad
    count."""
    require_int("num_tokens", num_tokens, min=1)
    require_int("block_size", block_size, min=1)
    require_int("step", step, min=1)
    require_int("store", store, min=0)
    whole = -(-num_tokens // block_size)
    start = layout.window_start(num_tokens)  # num_tokens + 1 - W once the prompt outgrows W
    if start == 0:
        return whole
    window = num_tokens + 1 - start
    span = step + window - 1 if store == 0 else step + max(window, step) - 1 + store
    return min(whole, (span - 2) // block_size + 2)


def short_group(
    tables: Sequence[BlockTable], pools: Sequence[BlockPool], peaks: Sequence[int]
) -> GroupShort | None:
    """The first group whose pool cannot give its table the blocks to reach ``peaks[g]`` held
    blocks (``peaks[g] - num_held_blocks`` more than its available blocks: free, not
    reserved), else None. Pure."""
    _check_groups("short_group", len(tables), pools=pools, peaks=peaks)
    for g, (table, pool, peak) in enumerate(zip(tables, pools, peaks, strict=True)):
        if peak - table.num_held_blocks > pool.num_available_blocks:
            return GroupShort(g)
    return None


def grow_groups(
    tables: Sequence[BlockTable], pools: Sequence[BlockPool], token_ids: TokenIds
) -> GroupShort | None:
    """Append ``token_ids`` (e.g. the token just decoded) to every group's table
    (:meth:`BlockTable.append_tokens`), all or none: :class:`GroupShort` for the first group
    whose pool lacks the blocks, with no table changed."""
    _check_groups("grow_groups", len(tables), pools=pools)
    k = int(canonical_token_ids(token_ids).size)
    for g, (table, pool) in enumerate(zip(tables, pools, strict=True)):
        more = -(-(table.num_tokens + k) // table.block_size) - len(table.block_ids)
        if more > pool.num_available_blocks:  # append_tokens' own rule: free, not reserved
            return GroupShort(g)
    for g, (table, pool) in enumerate(zip(tables, pools, strict=True)):
        if not table.append_tokens(pool, token_ids):  # pragma: no cover - checked just above
            return GroupShort(g)
    return None


def drop_windows(
    tables: Sequence[BlockTable],
    pools: Sequence[BlockPool],
    layouts: Sequence[Windowed],
    position: int,
    *,
    hold: Sequence[int | None] | None = None,
) -> int:
    """In each pool with a null block, free the blocks of its table wholly before
    ``layouts[g].window_start(position)`` (the next step computes ``position`` on; the caller
    vouches nothing else reads them) or, where ``hold[g]`` is a position, before that one if
    lower (a reader such as a prefix store still reads from it). Returns the blocks freed in
    all. ``InvalidArgumentError`` before any change for mismatched lengths or a bad
    position."""
    _check_groups("drop_windows", len(tables), pools=pools, layouts=layouts, hold=hold)
    require_int("position", position, min=0)
    freed = 0
    for g, (table, pool, layout) in enumerate(zip(tables, pools, layouts, strict=True)):
        if pool.null_block is None:
            continue
        upto = min(layout.window_start(position), table.num_tokens)
        held = None if hold is None else hold[g]
        freed += table.drop_before(pool, upto if held is None else min(upto, held))
    return freed


def after_step(
    tables: Sequence[BlockTable],
    pools: Sequence[BlockPool],
    layouts: Sequence[Windowed],
    step: TokenRange,
) -> int:
    """The upkeep after a step computed ``step`` in every group: each table marks
    ``len(step)`` tokens computed (:meth:`BlockTable.mark_computed`), then
    :func:`drop_windows` at ``step.end``. Returns the blocks freed. ``InvalidArgumentError``
    before any change where a table has fewer than ``len(step)`` tokens left to compute."""
    _check_groups("after_step", len(tables), pools=pools, layouts=layouts)
    for table in tables:  # every count checked before any table changes
        left = table.num_tokens - table.num_computed_tokens
        if len(step) > left:
            raise InvalidArgumentError(
                f"request {table.request_id!r}: cannot mark {len(step)} tokens computed, "
                f"{left} remain"
            )
    for table, pool in zip(tables, pools, strict=True):
        table.mark_computed(pool, len(step))
    return drop_windows(tables, pools, layouts, step.end)
