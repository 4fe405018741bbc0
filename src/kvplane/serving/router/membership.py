"""The router's membership: which workers are up, which pairs serve, and which to pair again.

A census (asked through :mod:`~kvplane.serving.router.asking`) marks silent workers down; only
vetted routes serve: a prefill worker covering a decode worker's KV, or else its gather set,
every member vetted (:mod:`~kvplane.serving.router.gather_routes`; records in
:mod:`~kvplane.serving.router.pairings`); a pair
either side reports unpaired, or whose pairing was refused, is paired again with backoff
(:mod:`~kvplane.serving.router.healing`). It owns no socket. See docs/serving.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

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
from kvplane.serving.router.asking import Asker
from kvplane.serving.router.gather_routes import Route, partners, routes
from kvplane.serving.router.pairings import Pairing, PairTable, Report
from kvplane.serving.router.workers import WorkerHandle, heads_of

log = logging.getLogger(__name__)

_Pair = tuple[WorkerHandle, WorkerHandle]
"""(decode, prefill): the key of a pair."""


def _incs(d: WorkerHandle, p: WorkerHandle) -> tuple[int, int] | None:
    """The pair's (decode, prefill) incarnations now; None while either is unknown."""
    if d.info is None or p.info is None:
        return None
    return d.info.incarnation, p.info.incarnation


@dataclass(frozen=True, slots=True)
class Census:
    """One census: the workers to (re-)pair (answered and new, restarted, back up, or all
    when forced) and the workers it marked down (up until now)."""

    changed: tuple[WorkerHandle, ...]
    gone: tuple[WorkerHandle, ...]


@dataclass(frozen=True, slots=True)
class PairingRound:
    """One :meth:`Membership.pair_all`: what went wrong (``errors``), the cause (``lost`` or
    ``refused``) of each pairing it sent again after a backoff (``retried``), and the decode
    workers one of those was accepted by (``repaired``)."""

    errors: tuple[str, ...]
    retried: tuple[str, ...]
    repaired: tuple[WorkerHandle, ...]


class Membership:
    """The workers of one router (see the module docstring). Thread-safe for :meth:`ask`,
    :meth:`recycle`, :meth:`lost` and :meth:`close`; :meth:`census` and :meth:`pair_all`
    change ``up``, ``info`` and ``repair``, so one caller at a time runs them (the router's
    refresh lock)."""

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
        self.probe_s = probe_s
        self.asker = Asker(timeout_s=timeout_s, stop=stop, secret=secret)
        self.prefill = [WorkerHandle(a, self.asker.client(a)) for a in prefill]
        self.decode = [WorkerHandle(a, self.asker.client(a)) for a in decode]
        self.pairs: PairTable[_Pair] = PairTable()
        """(decode, prefill) -> the decode worker's latest answer to their pairing, and the
        pair's re-pair backoff."""

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.prefill + self.decode

    def ready(self) -> bool:
        """True when at least one decode worker up has a route (a prefill worker up that
        serves it, or its gather set) whose pairings it accepted."""
        return any(self._vetted(d)[0] for d in self.decode)

    def serving(self, d: WorkerHandle) -> list[Route]:
        """The routes that may carry decode worker ``d``'s requests (:func:`~kvplane.serving.
        router.gather_routes.routes`): one per prefill worker up that serves it alone, else
        one for its gather set, each whose pairings with ``d``, for the workers' incarnations
        now, it accepted — or, only while none is, those with pairings not answered yet;
        empty while ``d`` is not up."""
        accepted, pending = self._vetted(d)
        return accepted or pending

    def _vetted(self, d: WorkerHandle) -> tuple[list[Route], list[Route]]:
        """``d``'s routes whose pairings it accepted, and those with some pending."""

        def state(p: WorkerHandle) -> Pairing | None:
            incs = _incs(d, p)
            return None if incs is None else self.pairs.state((d, p), incs)

        return routes(self.prefill, d, state)

    def _forget(self, w: WorkerHandle) -> None:
        """Forget every pairing record and re-pair count of ``w`` (it went down or restarted)."""
        self.pairs.forget(lambda k: w in k)

    def lost(self, d: WorkerHandle, p: WorkerHandle, incarnation: int, why: str) -> bool:
        """Mark pair (``d``, ``p``) LOST (paired again at the next refresh, see
        :meth:`pair_all`) because a request's worker reported it not connected (``why``), if
        ``d`` is still incarnation ``incarnation`` and the pairing was accepted; else False,
        nothing changed."""
        incs = _incs(d, p)
        if incs is None or incs[0] != incarnation:
            return False
        if not self.pairs.lose((d, p), incs, time.monotonic()):
            return False
        log.warning("PD pair %s / %s is not connected (%s): re-pairing", d.address, p.address, why)
        return True

    def ask(
        self, asks: Sequence[tuple[WorkerHandle, AnyMessage]], wait_s: float
    ) -> list[AnyMessage | None]:
        """:meth:`Asker.ask`: each worker its message, the replies within ``wait_s`` in all."""
        return self.asker.ask(asks, wait_s)

    def recycle(self, w: WorkerHandle) -> None:
        """:meth:`Asker.recycle`: a fresh client for ``w``, the old one's frames dropped."""
        self.asker.recycle(w)

    def close(self) -> None:
        """Set ``stop`` and close every worker's client (nothing is recycled after this)."""
        self.asker.close(self.workers)

    def census(self, force: bool) -> Census:
        """Ask every worker who it is (waiting ``probe_s``): mark the silent ones down, the
        others up (see :class:`Census`; ``force``: every one that answered is changed), and
        mark LOST each accepted pair that either worker reports unpaired (:meth:`_heal`)."""
        infos = self.asker.ask_sent([(w, InfoQuery()) for w in self.workers], self.probe_s)
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
            if force or restarted or not w.up:
                changed.append(w)
            w.info, w.heard_at, w.up = got, sent, True
        self._heal()
        return Census(tuple(changed), tuple(gone))

    def _heal(self) -> None:
        """Judge each pair up of a decode worker and its partners (:func:`~kvplane.serving.
        router.gather_routes.partners`) by both workers' info answers
        (:meth:`PairTable.judge`): one reported unpaired becomes LOST, and is logged."""
        now = time.monotonic()
        for d in self.decode:
            for p in partners(self.prefill, d) if d.up else []:
                d_info, p_info = d.info, p.info
                if d_info is None or p_info is None:
                    continue
                reports = (
                    Report(d.address, d.heard_at, d_info, p_info),
                    Report(p.address, p.heard_at, p_info, d_info),
                )
                incs = (d_info.incarnation, p_info.incarnation)
                why = self.pairs.judge((d, p), incs, reports, now)
                if why:
                    log.warning("PD pair reported unpaired (%s): re-pairing", why)

    def pair_all(self, changed: Sequence[WorkerHandle]) -> PairingRound:
        """Pair each up decode worker with each of its partners up (each prefill worker that
        serves it, else its gather set's members: :func:`~kvplane.serving.router.gather_routes.
        partners`; no other pair is asked) when either is in ``changed``, the pair has no answer
        for these incarnations (or none yet: the outstanding pairing is waited for again), or
        it is LOST or REFUSED and its backoff allows a try (:meth:`PairTable.retry`: at once,
        then 1 s doubling to 30 s); all at once within ``probe_s``, each answer recorded (see
        the module docstring). What went wrong: a pairing refused or not answered, and a decode
        worker up that no prefill worker up serves, alone or as a gather set, while some is up.
        At most one pairing per pair is outstanding (:meth:`ask`)."""
        pairs: list[tuple[WorkerHandle, WorkerHandle, tuple[int, int], str]] = []
        asks: list[tuple[WorkerHandle, AnyMessage]] = []
        now = time.monotonic()
        for d in self.decode:
            for p in partners(self.prefill, d) if d.up else []:
                incs = _incs(d, p)
                if incs is None or p.info is None:
                    continue
                cause = ""
                if not (d in changed or p in changed):
                    state = self.pairs.state((d, p), incs)
                    if state is Pairing.ACCEPTED:
                        continue
                    if state is not None and state is not Pairing.PENDING:
                        due = self.pairs.retry((d, p), incs, now)
                        if due is None:
                            continue  # waits out its backoff
                        cause = due.value
                pairs.append((d, p, incs, cause))
                asks.append((d, PairWith(pd_address=p.info.pd_address)))
        errors: list[str] = []
        repaired: list[WorkerHandle] = []
        answers = self.ask(asks, self.probe_s) if asks else []
        at = time.monotonic()  # after every answer: an info query sent later sees the pairing
        for (d, p, incs, cause), got in zip(pairs, answers, strict=True):
            state = (
                Pairing.ACCEPTED if isinstance(got, Ack)
                else Pairing.PENDING if got is None
                else Pairing.REFUSED
            )  # fmt: skip
            self.pairs.record((d, p), incs, state, at)
            if state is Pairing.ACCEPTED:
                if cause and d not in repaired:
                    repaired.append(d)
                continue
            why = (
                f"no answer within {self.probe_s:g} s" if got is None
                else got.reason if isinstance(got, ErrorReply)
                else f"unexpected reply {got!r}"[:500]
            )  # fmt: skip
            errors.append(f"decode worker at {d.address} cannot pair: {why}")
        for d in {id(d): d for d, _, _, _ in pairs}.values():
            d.repair = self._failing(d)
        retried = tuple(cause for _, _, _, cause in pairs if cause)
        return PairingRound(tuple(errors + self._uncovered(changed)), retried, tuple(repaired))

    def _failing(self, d: WorkerHandle) -> bool:
        """Whether a pairing of ``d`` with a prefill worker up serving it was refused or is
        not answered yet (its ``repair``)."""
        failing = (Pairing.REFUSED, Pairing.PENDING)
        return any(
            (incs := _incs(d, p)) is not None and self.pairs.state((d, p), incs) in failing
            for p in partners(self.prefill, d)
        )

    def _uncovered(self, changed: Sequence[WorkerHandle]) -> list[str]:
        """Report each decode worker up that no prefill worker up serves, while some prefill
        worker is up: when it is in ``changed`` or was not reported since it was last covered."""
        up = [p for p in self.prefill if p.up and p.info is not None]
        errors: list[str] = []
        for d in self.decode:
            if not d.up:
                continue
            lost = bool(up) and not partners(up, d)
            if lost and (d in changed or not d.uncovered):
                errors.append(
                    f"decode worker at {heads_of(d)} cannot pair: no prefill worker up holds all "
                    f"its KV heads (one sender per session); prefill workers up: "
                    f"{', '.join(heads_of(p) for p in up)}; nor do several tile its KV heads x "
                    "layers (a gather set)"
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
