"""The router: pairs prefill and decode workers and carries each request to both.

It never touches KV. Fair picks over vetted routes (one prefill worker, or a gather set of
prefill ranks: :mod:`~kvplane.serving.router.gather_routes`), session ids unique across
restarts, a deadline for every request. See docs/serving.md.
"""

from __future__ import annotations

import logging
import operator
import secrets
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import msgspec

from kvplane.errors import InvalidArgumentError, KVPlaneError, ProtocolError, TransferTimeoutError
from kvplane.ids import ChunkKey
from kvplane.metrics import MetricsRegistry
from kvplane.serving.messages import (
    NOT_CONNECTED,
    AnyMessage,
    DecodeOrder,
    ErrorReply,
    Generate,
    RequestResult,
    WorkerStats,
)
from kvplane.serving.router.flights import Flight
from kvplane.serving.router.gather_routes import Route, route_orders, why_no_route
from kvplane.serving.router.kv_watch import KVEventWatch
from kvplane.serving.router.membership import Membership
from kvplane.serving.router.observe import RouterMetrics
from kvplane.serving.router.prefix_index import PrefixIndex, PrefixMatch
from kvplane.serving.router.route_policy import CacheRouting, RoutePolicy
from kvplane.serving.router.workers import WorkerHandle
from kvplane.validators import require_finite_positive

log = logging.getLogger(__name__)
TICK_S = 0.05  # how often the deadline thread looks for expired requests
PENDING_GRACE_S = 2.0  # how long a request's chunks stay expected after it succeeded


class Router:
    """Pairs workers and serves requests (see the module docstring). Thread-safe.

    ``timeout_s``: per-call wait (and :meth:`generate`'s); ``deadline_s``: a request's whole
    life (default ``max(60, 4 * timeout_s)``); ``refresh_s``: periodic refresh (None: only
    when called); ``probe_s``: how long a refresh waits for info replies, and then for
    pairings (at most ``timeout_s``); ``secret``: the cluster secret its order clients
    authenticate with (CURVE; None: plain, explicit insecure mode); ``metrics``: its registry
    (:class:`RouterMetrics`; a fresh one by default). Workers that advertise KV event
    addresses are subscribed to at each refresh (:class:`KVEventWatch`, :attr:`prefix_index`).
    ``policy``: how a prefill worker is picked (:class:`RoutePolicy`; cache-aware with
    ``cache``'s key scheme and costs, :mod:`~kvplane.serving.router.route_policy`; each routed
    prompt's chunks are then expected on its prefill worker, :meth:`PrefixIndex.expect`, until
    its events confirm them or the request ends).
    """

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        *,
        timeout_s: float = 10.0,
        deadline_s: float | None = None,
        refresh_s: float | None = None,
        probe_s: float = 2.0,
        secret: bytes | None = None,
        metrics: MetricsRegistry | None = None,
        policy: RoutePolicy = RoutePolicy.ROUND_ROBIN,
        cache: CacheRouting | None = None,
    ) -> None:
        self.policy, self.cache = RoutePolicy.parse(policy), cache or CacheRouting()
        if not prefill or not decode:
            raise InvalidArgumentError("a router needs at least one prefill and one decode worker")
        self.timeout_s = require_finite_positive("timeout_s", timeout_s, InvalidArgumentError)
        self.deadline_s = (
            max(60.0, 4 * self.timeout_s)
            if deadline_s is None
            else require_finite_positive("deadline_s", deadline_s, InvalidArgumentError)
        )
        self.refresh_s = (
            None
            if refresh_s is None
            else require_finite_positive("refresh_s", refresh_s, InvalidArgumentError)
        )
        self.probe_s = min(
            require_finite_positive("probe_s", probe_s, InvalidArgumentError), self.timeout_s
        )
        self._stop = threading.Event()
        self.secret = secret
        self._members = Membership(
            prefill, decode, timeout_s=self.timeout_s, probe_s=self.probe_s, stop=self._stop,
            secret=secret,
        )  # fmt: skip
        self.kv_events = KVEventWatch(secret=secret)
        self.metrics = metrics if metrics is not None else MetricsRegistry()
        self.observe = RouterMetrics(
            self.metrics, flights=lambda: self.flights_live, workers=self.worker_counts,
            waiting=lambda: self._members.pairs.waiting(time.monotonic()),
            cluster=lambda: [s.counters for s in self.gather_stats()[0].values()],
        )  # fmt: skip
        self._tag = secrets.token_hex(4)
        self._serial = 0
        self._flights: dict[str, Flight] = {}
        self.gathered = 0  # requests sent to a gather set of prefill ranks
        self._turns: dict[WorkerHandle, int] = {}  # per decode worker: requests picked for it
        self._lock = threading.Lock()
        self._settle_lock = threading.Lock()
        self._refresh_lock = threading.Lock()
        self._refreshes = 0
        self._refresh_wanted = threading.Event()
        loops = [self._expire_loop] + ([self._refresh_loop] if self.refresh_s else [])
        self._threads = [threading.Thread(target=fn, name="kvplane-router") for fn in loops]
        for t in self._threads:
            t.daemon = True
            t.start()

    def close(self) -> None:
        """Stop promptly: close every worker's client first, which fails each call still
        waiting for an answer (a refresh waiting on a dead worker, on any thread, ends then
        instead of after ``probe_s``) and makes no client after; then join the router's threads
        and, once no refresh runs, close the KV event subscriber. Idempotent."""
        self._stop.set()
        self._refresh_wanted.set()
        self._members.close()
        for t in self._threads:
            if t.is_alive() and threading.current_thread() is not t:
                t.join(timeout=10.0)
        with self._refresh_lock:  # a refresh on another thread ends first (its calls failed)
            self.kv_events.close()

    @property
    def prefix_index(self) -> PrefixIndex:
        """Which worker holds which chunk in which tier, from the KV events of the workers
        that publish them (read-only for callers: the router's subscriber feeds it)."""
        return self.kv_events.index

    @property
    def prefill(self) -> list[WorkerHandle]:
        """The prefill workers, in the order given (see :class:`WorkerHandle`)."""
        return self._members.prefill

    @property
    def decode(self) -> list[WorkerHandle]:
        """The decode workers, in the order given."""
        return self._members.decode

    @property
    def workers(self) -> list[WorkerHandle]:
        return self._members.workers

    @property
    def refreshes(self) -> int:
        """Refreshes begun so far (see :meth:`refresh_unless_ready`)."""
        return self._refreshes

    @property
    def flights_live(self) -> int:
        """Requests submitted and not yet settled."""
        with self._lock:
            return len(self._flights)

    def worker_counts(self) -> tuple[int, int]:
        """Workers up, workers down (never answered counts as down)."""
        up = sum(w.up for w in self.workers)
        return up, len(self.workers) - up

    def ready(self) -> bool:
        """True when at least one decode worker is up with a prefill worker up that serves it
        and whose pairing it accepted (:meth:`Membership.ready`)."""
        return self._members.ready()

    # -- pairing ---------------------------------------------------------------------------------
    def connect(self) -> None:
        """Learn every worker and pair every decode worker with every prefill worker that
        serves it (covers its KV), or else with its gather set's members. ``ProtocolError`` if a
        pairing fails, a decode worker up has neither (naming both sides' head ranges), or no
        worker of a role answers."""
        self.refresh(force=True)
        for role, ws in (("prefill", self.prefill), ("decode", self.decode)):
            if not any(w.up for w in ws):
                raise ProtocolError(f"no {role} worker answered: {[w.address for w in ws]}")

    def refresh(self, *, force: bool = False) -> list[str]:
        """Re-learn workers: mark the silent ones down (failing their requests), re-pair those
        that restarted or came back up (or all, with ``force``), each only with the workers
        that serve it or it serves, and every pair either side reports unpaired or whose
        pairing was refused (with backoff: :meth:`Membership.pair_all`). Returns the peer ids
        of the workers that were (re-)paired (a pair paired again: its decode worker);
        ``ProtocolError`` after the whole refresh if a pairing failed (that pair is paired
        again, after its backoff) or a decode worker up is newly left with no prefill worker up
        that serves it (reported once, not re-paired: only a covering prefill worker coming up
        mends it)."""
        with self._refresh_lock:
            return self._refresh(force)

    def refresh_unless_ready(self, since: int | None = None) -> None:
        """Refresh, unless :meth:`ready` (a covered pair is up) or, with ``since``
        (:attr:`refreshes` as the caller read it), one began (so ended) since; checked under the
        lock, so callers waiting together share one refresh. ``ProtocolError`` as
        :meth:`refresh`."""
        with self._refresh_lock:
            if not self.ready() and (since is None or self._refreshes <= since):
                self._refresh(False)

    def _refresh(self, force: bool) -> list[str]:
        self._refreshes += 1  # under the refresh lock
        census = self._members.census(force)
        self.kv_events.update(w.info for w in self.workers)
        if self.policy is RoutePolicy.CACHE_AWARE:
            self.cache = self.cache.adopt(w.info for w in self.workers)
        self._fail_orphans()  # first: their orders are forgotten, not failed by the recycling
        for w in census.gone:  # new sockets (zmq's old frames dropped)
            self._members.recycle(w)
        done = self._members.pair_all(census.changed)
        for cause in done.retried:
            self.observe.retried(cause)
        if done.errors:
            self.observe.pairing_errors.inc()
            raise ProtocolError("; ".join(done.errors)[:4000])
        paired = {w.info.peer_id for w in census.changed if w.info is not None and w.up}
        paired |= {d.info.peer_id for d in done.repaired if d.info is not None}
        self.observe.pairings.inc(len(paired))
        return sorted(paired)

    def _fail_orphans(self) -> None:
        """Requests whose decode worker restarted or one of whose workers is down (a gather's
        member included: it fails the request for all): fail them now."""
        with self._lock:
            lost = [(f, why) for f in self._flights.values() if (why := f.orphaned())]
            for f, _ in lost:
                del self._flights[f.request_id]
        for f, reason in lost:
            self._abandon(f, reason)

    # -- settling --------------------------------------------------------------------------------
    def _settle(self, f: Flight, result: RequestResult) -> None:
        """Resolve ``f.out`` once (a restart, a deadline and a late answer may race), and
        end the chunks its prefill worker is expected to store: dropped unless it succeeded,
        else expected :data:`PENDING_GRACE_S` more at most (for the worker's KV events)."""
        ok, now = result.state == "success", time.monotonic()
        self.prefix_index.settle(f.session_id, ok=ok, until=now + PENDING_GRACE_S)
        with self._settle_lock:
            if not f.out.done():
                f.out.set_result(result)
                self.observe.ended(result.state)

    def _abandon(self, f: Flight, reason: str) -> None:
        """Fail a flight the router gave up on, forget its orders (one not sent yet never is)
        and cancel it on its workers that are up (every sender of a gather). Limit: a worker
        down is never sent the cancel; if it was only unreachable a while, it runs the request
        until the PD deadline ends it."""
        self._settle(f, f.failed(reason))
        for client, fut in f.orders:
            client.forget(fut)
        f.cancel_prefills(reason, up_only=True)
        if f.decode.up:
            f.cancel_decode(reason)

    def _expire_loop(self) -> None:
        """Deadline thread: fail and cancel the flights past their deadline (waits on nothing)."""
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            with self._lock:
                late = [f for f in self._flights.values() if f.deadline <= now]
                for f in late:
                    del self._flights[f.request_id]
            for f in late:
                try:
                    self._abandon(
                        f, f"no answer within the request deadline ({self.deadline_s:g} s)"
                    )
                except Exception:  # a bug must not stop the deadline thread
                    log.exception("router deadline expiry failed")

    def _refresh_loop(self) -> None:
        """Refresh thread (with ``refresh_s``): refresh that often, and at once when asked."""
        period = self.refresh_s or TICK_S
        while not self._stop.is_set():
            self._refresh_wanted.wait(period)
            self._refresh_wanted.clear()
            if self._stop.is_set():
                return
            try:
                self.refresh()
            except KVPlaneError as exc:
                if not self._stop.is_set():  # closing fails the refresh's calls: not news
                    log.warning("router refresh: %s", exc)
            except Exception:  # a bug must not stop the refresh thread
                log.exception("router refresh failed")

    # -- requests --------------------------------------------------------------------------------
    def _pick(
        self,
        n: int,
        tokens: int = 1,
        matches: dict[str, PrefixMatch] | None = None,
        first_key: ChunkKey | None = None,
    ) -> Route:
        """The route of request number ``n``, under the lock: decode ``eligible[n %
        len(eligible)]`` of the decode workers up that a route serves (:meth:`Membership.
        serving`: one prefill worker covering its KV, or its gather set; pairings vetted), then
        of its routes the next by that decode worker's cursor, which advances (with
        ``matches``: the cache-aware pick of a ``tokens``-token prompt with ``first_key``
        from that cursor on).
        ``ProtocolError``, nothing changed, before :meth:`connect`, while no worker of a role
        is up, or while no route serves a decode worker up (naming the ranges; the same error
        whether none covers its KV or every pairing of one that does was refused)."""
        for role, ws in (("prefill", self.prefill), ("decode", self.decode)):
            if all(w.info is None for w in ws):
                raise ProtocolError("call Router.connect() before submitting requests")
            if not any(w.up and w.info is not None for w in ws):
                raise ProtocolError(f"no {role} worker is up")
        eligible = [rs for d in self.decode if (rs := self._members.serving(d))]
        if not eligible:
            raise ProtocolError(why_no_route(self.prefill, self.decode))
        rs = eligible[n % len(eligible)]
        d = rs[0].decode
        turn = self._turns.get(d, 0)
        k = turn % len(rs)
        if matches is not None:
            queued = Counter[str]()  # prompt tokens to compute in flight per prefill worker
            for f in self._flights.values():
                for s in f.route.senders:
                    queued[s.info.peer_id] += f.queued_tokens
            names = [r.name for r in rs]
            k = self.cache.pick(
                names, turn, queued=queued, matches=matches, prompt_tokens=tokens,
                first_key=first_key,
            )  # fmt: skip
        self._turns[d] = turn + 1
        return rs[k]

    def submit(
        self,
        request_id: str,
        token_ids: tuple[int, ...] | list[int],
        *,
        max_new_tokens: int = 1,
        step_size: int = 0,
    ) -> Future[RequestResult]:
        """Start one request; the future resolves to its :class:`RequestResult` (failed by the
        deadline at the latest). Nothing is sent and nothing changes when it raises:
        ``InvalidArgumentError`` for an invalid value or a request id already in flight,
        ``ProtocolError`` before :meth:`connect`, while no worker of a role is up, or while no
        route serves a decode worker up (one prefill worker up covering its KV, or a gather
        set of them, with vetted pairings)."""
        try:
            tokens = [operator.index(t) for t in token_ids]
            order = msgspec.convert(
                {"request_id": request_id, "token_ids": tokens,
                 "max_new_tokens": max_new_tokens, "step_size": step_size},
                Generate,
            )  # fmt: skip
        except (TypeError, msgspec.ValidationError) as exc:
            raise InvalidArgumentError(f"request {request_id!r}: {exc}") from None
        cache_aware, now = self.policy is RoutePolicy.CACHE_AWARE, time.monotonic()
        keys = self.cache.keys(tokens) if cache_aware else []
        matches = self.prefix_index.longest_prefix(keys, now=now) if cache_aware else None
        with self._lock:
            if request_id in self._flights:
                raise InvalidArgumentError(f"request {request_id!r} is already in flight")
            route = self._pick(self._serial, len(tokens), matches, keys[0] if keys else None)
            sid = f"{request_id}/{self._tag}.{self._serial}"
            base = DecodeOrder(
                request_id=request_id, session_id=sid, prefill_peer=route.name,
                token_ids=order.token_ids, max_new_tokens=max_new_tokens,
            )  # fmt: skip
            dec_order, pre_orders = route_orders(route, base, step_size)
            self._serial += 1
            self.gathered += route.gathered
            flight = Flight(
                request_id, sid, route, tuple(o.session_id for _, o in pre_orders), Future(),
                len(tokens), now + self.deadline_s,
            )  # fmt: skip
            self._flights[request_id] = flight
            if matches is not None and not route.gathered:  # its chunks: expected there
                flight.uncached_tokens = self.cache.uncached_tokens(matches.get(route.name),
                                                                    len(tokens))  # fmt: skip
                self.prefix_index.expect(sid, route.name, keys, until=flight.deadline)
        self.observe.requests.inc()
        if route.gathered:
            self.observe.gathered.inc()
        for w, o in pre_orders:  # each order is forgotten on the client it went out on
            pc = w.client
            pre = pc.call_async(o)
            flight.orders.append((pc, pre))
            pre.add_done_callback(lambda f: self._on_prefill(flight, f))
        dc = route.decode.client
        dec = dc.call_async(dec_order)
        flight.decode_queued()  # a cancel asked meanwhile (prefill refused) follows its order
        flight.orders.append((dc, dec))
        dec.add_done_callback(lambda f: self._on_decode(flight, f))
        return flight.out

    def _on_prefill(self, flight: Flight, f: Future[AnyMessage]) -> None:
        if f.cancelled():  # forgotten: the router gave up on the request
            return
        exc = f.exception()
        got = f.result() if exc is None else ErrorReply(reason=str(exc)[:4000])
        if isinstance(got, ErrorReply):  # the decode side answers the order when it stops
            self._check_pair(flight, got.reason)  # its cancel of a gather ends every member:
            flight.cancel_decode(f"prefill refused: {got.reason}")  # each sender is told

    def _on_decode(self, flight: Flight, f: Future[AnyMessage]) -> None:
        with self._lock:
            if self._flights.get(flight.request_id) is flight:
                del self._flights[flight.request_id]
        if f.cancelled():  # forgotten: whoever gave up on the request settled it
            return
        exc = f.exception()
        got = f.result() if exc is None else ErrorReply(reason=str(exc)[:4000])
        if isinstance(got, RequestResult):
            if got.state != "success":
                self._check_pair(flight, got.reason)
            self._settle(flight, got)
            return
        reason = got.reason if isinstance(got, ErrorReply) else f"unexpected reply {got!r}"
        reason = self._check_pair(flight, reason)
        flight.cancel_prefills(reason)
        self._settle(flight, flight.failed(reason))

    def _check_pair(self, flight: Flight, reason: str) -> str:
        """When a worker's ``reason`` says its PD peer is not connected (``NOT_CONNECTED``):
        mark the flight's pairs lost (:meth:`Membership.lost`: of a gather, those with the
        senders ``reason`` names, or all when it names none) and refresh now (with
        ``refresh_s``), which re-pairs them. ``reason``, saying so when it did."""
        if NOT_CONNECTED not in reason:
            return reason
        d, named = flight.decode, flight.named(reason)
        for p in named:
            self._members.lost(d, p, flight.decode_incarnation, reason[:200])
        self._refresh_wanted.set()
        to = ", ".join(p.address for p in named)
        return f"{reason} (the router re-pairs {d.address} with {to})"

    def generate(
        self, request_id: str, token_ids: tuple[int, ...] | list[int], **kw: int
    ) -> RequestResult:
        """:meth:`submit` and wait (``TransferTimeoutError`` after ``timeout_s``)."""
        fut = self.submit(request_id, token_ids, **kw)
        try:
            return fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise TransferTimeoutError(f"request {request_id!r} did not end in time") from None

    def cancel(self, request_id: str, *, side: str = "decode", reason: str = "cancelled") -> bool:
        """Cancel a request on its decode worker or its prefill workers (every sender of a
        gather); False if it is not in flight."""
        if side not in ("decode", "prefill"):
            raise InvalidArgumentError(f"side must be 'decode' or 'prefill', got {side!r}")
        with self._lock:
            flight = self._flights.get(request_id)
        if flight is None:
            return False
        if side == "decode":
            flight.cancel_decode(reason)
        else:  # every sender of a gather
            flight.cancel_prefills(reason)
        return True

    # -- observation -----------------------------------------------------------------------------
    def gather_stats(self, *, timeline: bool = False) -> tuple[dict[str, WorkerStats], list[str]]:
        """Stats of every worker that is up, by peer id, waiting at most ``timeout_s`` in all;
        and the addresses (with why) of the workers that gave none: the up ones that did not
        answer, and every worker down (or never heard from), which is not asked or waited for."""
        return self._members.gather_stats(timeline)

    def stats(self, *, timeline: bool = False) -> dict[str, WorkerStats]:
        """Stats of every worker; ``TransferTimeoutError`` naming those that gave none (down,
        or no reply within ``timeout_s``)."""
        out, missing = self.gather_stats(timeline=timeline)
        if missing:
            raise TransferTimeoutError(f"no stats from {', '.join(missing)}"[:4000])
        return out
