"""The router's membership: which workers it knows, which are up, and how it asks them things.

At most one query outstanding per worker and kind; a census marks silent workers down; only
vetted, TP-covering pairs serve; a pair either side reports unpaired is re-paired, with backoff
(:mod:`~kvplane.serving.router.healing`). See docs/serving.md.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace

from kvplane.errors import KVPlaneError
from kvplane.layout import heads_cover
from kvplane.serving.messages import (
    Ack,
    AnyMessage,
    ErrorReply,
    InfoQuery,
    PairWith,
    StatsQuery,
    WorkerInfo,
    WorkerStats,
)
from kvplane.serving.router.healing import RepairBackoff, lacks, says_paired
from kvplane.serving.rpc import RpcClient

log = logging.getLogger(__name__)


class Pairing(enum.Enum):
    """How a decode worker answered a pairing (see the module docstring)."""

    ACCEPTED = "accepted"
    PENDING = "pending"  # no answer yet
    REFUSED = "refused"
    LOST = "lost"  # accepted, then reported unpaired by either side: to be re-paired


@dataclass(frozen=True, slots=True)
class _Record:
    """A decode worker's latest answer to one pairing: for which incarnations (decode,
    prefill), what (``state``), and when it was recorded (``at``, monotonic)."""

    incarnations: tuple[int, int]
    state: Pairing
    at: float


@dataclass(slots=True, eq=False)
class WorkerHandle:
    """A worker as the router sees it: ``up`` while it answers info queries; ``repair`` after a
    pairing with it failed (tried again at the next refresh); ``uncovered``: a decode worker
    reported as having no prefill worker up that covers its KV heads (reported again only once
    it was covered, or when it rejoins); ``asked``: the queries sent to it and not answered yet
    with when they were sent, at most one per message (see :meth:`Membership.ask`);
    ``heard_at``: when the info query ``info`` answers was sent (monotonic)."""

    address: str
    client: RpcClient
    info: WorkerInfo | None = None
    heard_at: float = 0.0
    up: bool = False
    repair: bool = False
    uncovered: bool = False
    asked: dict[AnyMessage, tuple[Future[AnyMessage], float]] = field(default_factory=dict)


def serves(prefill: WorkerInfo, decode: WorkerInfo) -> bool:
    """True when ``prefill`` can send ``decode`` a session's KV as far as TP heads go: its head
    range covers the decode worker's in every pool (:func:`~kvplane.layout.heads_cover`).
    Also True when either does not say (empty ``head_ranges``): the PD handshake then decides.
    False when both say and count different pools: the handshake refuses such a pair. Pure."""
    held, needed = prefill.head_ranges, decode.head_ranges
    if not held or not needed:
        return True
    if len(held) != len(needed):
        return False
    return all(heads_cover(h, n) for h, n in zip(held, needed, strict=True))


def covering(prefill: Sequence[WorkerHandle], d: WorkerHandle) -> list[WorkerHandle]:
    """The prefill workers up (in order) that serve decode worker ``d`` (:func:`serves`)."""
    if d.info is None:
        return []
    return [p for p in prefill if p.up and p.info is not None and serves(p.info, d.info)]


def heads_of(w: WorkerHandle) -> str:
    """``w``'s address and KV head ranges, for a message."""
    ranges = "unknown" if w.info is None or not w.info.head_ranges else str(w.info.head_ranges)
    return f"{w.address} (KV heads per pool {ranges})"


_Served = tuple[WorkerHandle, WorkerInfo]


def _late_answer(fut: Future[AnyMessage], msg: AnyMessage) -> bool:
    """Whether done ``fut`` holds a late answer to census query ``msg`` worth using (see
    :meth:`Membership.ask`): a reply, not a failure or a cancellation."""
    return isinstance(msg, InfoQuery) and not fut.cancelled() and fut.exception() is None


@dataclass(frozen=True, slots=True)
class Census:
    """One census: the workers to (re-)pair (answered and new, restarted, back up, needing a
    repair, or all when forced) and the workers it marked down (up until now)."""

    changed: tuple[WorkerHandle, ...]
    gone: tuple[WorkerHandle, ...]


class Membership:
    """The workers of one router (see the module docstring). Thread-safe for :meth:`ask`,
    :meth:`recycle` and :meth:`close`; :meth:`census` and :meth:`pair_all` change ``up``,
    ``info`` and ``repair``, so one caller at a time runs them (the router's refresh lock)."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        timeout_s: float,
        probe_s: float,
        stop: threading.Event,
        secret: bytes | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.secret = secret  # the order sockets' (CURVE; None: plain)
        self.probe_s = probe_s
        self._stop = stop
        self._lock = threading.Lock()  # guards w.client swaps, w.asked, _pairings, _backoff
        self.prefill = [WorkerHandle(a, self._client(a)) for a in prefill]
        self.decode = [WorkerHandle(a, self._client(a)) for a in decode]
        self._pairings: dict[tuple[WorkerHandle, WorkerHandle], _Record] = {}
        """(decode, prefill) -> the decode worker's latest answer to their pairing."""
        self._backoff: RepairBackoff[tuple[WorkerHandle, WorkerHandle]] = RepairBackoff()
        """(decode, prefill) -> re-pairs of a pair reported unpaired since it was seen paired."""

    def _client(self, address: str) -> RpcClient:
        """A new order client of the worker at ``address``."""
        return RpcClient(address, timeout_s=self.timeout_s, secret=self.secret)

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.prefill + self.decode

    def ready(self) -> bool:
        """True when at least one decode worker is up with a prefill worker up that serves it
        (:func:`serves`) and whose pairing it accepted."""
        return any(self._vetted(d)[0] for d in self.decode)

    def serving(self, d: WorkerHandle) -> list[tuple[WorkerHandle, WorkerInfo]]:
        """The prefill workers up (in order, with their infos) that may carry decode worker
        ``d``'s requests: those that serve it (:func:`serves`) and whose
        latest pairing with it, for both workers' incarnations now, it accepted — or, only
        while it accepted none, those it has not answered yet; empty while ``d`` is not up."""
        accepted, pending = self._vetted(d)
        return accepted or pending

    def _vetted(self, d: WorkerHandle) -> tuple[list[_Served], list[_Served]]:
        """The prefill workers up serving ``d`` whose pairing it accepted, and those pending."""
        if not d.up or d.info is None:
            return [], []
        cands = [(p, p_info) for p in covering(self.prefill, d) if (p_info := p.info) is not None]
        with self._lock:
            states = [self._pairing(d, p) for p, _ in cands]
        return (
            [c for c, s in zip(cands, states, strict=True) if s is Pairing.ACCEPTED],
            [c for c, s in zip(cands, states, strict=True) if s is Pairing.PENDING],
        )

    def _pairing(self, d: WorkerHandle, p: WorkerHandle) -> Pairing | None:
        """Under the lock: ``d``'s latest answer to pairing with ``p`` if it was for both
        workers' current incarnations, else None."""
        rec = self._record(d, p)
        return None if rec is None else rec.state

    def _record(self, d: WorkerHandle, p: WorkerHandle) -> _Record | None:
        """Under the lock: the record of pair (``d``, ``p``) if it is for both workers' current
        incarnations, else None."""
        rec = self._pairings.get((d, p))
        if rec is None or d.info is None or p.info is None:
            return None
        return rec if rec.incarnations == (d.info.incarnation, p.info.incarnation) else None

    def _forget(self, w: WorkerHandle) -> None:
        """Forget every pairing record and re-pair count of ``w`` (it went down or restarted)."""
        with self._lock:
            for key in [k for k in self._pairings if w in k]:
                del self._pairings[key]
            self._backoff.drop(lambda k: w in k)

    def lost(self, d: WorkerHandle, p: WorkerHandle, incarnation: int, why: str) -> bool:
        """Mark pair (``d``, ``p``) LOST (re-paired at the next refresh, see :meth:`pair_all`)
        because a request's worker reported it not connected (``why``), if ``d`` is still
        incarnation ``incarnation`` and the pairing was accepted; else False, nothing changed."""
        with self._lock:
            rec = self._record(d, p)
            if rec is None or rec.state is not Pairing.ACCEPTED or d.info is None:
                return False
            if d.info.incarnation != incarnation:
                return False
            self._pairings[(d, p)] = replace(rec, state=Pairing.LOST, at=time.monotonic())
        log.warning("PD pair %s / %s is not connected (%s): re-pairing", d.address, p.address, why)
        return True

    def close(self) -> None:
        """Set ``stop`` and close every worker's client (nothing is recycled after this)."""
        with self._lock:
            self._stop.set()
            clients = [w.client for w in self.workers]
        for c in clients:
            c.close()

    def recycle(self, w: WorkerHandle) -> None:
        """Give ``w`` a fresh client and drop the old one with zmq's frames still queued for
        it (its calls still waiting fail with ``RemoteDisconnectError``); nothing once
        ``stop`` is set."""
        with self._lock:
            old = self._swap(w)
        if old is not None:
            old.close(discard=True)

    def _swap(self, w: WorkerHandle) -> RpcClient | None:
        """Under the lock: put a fresh client in ``w`` and forget what it was asked; the old
        client, for the caller to close (None, and nothing changed, once ``stop`` is set)."""
        if self._stop.is_set():
            return None
        old, w.client = w.client, self._client(w.address)
        w.asked.clear()
        return old

    def ask(
        self, asks: Sequence[tuple[WorkerHandle, AnyMessage]], wait_s: float
    ) -> list[AnyMessage | None]:
        """Ask each worker its message, wait ``wait_s`` in all: the replies in order (None: none
        in time, or the call failed). One not answered yet is waited for again, not resent —
        unless sent ``timeout_s`` ago or more: then sent again, on a fresh client if the worker
        is not up (see the module docstring). An ``InfoQuery`` answered after the last ask
        waited for it is that answer (resending it would throw the answer away, and with
        replies slower than ``wait_s`` no census would ever hear the worker); other answers are
        not reused (a pairing's may come from a process since restarted)."""
        return [got for got, _ in self._ask_sent(asks, wait_s)]

    def _ask_sent(
        self, asks: Sequence[tuple[WorkerHandle, AnyMessage]], wait_s: float
    ) -> list[tuple[AnyMessage | None, float]]:
        """:meth:`ask`, with when each message whose answer it is was sent (monotonic)."""
        futs: list[tuple[Future[AnyMessage], float]] = []
        now = time.monotonic()
        olds: list[RpcClient] = []
        with self._lock:
            stale = [w for w, msg in asks if self._stale(w, msg, now)]
            for w in {id(w): w for w in stale if not w.up}.values():
                old = self._swap(w)
                if old is not None:
                    olds.append(old)
            for w, msg in asks:
                fut, sent = w.asked.get(msg, (None, now))
                if fut is not None and self._stale(w, msg, now):  # up (or stopping): resend
                    w.client.forget(fut)
                if fut is None or (fut.done() and not _late_answer(fut, msg)):
                    fut, sent = w.client.call_async(msg), now
                    w.asked[msg] = (fut, now)
                futs.append((fut, sent))
        for old in olds:  # off the lock: a close joins the client's loop thread
            old.close(discard=True)
        end = time.monotonic() + wait_s
        out: list[tuple[AnyMessage | None, float]] = []
        for (w, msg), (fut, sent) in zip(asks, futs, strict=True):
            try:
                got: AnyMessage | None = fut.result(timeout=max(0.0, end - time.monotonic()))
            except FutureTimeout:
                got = None  # still outstanding: the next ask waits for it
            except (KVPlaneError, CancelledError):  # not sent: asked afresh next time
                got = None
            if fut.done():
                with self._lock:
                    if w.asked.get(msg, (None, 0.0))[0] is fut:
                        del w.asked[msg]
            out.append((got, sent))
        return out

    def _stale(self, w: WorkerHandle, msg: AnyMessage, now: float) -> bool:
        """Under the lock: whether ``w``'s outstanding ``msg`` was sent ``timeout_s`` ago."""
        fut, sent = w.asked.get(msg, (None, now))
        return fut is not None and not fut.done() and now - sent >= self.timeout_s

    def census(self, force: bool) -> Census:
        """Ask every worker who it is (waiting ``probe_s``): mark the silent ones down, the
        others up (see :class:`Census`; ``force``: every one that answered is changed), and
        mark LOST each accepted pair that either worker reports unpaired (:meth:`_heal`)."""
        infos = self._ask_sent([(w, InfoQuery()) for w in self.workers], self.probe_s)
        changed: list[WorkerHandle] = []
        gone: list[WorkerHandle] = []
        for w, (got, sent) in zip(self.workers, infos, strict=True):
            if not isinstance(got, WorkerInfo):
                if w.up:
                    log.warning("worker at %s does not answer: marked down", w.address)
                    gone.append(w)
                    self._forget(w)
                w.up = False
                continue
            restarted = w.info is None or w.info.incarnation != got.incarnation
            if restarted:
                self._forget(w)
            if force or restarted or not w.up or w.repair:
                changed.append(w)
            w.info, w.heard_at, w.up, w.repair = got, sent, True, False
        self._heal()
        return Census(tuple(changed), tuple(gone))

    def _heal(self) -> None:
        """Judge each accepted or LOST pair by the workers' info answers to queries sent after
        its record (an older answer may predate it: not used). Either reports it unpaired: an
        accepted pair becomes LOST (re-paired by :meth:`pair_all`). Neither does and one reports
        it paired: a LOST pair is accepted again, and its next break is re-paired at once
        (:class:`RepairBackoff`)."""
        now = time.monotonic()
        for d in self.decode:
            for p in covering(self.prefill, d) if d.up else []:
                d_info, p_info = d.info, p.info
                if d_info is None or p_info is None:
                    continue
                with self._lock:
                    rec = self._record(d, p)
                    if rec is None or rec.state not in (Pairing.ACCEPTED, Pairing.LOST):
                        continue
                    fresh = [
                        (w.address, mine, other)
                        for w, mine, other in ((d, d_info, p_info), (p, p_info, d_info))
                        if w.heard_at >= rec.at
                    ]
                    why = [
                        f"{addr} has no live PD connection to {other.peer_id!r}"
                        for addr, mine, other in fresh
                        if lacks(mine, other)
                    ]
                    if not why and any(says_paired(mine, other) for _, mine, other in fresh):
                        self._backoff.healed((d, p))
                        self._pairings[(d, p)] = replace(rec, state=Pairing.ACCEPTED)
                    if not why or rec.state is Pairing.LOST:
                        continue
                    self._pairings[(d, p)] = replace(rec, state=Pairing.LOST, at=now)
                log.warning("PD pair reported unpaired (%s): re-pairing", "; ".join(why))

    def _heal_due(self, d: WorkerHandle, p: WorkerHandle, now: float) -> bool:
        """Whether LOST pair (``d``, ``p``) is re-paired now (its backoff allows it: counted)."""
        with self._lock:
            if self._pairing(d, p) is not Pairing.LOST or not self._backoff.due((d, p), now):
                return False
            self._backoff.tried((d, p), now)
            return True

    def pair_all(self, changed: Sequence[WorkerHandle]) -> list[str]:
        """Pair each up decode worker with each up prefill worker that serves it (:func:`serves`;
        no other pair is asked), either in ``changed`` or the pair LOST and due
        (:class:`RepairBackoff`), all at once within ``probe_s``, and record each answer (see
        the module docstring): what went wrong — a pairing refused or not answered (its decode
        worker is re-paired), and a decode worker up that no prefill worker up serves while
        some is up. At most one pairing per pair is outstanding (:meth:`ask`)."""
        pairs: list[tuple[WorkerHandle, WorkerHandle, tuple[int, int]]] = []
        asks: list[tuple[WorkerHandle, AnyMessage]] = []
        now = time.monotonic()
        for d in self.decode:
            for p in covering(self.prefill, d) if d.up and d.info is not None else []:
                if d.info is None or p.info is None:
                    continue
                if d in changed or p in changed or self._heal_due(d, p, now):
                    pairs.append((d, p, (d.info.incarnation, p.info.incarnation)))
                    asks.append((d, PairWith(pd_address=p.info.pd_address)))
        errors: list[str] = []
        answers = self.ask(asks, self.probe_s) if asks else []
        at = time.monotonic()  # after every answer: an info query sent later sees the pairing
        for (d, p, incs), got in zip(pairs, answers, strict=True):
            state = (
                Pairing.ACCEPTED if isinstance(got, Ack)
                else Pairing.PENDING if got is None
                else Pairing.REFUSED
            )  # fmt: skip
            with self._lock:
                self._pairings[(d, p)] = _Record(incs, state, at)
            if state is not Pairing.ACCEPTED:
                d.repair = True
                why = (
                    f"no answer within {self.probe_s:g} s" if got is None
                    else got.reason if isinstance(got, ErrorReply)
                    else f"unexpected reply {got!r}"[:500]
                )  # fmt: skip
                errors.append(f"decode worker at {d.address} cannot pair: {why}")
        return errors + self._uncovered(changed)

    def _uncovered(self, changed: Sequence[WorkerHandle]) -> list[str]:
        """Report each decode worker up that no prefill worker up serves, while some prefill
        worker is up: when it is in ``changed`` or was not reported since it was last covered."""
        up = [p for p in self.prefill if p.up and p.info is not None]
        errors: list[str] = []
        for d in self.decode:
            if not d.up:
                continue
            lost = bool(up) and not covering(up, d)
            if lost and (d in changed or not d.uncovered):
                errors.append(
                    f"decode worker at {heads_of(d)} cannot pair: no prefill worker up holds all "
                    f"its KV heads (one sender per session); prefill workers up: "
                    f"{', '.join(heads_of(p) for p in up)}"
                )
            d.uncovered = lost
        return errors

    def gather_stats(self, timeline: bool) -> tuple[dict[str, WorkerStats], list[str]]:
        """Stats of every worker that is up, by peer id, waiting at most ``timeout_s`` in all;
        and the addresses (with why) of the workers that gave none: the up ones that did not
        answer, and every worker down (or never heard from), which is not asked or waited for."""
        up = [w for w in self.workers if w.up]
        got_all = self.ask([(w, StatsQuery(timeline=timeline)) for w in up], self.timeout_s)
        out: dict[str, WorkerStats] = {}
        missing = [f"{w.address} (down)" for w in self.workers if not w.up]
        for w, got in zip(up, got_all, strict=True):
            if isinstance(got, WorkerStats):
                out[got.peer_id] = got
            else:
                missing.append(f"{w.address} ({'no reply' if got is None else repr(got)})"[:500])
        return out, missing
