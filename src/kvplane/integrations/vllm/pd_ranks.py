"""PD across tensor-parallel ranks: rank r of a decode engine receives rank r's head shard from
rank r of a prefill engine, one kvplane PD session per (request, rank).

Owns the per-rank pieces of the connector's PD mode: the layout a rank announces and plans with
(:func:`rank_layout`, its head range), its endpoint settings (:func:`rank_settings`), the refusal
of unequal TP sizes (:func:`tp_refusal`) and of a peer holding other heads (:func:`heads_refusal`),
each rank's session id (:func:`rank_session`), the prefill ranks a refusing decode rank tells
(:func:`abandon_peers`), and :class:`RankResults`, which joins the ranks' session results into
one per request. Every PD transport runs at TP > 1: each rank's worker process makes its own.
Plain data: no vLLM, no sockets. See docs/vllm.md ("PD at TP > 1").
"""

from __future__ import annotations

import dataclasses

from kvplane.errors import ConfigError, InvalidArgumentError, UnsupportedError
from kvplane.ids import SessionId
from kvplane.integrations.vllm.messages import PDResult, RecvOp
from kvplane.integrations.vllm.pd_config import PDSettings
from kvplane.integrations.vllm.tp import TPShard
from kvplane.layout import KVLayout, LayoutKind
from kvplane.pd.handshake import LayoutInfo
from kvplane.validators import require_int


def rank_layout(layout: KVLayout, shard: TPShard) -> KVLayout:
    """The layout rank ``shard.rank`` announces in its PD handshake and plans slices with: its
    pool ``layout`` (the rank's ``h`` local KV heads) placed at head range ``[rank*h,
    (rank+1)*h)`` of the engine's ``size*h``. Unchanged at TP 1 and for a replicated (MLA)
    layout. The bytes and strides are the pool's: only the head identity changes, so two ranks'
    layouts differ in fingerprint and a rank paired with another rank's shard is refused (with
    vLLM's KV heads replicated, ``kv_heads < TP``, the range names the rank's shard slot)."""
    if not shard.sharded or layout.kind not in (LayoutKind.MHA, LayoutKind.GQA):
        return layout
    h = layout.local_heads
    return dataclasses.replace(
        layout,
        kind=LayoutKind.GQA,
        total_heads=h * shard.size,
        head_range=(shard.rank * h, (shard.rank + 1) * h),
    )


def rank_settings(settings: PDSettings, shard: TPShard) -> PDSettings:
    """``settings`` for rank ``shard.rank`` of a TP group: a fixed ``pd_bind`` port ``p`` binds
    ``p + rank`` (the ranks of one engine share its host) and the peer name gets
    ``.tp<r>of<n>``. Unchanged at TP 1. ``ConfigError`` when ``p + rank`` is past 65535."""
    if shard.size == 1:
        return settings
    bind = settings.bind
    head, sep, port = bind.rpartition(":")
    if sep and port.isdigit() and int(port) > 0:
        moved = int(port) + shard.rank
        if moved > 65535:
            raise ConfigError(f"pd_bind {bind!r}: rank {shard.rank} would bind port {moved}")
        bind = f"{head}:{moved}"
    name = f"{settings.name}.tp{shard.rank}of{shard.size}"
    return dataclasses.replace(settings, bind=bind, name=name)


def tp_refusal(prefill_tp: int, decode_tp: int) -> UnsupportedError | None:
    """The one-line error refusing PD between engines of different TP sizes, or None when they
    are equal (rank r sends to rank r). The prefill's TP is the number of PD addresses its
    ``kv_transfer_params`` carry."""
    if prefill_tp == decode_tp:
        return None
    return UnsupportedError(
        f"PD from a prefill engine at TP {prefill_tp} to a decode engine at TP {decode_tp}: "
        "kvplane pairs rank r with rank r at equal TP only; heterogeneous TP needs issue #31's "
        "multi-sender session"
    )


def rank_session(session_id: str, rank: int) -> SessionId:
    """The id of rank ``rank``'s PD session of the transfer both engines name ``session_id``:
    ``session_id`` itself at rank 0 (and at TP 1), ``<session_id>.rank<r>`` above. Both engines
    derive it alike, and the sessions of one request differ per rank, so one participant can end
    the sessions of several prefill ranks (:func:`abandon_peers`)."""
    return SessionId(session_id if rank == 0 else f"{session_id}.rank{rank}")


def abandon_peers(op: RecvOp, shard: TPShard) -> tuple[tuple[str, SessionId], ...]:
    """(endpoint, session id) of each prefill rank that decode rank ``shard.rank`` of
    ``shard.size`` tells that a refused request (``op.abandon``) will never be asked for:
    prefill ranks ``rank, rank + size, ...`` of those ``op`` names, so the decode engine's
    ranks together tell every prefill rank once, whatever the two TP sizes (a TP 1 decode tells
    both ranks of a TP 2 prefill; rank 1 of a TP 2 decode tells no TP 1 prefill)."""
    addresses = op.rank_addresses or (op.address,)
    ranks = range(shard.rank, len(addresses), shard.size)
    return tuple((addresses[r], rank_session(op.session_id, r)) for r in ranks)


class RankResults:
    """Joins the ranks' :class:`PDResult` of one request's transfer (per request and role).

    A transfer is done only once all ``size`` ranks reported their session; its ``ok`` is the
    AND of theirs and its ``reason`` the first failed rank's. The first failure while other
    ranks still run is flagged, so the caller ends their sessions too (a request never keeps
    part of its KV). Not thread-safe.
    """

    def __init__(self, size: int) -> None:
        self.size = require_int("RankResults.size", size, min=1)
        self._parts: dict[tuple[str, str], tuple[frozenset[int], PDResult]] = {}

    def add(self, result: PDResult) -> tuple[PDResult | None, bool]:
        """(the joined result once ``result`` completes its transfer, else None; True when
        ``result`` is the first failure of a transfer other ranks have not reported yet).
        ``InvalidArgumentError`` for a rank outside the group or one reporting twice."""
        require_int("PDResult.rank", result.rank, min=0, max=self.size - 1)
        if self.size == 1:
            return result, False
        part = (result.req_id, result.role)
        ranks, joined = self._parts.get(part, (frozenset(), None))
        if result.rank in ranks:
            raise InvalidArgumentError(f"rank {result.rank} reported PD {part} twice")
        first_failure = not result.ok and (joined is None or joined.ok)
        if joined is None or (joined.ok and not result.ok):
            why = result.reason if result.ok else f"rank {result.rank}: {result.reason}"
            joined = PDResult(result.req_id, result.role, result.ok, why)
        ranks = ranks | {result.rank}
        if len(ranks) < self.size:
            self._parts[part] = (ranks, joined)
            return None, first_failure
        self._parts.pop(part, None)
        return joined, False

    @property
    def waiting(self) -> int:
        """Transfers some but not all ranks reported."""
        return len(self._parts)


def heads_refusal(ours: KVLayout, theirs: LayoutInfo, *, sender: bool) -> UnsupportedError | None:
    """The one-line refusal of a PD peer whose pool holds other KV heads than ours (``ours``:
    this rank's :func:`rank_layout`; ``sender``: we send), or None when they hold the same. A
    transfer moves whole blocks (the CPU kernel's bytes inside a block are not in head order),
    so ranks pair only when their head ranges are equal: another TP size is
    :func:`tp_refusal`'s error; the same TP size, another rank, names both ranges."""
    held = (theirs.head_start, theirs.head_end)
    if (theirs.total_heads, held) == (ours.total_heads, ours.head_range):
        return None
    their_tp = theirs.total_heads // max(1, held[1] - held[0])
    our_tp = ours.total_heads // ours.local_heads
    if their_tp != our_tp:
        return tp_refusal(our_tp, their_tp) if sender else tp_refusal(their_tp, our_tp)
    return UnsupportedError(
        f"the PD peer's rank holds KV heads [{held[0]}, {held[1]}) of {theirs.total_heads}, "
        f"this rank [{ours.head_range[0]}, {ours.head_range[1]}): rank r pairs only with rank r"
    )
