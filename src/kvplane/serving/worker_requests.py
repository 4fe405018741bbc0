"""A PD worker's requests: the rules the prefill and decode workers share for their book.

Each worker keeps its requests by id and by session, admits one when blocks (in every KV cache
group's pool) and a tail slot are free, and frees and forgets it by the same rules; only what a
request does differs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np

from kvplane.blocks import BlockTable, GroupShort, Growth, admit_groups
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.ids import RegionId, RequestId, SessionId
from kvplane.models.generate import group_peaks
from kvplane.pipeline.slicing import LocalPool
from kvplane.pipeline.timeline import Mark
from kvplane.serving.pools import WorkerPools
from kvplane.serving.worker import Worker


class _Order(Protocol):
    @property
    def request_id(self) -> str: ...


class HeldRequest(Protocol):
    """What the shared rules read and write of a worker's request record."""

    @property
    def order(self) -> _Order: ...

    sid: SessionId
    tokens: np.ndarray
    table: BlockTable | None
    group_tables: tuple[BlockTable, ...]
    slot: int | None
    failed_at: float | None


R = TypeVar("R", bound=HeldRequest)


def check_new(
    requests: dict[RequestId, R], by_session: dict[SessionId, R], rid: RequestId, sid: SessionId
) -> None:
    """``InvalidArgumentError`` if ``rid`` is already on this worker or ``sid`` is bound to
    another request."""
    if rid in requests:
        raise InvalidArgumentError(f"request {rid!r} is already on this worker")
    bound = by_session.get(sid)
    if bound is not None:
        other = bound.order.request_id
        raise InvalidArgumentError(f"session {sid!r} is already bound to request {other!r}")


def check_fits(rid: RequestId, need: int, num_blocks: int) -> None:
    """``ConfigError`` if a request needing ``need`` blocks could never fit a pool of
    ``num_blocks``."""
    if need > num_blocks:
        raise ConfigError(f"request {rid!r} needs {need} blocks; the pool has {num_blocks}")


def find_to_stop(requests: dict[RequestId, R], rid: RequestId, sid: str | None) -> R | None:
    """Request ``rid`` (None if unknown, or bound to another session than ``sid`` when given),
    stamped with the time it began to fail unless it already was."""
    req = requests.get(rid)
    if req is None or (sid is not None and req.sid != sid):
        return None
    if req.failed_at is None:
        req.failed_at = time.monotonic()
    return req


def received_need(pools: WorkerPools, num_tokens: int, max_new_tokens: int) -> int:
    """The most blocks one KV cache group's pool must give a decoded request whose prompt's
    window arrives (:func:`~kvplane.models.generate.group_peaks`, ``received``)."""
    layouts = [kv.layout for kv in pools.kv.pools]
    return max(group_peaks(num_tokens, max_new_tokens, layouts, pools.block_pools, received=True))


def admit_memory(
    pools: WorkerPools,
    block_size: int,
    req: HeldRequest,
    *,
    received: bool = False,
    grow: Sequence[Growth | None] | None = None,
) -> tuple[BlockTable, int] | None:
    """Give ``req`` a table per KV cache group for its tokens and a tail slot, and return group
    0's table and the slot (groups 1..'s in ``req.group_tables``); None, holding nothing, while
    blocks or slots are short. Cached prefix blocks are shared, as many as every group holds
    (:func:`~kvplane.blocks.admit_groups`). ``received``: a receiver's tables, whose blocks
    wholly before each group's window of the prompt (positions the sender does not send) are
    none (``drop_before``). ``grow[g]``: group ``g``'s table grows step by step on a
    reservation (:class:`~kvplane.blocks.Growth`, the pool's available blocks must cover its
    peak). ``InvalidArgumentError`` unless ``block_size`` is the pools'."""
    if block_size != pools.blocks.block_size:
        raise InvalidArgumentError(
            f"block size {block_size}; the pools' is {pools.blocks.block_size}"
        )
    if pools.slots.num_free_blocks == 0:
        return None
    n, rid = len(req.tokens), RequestId(req.order.request_id)
    firsts = [kv.layout.window_start(n) for kv in pools.kv.pools] if received else None
    got = admit_groups(
        pools.block_pools, pools.hashers, rid, req.tokens, drop_before=firsts, grow=grow
    )
    if isinstance(got, GroupShort):
        return None
    slot = pools.take_slot()
    if slot is None:  # pragma: no cover - checked above; only the worker's thread allocates
        for table, pool in zip(got, pools.block_pools, strict=True):
            table.release(pool)
        return None
    req.table, req.group_tables, req.slot = got[0], tuple(got[1:]), slot
    return got[0], slot


def destination_ids(pools: WorkerPools, req: HeldRequest) -> tuple[int, ...]:
    """A receiver's ``dst_block_ids``: each KV cache group's block ids, one group after the
    other, then the request's slot once per whole-only pool (``advert.split_destination``)."""
    if req.table is None or req.slot is None:
        raise InvalidArgumentError(f"request {req.order.request_id!r} holds no memory")
    ids = [int(b) for t in (req.table, *req.group_tables) for b in t.block_ids]
    return (*ids, *(req.slot,) * (len(pools.layouts) - pools.num_kv_pools))


def local_pools(pools: WorkerPools, req: HeldRequest) -> tuple[LocalPool, ...]:
    """A sender's pools as plan sources: each KV cache group's with the request's blocks in
    it, then each whole-only pool with its slot."""
    if req.table is None or req.slot is None:
        raise InvalidArgumentError(f"request {req.order.request_id!r} holds no memory")
    tables = (req.table, *req.group_tables)
    regions = [RegionId(r) for r in pools.regions]
    k = pools.num_kv_pools
    paged = [
        LocalPool(lay, r, t.block_ids)
        for lay, r, t in zip(pools.layouts[:k], regions[:k], tables, strict=True)
    ]
    whole = [
        LocalPool(lay, r, (req.slot,))
        for lay, r in zip(pools.layouts[k:], regions[k:], strict=True)
    ]
    return (*paged, *whole)


def group_block_ids(req: HeldRequest) -> tuple[tuple[int, ...], ...]:
    """The block ids of KV cache groups 1.. of ``req`` (a step's ``group_block_ids``)."""
    return tuple(tuple(t.block_ids) for t in req.group_tables)


def free_memory(worker: Worker, req: HeldRequest) -> bool:
    """Free ``req``'s blocks (in every KV cache group) and tail slot. If it held any, record
    ``RELEASED`` and, for a request that failed, the release latency; True then, else False
    (nothing done)."""
    if req.table is None and req.slot is None:
        return False
    if req.table is not None:
        req.table.release(worker.pools.blocks)
        req.table = None
    for table, pool in zip(req.group_tables, worker.pools.group_blocks, strict=True):
        table.release(pool)
    req.group_tables = ()
    if req.slot is not None:
        worker.pools.free_slot(req.slot)
        req.slot = None
    worker.timeline.record(Mark.RELEASED, req.order.request_id)
    if req.failed_at is not None:
        worker.rmetrics.release_latency.observe(time.monotonic() - req.failed_at)
    return True


def forget(requests: dict[RequestId, R], by_session: dict[SessionId, R], req: R) -> None:
    """Drop ``req`` from both maps, never another request's entry under the same keys."""
    rid = RequestId(req.order.request_id)
    if requests.get(rid) is req:
        del requests[rid]
    if by_session.get(req.sid) is req:
        del by_session[req.sid]
