"""Which prefill ranks together cover one decode worker's KV, for a request fed by several.

:func:`gather_set` picks, from the prefill workers up, ranks whose KV pools (TP heads × PP
layers, as their :class:`~kvplane.serving.messages.WorkerInfo` says) hold the decode worker's
heads × layers exactly once between them, each with the
:class:`~kvplane.transfer.resharding.Piece` it sends; of replicas (the same heads and layers)
one is chosen. The :class:`~kvplane.pd.tiling.Tiling` rule decides what overlaps. Pure: no
queries, no pairing records (those live in :mod:`~kvplane.serving.router.pairings`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.ids import TokenRange
from kvplane.layout import shared_heads
from kvplane.pd.tiling import Tiling
from kvplane.serving.messages import WorkerInfo
from kvplane.serving.router.workers import WorkerHandle, same_pools
from kvplane.transfer.resharding import KVBox, Piece, SenderId

ANY_TOKENS = TokenRange(0, 1)
"""A gather set is chosen per layout pair, not per request: one token stands for them all."""


def destination(info: WorkerInfo) -> KVBox | None:
    """The KV cells a worker's KV pool holds (its first pool's heads × its layers), or None
    when it does not say both."""
    if not info.head_ranges or not info.layer_ids:
        return None
    return KVBox(info.head_ranges[0], info.layer_ids, ANY_TOKENS)


def _piece(p: WorkerInfo, dest: KVBox) -> Piece | None:
    """What prefill ``p`` would send into ``dest`` (the cells both hold), or None."""
    held = destination(p)
    if held is None:
        return None
    heads = shared_heads(held.heads, dest.heads)
    layers = tuple(layer for layer in held.layers if layer in set(dest.layers))
    if heads is None or not layers:
        return None
    return Piece(SenderId(p.pp_stage, p.tp_rank), KVBox(heads, layers, ANY_TOKENS))


def gather_set(
    prefill: Sequence[WorkerHandle], d: WorkerHandle
) -> list[tuple[WorkerHandle, Piece]] | None:
    """Prefill workers up (with the piece each sends) whose pieces tile decode worker ``d``'s
    KV pool exactly once, or None when none do, or when ``d`` or the candidates do not say
    their heads and layers (a single covering prefill worker is :func:`~kvplane.serving.
    router.workers.covering`'s business). Largest pieces first, then by (PP stage, TP rank)
    and address, so a rank holding everything is a set of one and a replica is skipped once
    its cells are taken; a candidate whose pools cannot pair with ``d``'s (:func:`~kvplane.
    serving.router.workers.same_pools`), or whose
    (stage, rank) another member already has, is never chosen (the member wire ids are
    per sender)."""
    if d.info is None:
        return None
    dest = destination(d.info)
    if dest is None:
        return None
    candidates = []
    for p in prefill:
        if not p.up or p.info is None or not same_pools(p.info, d.info):
            continue
        piece = _piece(p.info, dest)
        if piece is not None:
            candidates.append((-piece.box.cells, piece.sender, p.address, p, piece))
    tiling = Tiling(dest)
    chosen: list[tuple[WorkerHandle, Piece]] = []
    for _, sender, _, p, piece in sorted(candidates, key=lambda c: c[:3]):
        if sender in tiling.senders or tiling.conflict(piece) is not None:
            continue
        tiling.add(piece)
        chosen.append((p, piece))
        if tiling.complete:
            return chosen
    return None
