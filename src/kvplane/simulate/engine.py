"""The simulated PD cluster: arrival → router → prefill → transfer → decode → done.

:class:`Simulation` owns the event handlers and the model state (flights, workers, tiers). A
prefill looks its prompt up across tiers, loads the hit chunks, computes the rest slice by slice
and sends the KV (:func:`~kvplane.simulate.timing.kv_pieces`; interleaving workers step their
requests in turn, one event a step); its chunks are stored when it ends. A serial decode worker
is one loop serving its inbox in arrival order -- orders (each holding it for its accept) and
landed KVs (each for its decode) -- and the KV of an order it has not taken waits. Failures
kill a worker; its lease later re-routes its requests. The decode side's handlers are
:class:`~kvplane.simulate.decode_loop.DecodeSide`'s. See docs/simulate.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.errors import ConfigError
from kvplane.simulate.decode_loop import DecodeSide
from kvplane.simulate.events import (
    ARRIVE,
    DETECT,
    INBOX,
    JOIN,
    KILL,
    LANDED,
    ORDER,
    PREFILL_DONE,
    READY,
    SEND,
    STEP,
    EventLoop,
)
from kvplane.simulate.result import FailureResult, Outcome
from kvplane.simulate.router import Router
from kvplane.simulate.spec import ROLES, TIER_ORDER, ClusterSpec
from kvplane.simulate.tiers import TierCache, hit_tokens, prefix_walk
from kvplane.simulate.timing import (
    book_op,
    compute_s,
    kv_pieces,
    replayed_op,
    step_hold_s,
)
from kvplane.simulate.workers import DecodeWorker, Flight, PrefillWorker
from kvplane.simulate.workload import Request, reusable_blocks, stored_blocks

IDLE, AWAY = -1, -2
"""A prefill worker's ``current`` when it computes nothing: idle, or busy with its own work
after a replayed step (``Replayed.after_s``)."""


class Simulation(DecodeSide):
    """One run of ``requests`` (sorted by arrival) on ``spec``; :meth:`run` once, then read
    :meth:`outcomes`, the workers, tiers and totals (``result.summarize`` does)."""

    def __init__(self, spec: ClusterSpec, requests: Sequence[Request]) -> None:
        if not spec.prefill.interleave and any(r.replayed and r.replayed.step_s for r in requests):
            raise ConfigError("replayed prefill steps need an interleaving prefill worker")
        self.spec = spec
        self.requests = requests
        self.loop = EventLoop()
        self.router = Router(spec.router, spec.prefill_workers, spec.decode_workers)
        held = spec.geometry.held_bytes_per_token
        self.held = held
        shared = {t.name: TierCache(t, held) for t in spec.tiers if t.shared}
        self.prefill: list[PrefillWorker] = []
        for i in range(spec.prefill_workers):
            local = {t.name: TierCache(t, held) for t in spec.tiers if not t.shared}
            chain = [local.get(n) or shared[n] for n in TIER_ORDER if n in local or n in shared]
            self.prefill.append(PrefillWorker(i, list(local.values()), chain))
        self.shared = list(shared.values())
        self.decode = [DecodeWorker(i, spec.decode) for i in range(spec.decode_workers)]
        self.flights = [Flight(r) for r in sorted(requests, key=lambda r: r.rid)]
        self.transport_bytes = 0
        self.lookup_tokens = self.lookup_hits = 0
        self.failures: list[FailureResult] = []

    # -- driving -----------------------------------------------------------------------------
    def run(self) -> None:
        """Simulate every request to its end (each finishes exactly once)."""
        for f in self.spec.failures:
            self.loop.at(f.at_s, KILL, ROLES.index(f.role), f.index)
        if self.requests:
            self.loop.at(self.requests[0].arrival_s, ARRIVE, 0)
        early = (self._arrive, self._prefill_done, self._send, self._ready)
        late = (self._decode_done, self._kill, self._detect, self._step)
        orders = (self._order, self._accepted, self._join_order, self._inbox, self._landed)
        self.loop.run((*early, *late, *orders))

    def outcomes(self) -> list[Outcome]:
        """Every request's final attempt, by request id."""
        return [
            Outcome(
                f.req.rid,
                f.req.output_tokens,
                f.req.arrival_s,
                f.prefill_start,
                f.compute_start,
                f.prefill_end,
                f.ready,
                f.decode_start,
                f.done,
                f.hit_tokens,
                f.attempt + 1,
            )
            for f in self.flights
        ]

    # -- arrival and routing -------------------------------------------------------------------
    def _arrive(self, index: int, _: int) -> None:
        nxt = index + 1
        if nxt < len(self.requests):
            self.loop.at(self.requests[nxt].arrival_s, ARRIVE, nxt)
        self._route(self.flights[self.requests[index].rid])

    def _route(self, f: Flight) -> None:
        now = self.loop.now
        req = f.req
        blocks = reusable_blocks(req.input_tokens)
        backlog = [max(0.0, p.busy_until - now) + p.backlog_s for p in self.prefill]
        est: dict[int, float] = {}  # worker -> compute left after its cached prefix

        def compute_left(i: int) -> float:
            if i not in est:
                hit = hit_tokens(prefix_walk(self.prefill[i].chain, req.hash_ids, blocks))
                est[i] = compute_s(self.spec.prefill, hit, req.input_tokens)
            return est[i]

        p = self.prefill[self.router.pick_prefill(backlog, lambda i: backlog[i] + compute_left(i))]
        d = self.decode[self.router.pick_decode([len(w.flights) for w in self.decode])]
        f.pw, f.dw = p.index, d.index
        f.est_s = compute_left(p.index)
        f.accepted = not d.spec.serial  # a serial worker's loop takes the order
        if d.spec.serial:
            delay = req.replayed.order_s if req.replayed is not None else 0.0
            if delay > 0:
                self.loop.at(now + delay, ORDER, req.rid, f.attempt)
            else:
                self._order(req.rid, f.attempt)
        p.backlog_s += f.est_s
        p.flights.add(req.rid)
        d.flights.add(req.rid)
        taking = req.replayed.prefill_s if req.replayed is not None else None
        if taking and req.replayed is not None:  # its order waits in the worker's inbox
            if req.replayed.inbox_s > 0:
                self.loop.at(now + min(req.replayed.inbox_s, taking), INBOX, req.rid, f.attempt)
            else:  # now: before a setup that ends as it arrives
                p.inbox.add(req.rid)
            self.loop.at(now + taking, JOIN, req.rid, f.attempt)
        else:
            self._join_order(req.rid, f.attempt)

    def _inbox(self, rid: int, attempt: int) -> None:
        """``rid``'s prefill order reaches its worker's inbox: the worker steps no request
        until it has taken it (:meth:`_join_order`)."""
        f = self.flights[rid]
        if f.attempt == attempt:
            self.prefill[f.pw].inbox.add(rid)

    def _join_order(self, rid: int, attempt: int) -> None:
        """``rid``'s order reaches its prefill worker (routed, or ``Replayed.prefill_s``
        later): it joins the worker's queue."""
        f = self.flights[rid]
        if f.attempt != attempt:
            return
        p = self.prefill[f.pw]
        p.inbox.discard(rid)
        if self.spec.prefill.interleave:
            if p.alive:
                self._take(p, f)
            return
        p.queue.append(rid)
        if p.current == IDLE and p.alive:
            self._start_prefill(p)

    # -- prefill -------------------------------------------------------------------------------
    def _lookup(self, p: PrefillWorker, f: Flight) -> None:
        """A new attempt of ``f`` on ``p``: after the setup, walk its prompt across ``p``'s
        tiers and book the hit chunks' loads; compute may start when they end."""
        now, req = self.loop.now, f.req
        walk = prefix_walk(p.chain, req.hash_ids, reusable_blocks(req.input_tokens))
        hit = hit_tokens(walk)
        start = loaded = now + self._setup_s(f)
        for ti, tier in enumerate(p.chain):
            keys = [req.hash_ids[b] for t, b in walk if t == ti]
            if keys:
                loaded = max(loaded, tier.load(keys, start))
        self.lookup_tokens += req.input_tokens
        self.lookup_hits += hit
        f.hit_tokens, f.prefill_start, f.compute_start, f.prefill_end = hit, now, loaded, -1.0
        f.next_piece = f.deferred = 0
        f.ops = []
        f.ready = -1.0
        f.transfer_s = f.hidden_s = 0.0

    def _start_prefill(self, p: PrefillWorker) -> None:
        """FIFO: the queue's head computes all its slices, the worker held till its end."""
        now = self.loop.now
        f = self.flights[p.queue.popleft()]
        req = f.req
        p.current = req.rid
        p.backlog_s = max(0.0, p.backlog_s - f.est_s)
        self._lookup(p, f)
        spec, hit = self.spec.prefill, f.hit_tokens
        f.pieces, end = kv_pieces(spec, hit, req.input_tokens, f.compute_start, self.held)
        f.pieces_total, f.prefill_end = len(f.pieces), end
        p.busy_s += end - now
        p.busy_until = end
        self.loop.at(end, PREFILL_DONE, p.index, req.rid)
        for at, _ in f.pieces:
            self.loop.at(at, SEND, req.rid, f.attempt)

    def _take(self, p: PrefillWorker, f: Flight) -> None:
        """Interleaving: ``f``'s order waits for ``p`` to be between steps (its setup holds
        the worker, one order at a time), then ``f`` joins the running requests."""
        p.queue.append(f.req.rid)
        if p.current == IDLE:
            self._next_step(p)

    def _join(self, p: PrefillWorker, f: Flight) -> None:
        """``f`` joins ``p``'s running requests (computing once set up and loaded)."""
        spec, n = self.spec.prefill, f.req.input_tokens
        self._lookup(p, f)
        hit = f.next_token = f.hit_tokens
        f.pieces = []
        f.pieces_total = 1
        if spec.pipelined:
            f.pieces_total = -(-(n - hit) // spec.slice_tokens) + (1 if hit else 0)
            if hit:
                f.pieces.append((f.compute_start, hit * self.held))
                self.loop.at(f.compute_start, SEND, f.req.rid, f.attempt)
        p.running.append(f.req.rid)

    def _setup_s(self, f: Flight) -> float:
        """``f``'s setup: its measured one (``Replayed.setup_s``), else ``[prefill] setup_s``."""
        own = f.req.replayed.setup_s if f.req.replayed is not None else None
        return self.spec.prefill.setup_s if own is None else own

    def _away(self, p: PrefillWorker, seconds: float) -> None:
        """``p`` is busy with its own work (an order's setup, a replayed step's aftermath)."""
        p.current = AWAY
        p.busy_s += seconds
        p.busy_until = self.loop.now + seconds
        self.loop.at(self.loop.now + seconds, STEP, p.index, AWAY)

    def _next_step(self, p: PrefillWorker) -> None:
        """Take the next waiting order (its setup holds the worker); wait while an order in
        its inbox is being taken (it joins at its measured time); spend the time owed after
        the last step; else start one step of the next running request (in turn) whose loads
        have ended; if all are loading, wake when the first is loaded."""
        now, spec = self.loop.now, self.spec.prefill
        while p.queue:
            f = self.flights[p.queue.popleft()]
            self._join(p, f)
            if self._setup_s(f) > 0:
                self._away(p, self._setup_s(f))
                return
        if p.inbox:
            return  # its join calls this again
        if p.owed_s > 0:
            owed, p.owed_s = p.owed_s, 0.0
            self._away(p, owed)
            return
        for _ in range(len(p.running)):
            rid = p.running[0]
            p.running.rotate(-1)
            f = self.flights[rid]
            if f.compute_start <= now:
                s = f.next_token
                e, k = min(s + spec.slice_tokens, f.req.input_tokens), self._step_index(f)
                hold = step_hold_s(spec, s, e, k, f.req.replayed)[0]
                p.current = rid
                p.busy_s += hold
                p.busy_until = now + hold
                self.loop.at(now + hold, STEP, p.index, rid)
                return
        if p.running:
            self.loop.at(min(self.flights[r].compute_start for r in p.running), STEP, p.index, -1)

    def _step_index(self, f: Flight) -> int:
        """Which computed step of ``f`` starts at its next token (0: the first after a hit)."""
        return (f.next_token - f.hit_tokens) // self.spec.prefill.slice_tokens

    def _step(self, pw: int, rid: int) -> None:
        """A step of ``rid`` ended on an interleaving worker (``rid`` IDLE: a wake-up, AWAY:
        the worker's own time after a replayed step ended): send its slice (pipelined), end
        its prefill after its last step, spend any replayed time after it, start the next."""
        p, now, spec = self.prefill[pw], self.loop.now, self.spec.prefill
        if not p.alive or p.current != rid:
            return  # a wake-up while a step runs: that step's end starts the next one
        p.current = IDLE
        after = 0.0
        if rid >= 0 and rid in p.running:
            f = self.flights[rid]
            s, n, k = f.next_token, f.req.input_tokens, self._step_index(f)
            e = f.next_token = min(s + spec.slice_tokens, n)
            after = step_hold_s(spec, s, e, k, f.req.replayed)[1]
            if spec.pipelined:
                f.pieces.append((now, (e - s) * self.held))
                self.loop.at(now, SEND, rid, f.attempt)
            if e == n:
                p.running.remove(rid)
                p.backlog_s = max(0.0, p.backlog_s - f.est_s)
                f.prefill_end = now
                if not spec.pipelined:
                    f.pieces.append((now, n * self.held))
                    self.loop.at(now, SEND, rid, f.attempt)
                self._store(p, f)
        p.owed_s += after  # spent once the orders that came meanwhile are taken
        self._next_step(p)

    def _send(self, rid: int, attempt: int) -> None:
        """The next piece of a flight's KV is ready: book it on the PD link (in time order, so
        transfers from different prefill workers queue fairly at a decode worker)."""
        f = self.flights[rid]
        p, d = self.prefill[f.pw], self.decode[f.dw]
        if f.attempt != attempt or not p.alive or not d.alive:
            return  # re-routed since, or a side died (its lease will re-route the flight)
        if not f.accepted:
            f.deferred += 1  # sent again when the serial decode worker takes the order
            return
        at, nbytes = f.pieces[f.next_piece]
        ready, rtt = max(at, self.loop.now), self.spec.transport.rtt_s
        replayed = f.req.replayed
        if replayed is None or replayed.op_s is None:
            start, landed = book_op(self.spec.transport, ready, nbytes, p.link, d.link)
        else:  # measured: its wait for the link is in its span, so it books no lane
            delay, held = replayed_op(replayed, f.next_piece, f.pieces_total)
            start = ready + delay
            rtt = rtt if replayed.lag_s is None else replayed.lag_s
            landed = start + held + rtt
        f.next_piece += 1
        self.transport_bytes += nbytes
        f.transfer_s += landed - rtt - start  # the op's span; the latency after it is not
        f.ops.append((start, landed - rtt))
        f.ready = max(f.ready, landed)
        if f.next_piece == f.pieces_total:  # the prefill has ended: its end is known
            f.hidden_s = sum(max(0.0, min(b, f.prefill_end) - a) for a, b in f.ops)
            end = max(b for _, b in f.ops)
            f.ops.clear()
            if d.spec.serial and end < f.ready:  # its place in the loop's inbox: when it landed
                self.loop.at(end, LANDED, rid, attempt)
            self.loop.at(f.ready, READY, rid, attempt)

    def _prefill_done(self, pw: int, rid: int) -> None:
        p = self.prefill[pw]
        if not p.alive or p.current != rid:
            return
        self._store(p, self.flights[rid])
        p.current = IDLE
        if p.queue:
            self._start_prefill(p)

    def _store(self, p: PrefillWorker, f: Flight) -> None:
        """Write the full chunks of ``f``'s prompt through ``p``'s tiers (its prefill ended)."""
        blocks = stored_blocks(f.req.input_tokens)
        for tier in p.chain:
            tier.store(f.req.hash_ids, blocks, self.loop.now)

    # -- failures ------------------------------------------------------------------------------
    def _kill(self, role: int, index: int) -> None:
        """The worker stops: its events are ignored from now on and its own tiers are lost."""
        if role == 0:
            self.prefill[index].alive = False
            for tier in self.prefill[index].local:
                tier.clear(self.loop.now)
        else:
            self.decode[index].alive = False
        self.loop.at(self.loop.now + self.spec.lease_s, DETECT, role, index)

    def _detect(self, role: int, index: int) -> None:
        """The worker's lease ran out: the router drops it, the survivors release what its
        sessions held (after an abort round trip and any op still in flight), and its requests
        are routed again from scratch."""
        now = self.loop.now
        self.router.mark_dead(ROLES[role], index)
        dead = self.prefill[index] if role == 0 else self.decode[index]
        rids = sorted(dead.flights)
        released = now + self.spec.transport.rtt_s
        for rid in rids:
            f = self.flights[rid]
            if f.ready > now:  # KV still in flight
                released = max(released, f.ready)
            f.attempt += 1
            p, d = self.prefill[f.pw], self.decode[f.dw]
            if rid in p.queue or rid in p.running:
                (p.queue if rid in p.queue else p.running).remove(rid)
                p.backlog_s = max(0.0, p.backlog_s - f.est_s)
            p.inbox.discard(rid)
            if rid in d.orders:
                d.orders.remove(rid)
            p.flights.discard(rid)
            d.flights.discard(rid)
            if rid in d.queue:
                d.queue.remove(rid)
        killed_at = now - self.spec.lease_s
        self.failures.append(
            FailureResult(ROLES[role], index, killed_at, len(rids), released - killed_at)
        )
        for rid in rids:
            self._route(self.flights[rid])
