"""Routes: the prefill workers that carry one request to a decode worker, and their orders.

A decode worker is served by each prefill worker that covers its KV alone
(:func:`~kvplane.serving.router.workers.covering`), or, when none does, by its gather set
(:func:`~kvplane.serving.router.gather_sets.gather_set`): several prefill ranks whose pieces
tile its KV exactly once, as one request. :func:`partners` names whom a decode worker is
paired with, :func:`routes` which :class:`Route` s its pairing answers let serve it,
:func:`why_no_route` why none does, and :func:`route_orders` turns a route into the request's
orders (a gather's from :func:`~kvplane.serving.gather_orders.gather_orders`). Pure: no
queries, no records.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvplane.serving.gather_orders import gather_orders, sender_pieces
from kvplane.serving.messages import DecodeOrder, PrefillOrder, WorkerInfo
from kvplane.serving.router.gather_sets import gather_set
from kvplane.serving.router.pairings import Pairing
from kvplane.serving.router.workers import WorkerHandle, covering, heads_of
from kvplane.transfer.resharding import Piece


@dataclass(frozen=True, slots=True)
class Sender:
    """One prefill worker of a route: its handle, its info when picked, and the piece it
    sends (None: it is the request's one sender)."""

    worker: WorkerHandle
    info: WorkerInfo
    piece: Piece | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """One way to serve a request on decode worker ``decode`` (with its info when picked):
    one sender covering its KV alone, or the members of its gather set (each with a piece)."""

    decode: WorkerHandle
    decode_info: WorkerInfo
    senders: tuple[Sender, ...]

    @property
    def gathered(self) -> bool:
        """Whether several prefill ranks feed the request (its senders have pieces)."""
        return any(s.piece is not None for s in self.senders)

    @property
    def name(self) -> str:
        """The route's name for a pick: its first sender's peer id."""
        return self.senders[0].info.peer_id


def partners(prefill: Sequence[WorkerHandle], d: WorkerHandle) -> list[WorkerHandle]:
    """The prefill workers up that decode worker ``d`` is paired with: those that cover its
    KV alone, or, when none does, the members of its gather set (none: empty)."""
    alone = covering(prefill, d)
    if alone:
        return alone
    return [p for p, _ in gather_set(prefill, d) or []]


def routes(
    prefill: Sequence[WorkerHandle],
    d: WorkerHandle,
    state: Callable[[WorkerHandle], Pairing | None],
) -> tuple[list[Route], list[Route]]:
    """The routes to decode worker ``d`` (up, with an info) whose pairings ``state`` (of
    ``(d, p)`` for prefill ``p``, for both incarnations now) accepted — every member's, for
    a gather — and those whose pairings are each accepted or not answered yet (at least one
    not answered). One route per prefill worker covering ``d`` alone; else one for its gather
    set; empty lists while ``d`` is not up or has no info."""
    d_info = d.info
    if not d.up or d_info is None:
        return [], []
    alone = covering(prefill, d)
    groups = [[(p, None)] for p in alone] if alone else [list(gather_set(prefill, d) or [])]
    accepted: list[Route] = []
    pending: list[Route] = []
    for group in groups:
        senders = tuple(Sender(p, p.info, piece) for p, piece in group if p.info is not None)
        if not senders or len(senders) != len(group):
            continue
        states = {state(s.worker) for s in senders}
        if states == {Pairing.ACCEPTED}:
            accepted.append(Route(d, d_info, senders))
        elif states <= {Pairing.ACCEPTED, Pairing.PENDING}:
            pending.append(Route(d, d_info, senders))
    return accepted, pending


def route_orders(
    route: Route, base: DecodeOrder, step_size: int
) -> tuple[DecodeOrder, list[tuple[WorkerHandle, PrefillOrder]]]:
    """The orders of ``base``'s request (its id, session id, prompt and token budget; its
    ``prefill_peer`` is replaced) on ``route``: the decode order, and per sender its worker
    and prefill order with ``step_size``. A gather's members are sent their shares under their
    member session ids (:func:`~kvplane.serving.gather_orders.gather_orders`)."""
    decode_peer = route.decode_info.peer_id
    if not route.gathered:
        s = route.senders[0]
        pre = PrefillOrder(request_id=base.request_id, session_id=base.session_id,
                           decode_peer=decode_peer, token_ids=base.token_ids,
                           step_size=step_size)  # fmt: skip
        dec = DecodeOrder(request_id=base.request_id, session_id=base.session_id,
                          prefill_peer=s.info.peer_id, token_ids=base.token_ids,
                          max_new_tokens=base.max_new_tokens)  # fmt: skip
        return dec, [(s.worker, pre)]
    pieces = [(s.info.peer_id, s.piece) for s in route.senders if s.piece is not None]
    dec, pres = gather_orders(
        base, sender_pieces(pieces), decode_peer=decode_peer, step_size=step_size
    )
    return dec, [(s.worker, o) for s, o in zip(route.senders, pres, strict=True)]


def why_no_route(prefill: Sequence[WorkerHandle], decode: Sequence[WorkerHandle]) -> str:
    """Why no request can be served now, naming the head ranges of the workers up: no decode
    worker up has partners (:func:`partners`), or none has a vetted pairing with them."""
    ps, ds = [w for w in prefill if w.up], [w for w in decode if w.up]
    why = "no prefill worker up holds all the KV heads of a decode worker up (one sender per "
    why += "session)"
    tail = "; nor do several tile its KV heads x layers (a gather set)"
    if any(partners(ps, d) for d in ds):
        why = "no decode worker up has a vetted route (a prefill worker up holding all its KV "
        why += "heads, or a gather set of them; refused, lost or not made yet; re-paired at the "
        why += "next refresh)"
        tail = ""
    return (
        f"{why}: decode {', '.join(heads_of(w) for w in ds)}; "
        f"prefill {', '.join(heads_of(w) for w in ps)}{tail}"
    )[:4000]
