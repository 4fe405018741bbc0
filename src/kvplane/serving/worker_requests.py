"""A PD worker's requests: the rules the prefill and decode workers share for their book.

Each worker keeps its requests by id and by session, admits one when blocks and a tail slot are
free, and frees and forgets it by the same rules; only what a request does differs.
"""

from __future__ import annotations

import time
from typing import Protocol, TypeVar

import numpy as np

from kvplane.blocks import BlockTable
from kvplane.errors import ConfigError, InvalidArgumentError
from kvplane.ids import RequestId, SessionId
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


def admit_memory(
    pools: WorkerPools, block_size: int, req: HeldRequest, *, drop_before: int = 0
) -> tuple[BlockTable, int] | None:
    """Give ``req`` blocks for its tokens (cached prefix blocks shared; the blocks wholly
    before ``drop_before``, a receiver's unsent out-of-window positions, none: see
    :meth:`~kvplane.blocks.BlockTable.admit`) and a tail slot, and return them; None, holding
    nothing, while either is short."""
    table = BlockTable(RequestId(req.order.request_id), block_size, pools.hasher)
    if pools.slots.num_free_blocks == 0:
        return None
    if table.admit(pools.blocks, req.tokens, drop_before=drop_before) is None:
        return None
    slot = pools.take_slot()
    if slot is None:  # pragma: no cover - checked above; only the worker's thread allocates
        table.release(pools.blocks)
        return None
    req.table, req.slot = table, slot
    return table, slot


def free_memory(worker: Worker, req: HeldRequest) -> bool:
    """Free ``req``'s blocks and tail slot. If it held any, record ``RELEASED`` and, for a
    request that failed, the release latency; True then, else False (nothing done)."""
    if req.table is None and req.slot is None:
        return False
    if req.table is not None:
        req.table.release(worker.pools.blocks)
        req.table = None
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
