"""Workers as the router sees them, and which prefill worker can serve which decode worker.

:class:`WorkerHandle` is one worker's address, order client and latest answers; :func:`serves`
and :func:`covering` decide by TP head ranges alone (pure: no queries, no pairing records,
which live in :mod:`~kvplane.serving.router.pairings`). See docs/serving.md (Membership).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvplane.layout import heads_cover
from kvplane.serving.messages import AnyMessage, WorkerInfo
from kvplane.serving.rpc import RpcClient


@dataclass(slots=True, eq=False)
class WorkerHandle:
    """A worker as the router sees it: ``up`` while it answers info queries; ``repair``: a
    decode worker one of whose pairings was refused or not answered at its last try (that
    pair is tried again, with backoff); ``uncovered``: a decode worker reported as having no
    prefill worker up that covers its KV heads (reported again only once it was covered, or
    when it rejoins); ``asked``: the queries sent to it and not answered yet with when they
    were sent, at most one per message (see :meth:`Membership.ask`); ``heard_at``: when the
    info query ``info`` answers was sent (monotonic)."""

    address: str
    client: RpcClient
    info: WorkerInfo | None = None
    heard_at: float = 0.0
    up: bool = False
    repair: bool = False
    uncovered: bool = False
    asked: dict[AnyMessage, tuple[Future[AnyMessage], float]] = field(default_factory=dict)


def serves(prefill: WorkerInfo, decode: WorkerInfo) -> bool:
    """True when ``prefill`` can send ``decode`` a session's KV alone: its head range covers
    the decode worker's in every pool (:func:`~kvplane.layout.heads_cover`) and, when both say
    their ``layer_ids``, it holds every layer the decode worker does (a pipeline stage alone
    serves no decode worker holding other layers). Also True when either does not say its
    heads (empty ``head_ranges``): the PD handshake then decides. False when both say and
    count different pools (:func:`same_pools`): the handshake refuses such a pair. Pure."""
    if prefill.layer_ids and not set(decode.layer_ids) <= set(prefill.layer_ids):
        return False
    held, needed = prefill.head_ranges, decode.head_ranges
    if not held or not needed:
        return True
    if not same_pools(prefill, decode):
        return False
    if prefill.paged_pools and decode.paged_pools:  # paged pools pair by layers, whole in order
        whole = zip(held[prefill.paged_pools :], needed[decode.paged_pools :], strict=True)
        return heads_cover(held[0], needed[0]) and all(heads_cover(h, n) for h, n in whole)
    return all(heads_cover(h, n) for h, n in zip(held, needed, strict=True))


def same_pools(a: WorkerInfo, b: WorkerInfo) -> bool:
    """Whether two workers' pools can pair as the PD handshake pairs them
    (:func:`~kvplane.pd.handshake.pool_pairs`): when both say their ``paged_pools``, the same
    number of whole-only pools (paged pools pair by layers: one pool of every layer feeds KV
    cache groups and back; every paged pool of a rank holds the same KV heads), else the same
    number of pools. Pure."""
    if a.paged_pools and b.paged_pools:
        return len(a.head_ranges) - a.paged_pools == len(b.head_ranges) - b.paged_pools
    return len(a.head_ranges) == len(b.head_ranges)


def covering(prefill: Sequence[WorkerHandle], d: WorkerHandle) -> list[WorkerHandle]:
    """The prefill workers up (in order) that serve decode worker ``d`` (:func:`serves`)."""
    if d.info is None:
        return []
    return [p for p in prefill if p.up and p.info is not None and serves(p.info, d.info)]


def heads_of(w: WorkerHandle) -> str:
    """``w``'s address and KV head ranges, for a message."""
    ranges = "unknown" if w.info is None or not w.info.head_ranges else str(w.info.head_ranges)
    return f"{w.address} (KV heads per pool {ranges})"
