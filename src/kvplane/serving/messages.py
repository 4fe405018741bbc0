"""The control messages between router, workers and clients: typed, versioned, size-limited.

Orders and reports, not the PD protocol; no pickle. See docs/serving.md.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvplane.errors import InvalidArgumentError

RUNTIME_VERSION = 1
MAX_TOKENS = 1 << 22

_Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Text = Annotated[str, msgspec.Meta(max_length=4096)]
_Token = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
_Tokens = Annotated[tuple[_Token, ...], msgspec.Meta(min_length=1, max_length=MAX_TOKENS)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]
_Head = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
MAX_POOLS = 64
"""Most pools a worker may describe in :attr:`WorkerInfo.head_ranges`."""
_HeadRanges = Annotated[tuple[tuple[_Head, _Head], ...], msgspec.Meta(max_length=MAX_POOLS)]
MAX_PEERS = 1024
"""Most PD peers a worker lists in :attr:`WorkerInfo.peers` (with more it does not say)."""
_Peers = Annotated[tuple[_Id, ...], msgspec.Meta(max_length=MAX_PEERS)]
MAX_LAYERS = 4096
"""Most layer ids a worker lists in :attr:`WorkerInfo.layer_ids`."""
_Layers = Annotated[tuple[_Head, ...], msgspec.Meta(max_length=MAX_LAYERS)]
_Fingerprint = Annotated[bytes, msgspec.Meta(max_length=4096)]


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """Base of every runtime message."""


class InfoQuery(Message, frozen=True, kw_only=True, tag="info_query"):
    """Ask a worker who it is."""


class WorkerInfo(Message, frozen=True, kw_only=True, tag="worker_info"):
    """A worker's identity: role, PD peer id and endpoint, incarnation, transport, the TP
    range of KV heads each of its pools holds, and the PD peers it is connected with.

    ``head_ranges``: per pool, in the worker's pool order (its PD profile's), the half-open
    range ``(start, end)`` of KV heads this rank holds (MLA's latent head and state pools:
    ``(0, 1)``); at most :data:`MAX_POOLS`, each with ``start < end`` (a violation fails
    validation on decode, ``InvalidArgumentError`` when built here). Empty: the worker does
    not say (an older one), and the router leaves coverage to the PD handshake.

    ``peers``: the PD peer ids this worker holds a live connection with (accepted handshake,
    lease current) when it answered, sorted, at most :data:`MAX_PEERS`. None: it does not say
    (an older worker, more peers than that, or a PD loop that did not answer in time); the
    router then re-pairs by the other side's report only.

    ``kv_events_address`` / ``kv_replay_address``: where the worker publishes its KV events and
    answers replays (``kv_publisher``); both empty when it publishes none. The router subscribes
    to every worker that says (:mod:`~kvplane.serving.router.kv_watch`).

    ``hash_seed``, ``hash_fingerprint``, ``block_size`` and ``blocks_per_chunk``: how its
    offload tiers key a prompt's chunks (its one block hasher's root and its chunk spec), so the
    router derives the same keys for cache-aware picks; ``blocks_per_chunk`` 0 when it has no
    offload tiers.

    ``layer_ids``: the global layer ids its KV pool holds (its pipeline stage's; empty: it does
    not say), distinct; ``pp_stage`` and ``tp_rank``: which prefill rank it is (0 and 0 for an
    unparallelised worker). The router gathers a decode worker's KV from several prefill ranks
    only when all of them say their layers (:mod:`~kvplane.serving.router.gather_sets`).

    ``paged_pools``: how many of ``head_ranges``' leading pools are paged KV pools (one per KV
    cache group; the rest are whole-only), 0 when it does not say (then pools pair by index)."""

    role: str
    peer_id: _Id
    pd_address: _Text
    incarnation: _Count
    transport: _Text
    metrics_port: _Count = 0
    head_ranges: _HeadRanges = ()
    peers: _Peers | None = None
    kv_events_address: _Text = ""
    kv_replay_address: _Text = ""
    hash_seed: _Count = 0
    hash_fingerprint: _Fingerprint = b""
    block_size: _Count = 0
    blocks_per_chunk: _Count = 0
    layer_ids: _Layers = ()
    pp_stage: _Count = 0
    tp_rank: _Count = 0
    paged_pools: _Count = 0

    def __post_init__(self) -> None:
        if self.paged_pools > len(self.head_ranges):
            raise InvalidArgumentError(
                f"paged_pools {self.paged_pools} exceeds the {len(self.head_ranges)} head ranges"
            )
        for i, (start, end) in enumerate(self.head_ranges):
            if not start < end:
                why = f"head_ranges[{i}] must be a non-empty range (start < end)"
                raise InvalidArgumentError(f"{why}, got {(start, end)}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise InvalidArgumentError(f"layer_ids must be distinct, got {self.layer_ids}")


class PairWith(Message, frozen=True, kw_only=True, tag="pair_with"):
    """To a decode worker: shake hands with the prefill worker at ``pd_address``."""

    pd_address: _Text


class Ack(Message, frozen=True, kw_only=True, tag="ack"):
    """Success of an order that has no other answer (``detail`` says what happened)."""

    detail: _Text = ""


class ErrorReply(Message, frozen=True, kw_only=True, tag="error"):
    """The order was refused or failed; ``reason`` names the value at fault."""

    reason: _Text


class PairOrder(Message, frozen=True, kw_only=True):
    """Base of the two orders of one PD request, one to each worker of the pair: the request,
    the PD session that carries its KV, and its prompt."""

    request_id: _Id
    session_id: _Id
    token_ids: _Tokens


class SenderPiece(msgspec.Struct, frozen=True, kw_only=True):
    """One sender of a request gathered from several prefill ranks: its PD ``peer``, which rank
    it is (``stage``, ``tp_rank``), the KV ``heads`` (half-open) × ``layers`` it sends, and
    whether it is the ``lead`` (the one that also sends the whole-only pools). Both sides turn
    it into a :class:`~kvplane.pipeline.shares.Share` (:mod:`~kvplane.serving.gather_orders`).
    ``InvalidArgumentError`` for empty heads or layers, or repeated layers."""

    peer: _Id
    stage: _Count
    tp_rank: _Count
    heads: tuple[_Head, _Head]
    layers: _Layers
    lead: bool = False

    def __post_init__(self) -> None:
        if not self.heads[0] < self.heads[1]:
            raise InvalidArgumentError(f"piece heads must be non-empty, got {self.heads}")
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise InvalidArgumentError(f"piece layers must be distinct, got {self.layers}")


_Senders = Annotated[tuple[SenderPiece, ...], msgspec.Meta(max_length=MAX_PEERS)]


class PrefillOrder(PairOrder, frozen=True, kw_only=True, tag="prefill_order"):
    """To a prefill worker: compute ``token_ids`` and send the KV to ``decode_peer``.

    ``share``: this worker's piece when it is one of several senders of the request (None: the
    one sender); ``session_id`` is then the member's wire id ``<request session>/<stage>.<tp>``
    (:func:`~kvplane.pd.gather.member_session_id`)."""

    decode_peer: _Id
    step_size: _Count = 0
    """Tokens per prefill step; 0 means the worker's default."""
    share: SenderPiece | None = None


class DecodeOrder(PairOrder, frozen=True, kw_only=True, tag="decode_order"):
    """To a decode worker: receive the KV of ``token_ids`` from ``prefill_peer`` and decode.
    Answered with a :class:`RequestResult` when the request ends (any way).

    ``senders``: when several prefill ranks feed the request, each one's piece (``prefill_peer``
    is then the lead's peer); empty: ``prefill_peer`` is the one sender. ``InvalidArgumentError``
    for a peer or (stage, TP rank) named twice, or not exactly one lead."""

    prefill_peer: _Id
    max_new_tokens: _Count = 1
    senders: _Senders = ()

    def __post_init__(self) -> None:
        if not self.senders:
            return
        peers = [s.peer for s in self.senders]
        ranks = [(s.stage, s.tp_rank) for s in self.senders]
        if len(set(peers)) != len(peers) or len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(f"senders must be distinct peers and ranks, got {ranks}")
        leads = [s.peer for s in self.senders if s.lead]
        if leads != [self.prefill_peer]:
            why = "exactly one sender must lead, and be prefill_peer"
            raise InvalidArgumentError(f"{why} ({self.prefill_peer}), got leads {leads}")


class CancelOrder(Message, frozen=True, kw_only=True, tag="cancel_order"):
    """Cancel a request on the worker that receives this (either side, any moment).

    With ``session_id`` the cancel applies only while ``request_id`` is bound to that session
    (a follow-up cancel can never hit another request that reuses the id); without it, to
    whatever request has the id."""

    request_id: _Id
    reason: _Text = "cancelled"
    session_id: _Id | None = None


class RequestResult(Message, frozen=True, kw_only=True, tag="request_result"):
    """How a request ended on the decode side.

    ``state``: the PD session's terminal state (success, aborted, failed). ``prefix_tokens``:
    tokens the decode pool already held; ``tokens``: generated tokens (first token first);
    ``mismatches``: for a verifying decoder, differing elements (None otherwise).
    """

    request_id: _Id
    state: _Text
    reason: _Text = ""
    tokens: tuple[int, ...] = ()
    num_tokens: _Count = 0
    prefix_tokens: _Count = 0
    mismatches: int | None = None
    ready_at: float = 0.0


class Generate(Message, frozen=True, kw_only=True, tag="generate"):
    """To the router: serve one request end to end (answered with a :class:`RequestResult`)."""

    request_id: _Id
    token_ids: _Tokens
    max_new_tokens: _Count = 1
    step_size: _Count = 0


class StatsQuery(Message, frozen=True, kw_only=True, tag="stats_query"):
    """Ask a worker for its counters, pool usage and (optionally) its timeline."""

    timeline: bool = False


class WorkerStats(Message, frozen=True, kw_only=True, tag="worker_stats"):
    """Counters, pool usage, live sessions, integrity verdict and timeline events (dicts)."""

    peer_id: _Id
    counters: dict[str, int]
    used_blocks: _Count
    used_slots: _Count
    sessions_live: _Count
    requests_live: _Count
    integrity: _Text = ""
    """Empty when every pool and ledger is consistent, else the first broken invariant."""
    timeline: tuple[dict[str, str | int | float], ...] = ()
    timeline_truncated: _Count = 0
    """Oldest timeline events left out so that the reply fits in one frame (0: none)."""


REPLY_MARGIN = 1024
"""Bytes of a frame kept for the envelope when a stats reply is fitted to a frame limit."""
NOT_CONNECTED = "is not connected"
"""The words of a decode worker's refusal of an order naming a prefill peer it has no live
connection to; the router refreshes (re-pairs) when a refusal contains them."""


def fit_timeline(stats: WorkerStats, max_bytes: int) -> WorkerStats:
    """``stats`` with the newest timeline events whose encoded reply fits in ``max_bytes``
    (the rest counted in ``timeline_truncated``); unchanged when it fits already."""
    enc = msgspec.msgpack.encode
    if len(enc(stats)) <= max_bytes:
        return stats
    budget = max_bytes - len(enc(msgspec.structs.replace(stats, timeline=())))
    budget -= 16  # the array header and the counter may grow
    first = len(stats.timeline)  # events [first, len) are kept: the newest that fit
    while first > 0:
        size = len(enc(stats.timeline[first - 1]))
        if size > budget:
            break
        budget -= size
        first -= 1
    return msgspec.structs.replace(
        stats,
        timeline=stats.timeline[first:],
        timeline_truncated=stats.timeline_truncated + first,
    )


class Shutdown(Message, frozen=True, kw_only=True, tag="shutdown"):
    """Ask a worker process to exit (after replying)."""


AnyMessage = (
    InfoQuery
    | WorkerInfo
    | PairWith
    | Ack
    | ErrorReply
    | PrefillOrder
    | DecodeOrder
    | CancelOrder
    | RequestResult
    | Generate
    | StatsQuery
    | WorkerStats
    | Shutdown
)


class Envelope(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What travels: protocol version, the caller's call id, the message."""

    version: int
    call_id: _Count
    body: AnyMessage
