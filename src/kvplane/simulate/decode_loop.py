"""The decode side of the simulated cluster: landed KVs, decode admission, a serial worker's loop.

:class:`DecodeSide` holds :class:`~kvplane.simulate.engine.Simulation`'s handlers from a KV's
landing to its decode's end. A serial decode worker (``kvplane serve``'s) is one loop serving
its inbox in arrival order: orders, each holding it for its accept before the sends held for
it go, and landed KVs, in landing order, each decoded once ready. See docs/simulate.md.
"""

from __future__ import annotations

from kvplane.simulate.events import ACCEPTED, DECODE_DONE, SEND, EventLoop
from kvplane.simulate.spec import ClusterSpec
from kvplane.simulate.timing import tpot_s
from kvplane.simulate.workers import DecodeWorker, Flight, PrefillWorker


class DecodeSide:
    """Decode handlers over the simulation's state (set by ``Simulation.__init__``)."""

    loop: EventLoop
    spec: ClusterSpec
    held: int
    flights: list[Flight]
    prefill: list[PrefillWorker]
    decode: list[DecodeWorker]

    def _landed(self, rid: int, attempt: int) -> None:
        """A serial worker's KV landed: it takes its place in the loop's inbox (in landing
        order), decodable once ready (its latency after the op, ``rtt_s``, has passed)."""
        f = self.flights[rid]
        d = self.decode[f.dw]
        if f.attempt == attempt and self.prefill[f.pw].alive and d.alive:
            d.queue.append(rid)

    def _ready(self, rid: int, attempt: int) -> None:
        f = self.flights[rid]
        d = self.decode[f.dw]
        if f.attempt != attempt or not self.prefill[f.pw].alive:
            if f.attempt == attempt and rid in d.queue:
                d.queue.remove(rid)
            return  # re-routed since, or its sender died (its lease will re-route it)
        self.prefill[f.pw].flights.discard(rid)
        if d.alive:
            if rid not in d.queue:
                d.queue.append(rid)
            self._next(d)

    def _admit(self, d: DecodeWorker) -> None:
        now = self.loop.now
        while d.queue:
            f = self.flights[d.queue[0]]
            context = f.req.input_tokens + f.req.output_tokens
            if not d.can_admit(context * self.held):
                return
            d.queue.popleft()
            d.admit(context, context * self.held)
            f.decode_start = now
            hold = f.req.decode_s
            if hold is None:
                hold = (f.req.output_tokens - 1) * tpot_s(self.spec.decode, d.context)
            self.loop.at(now + hold, DECODE_DONE, f.req.rid, f.attempt)

    def _decode_done(self, rid: int, attempt: int) -> None:
        f = self.flights[rid]
        d = self.decode[f.dw]
        if f.attempt != attempt or not d.alive:
            return
        context = f.req.input_tokens + f.req.output_tokens
        d.release(context, context * self.held, self.loop.now - f.decode_start)
        d.flights.discard(rid)
        f.done = self.loop.now
        f.finished += 1
        self._next(d)

    def _next(self, d: DecodeWorker) -> None:
        """``d`` may start more: a serial worker's loop its next item, another its queue."""
        if d.spec.serial:
            self._serve(d)
        else:
            self._admit(d)

    def _order(self, rid: int, attempt: int) -> None:
        """``rid``'s order reaches its serial decode worker's inbox (behind what came first)."""
        f = self.flights[rid]
        if f.attempt != attempt:
            return
        d = self.decode[f.dw]
        f.ordered = self.loop.now
        d.orders.append(rid)
        self._serve(d)

    def _serve(self, d: DecodeWorker) -> None:
        """A serial worker's free loop takes its inbox's next item: the earlier of its first
        waiting order and first landed KV, by the KV's ready time (the order at a tie); KVs
        go in landing order, the first once ready. An order holds it for its
        accept (``Replayed.accept_s``, else ``[decode] accept_s`` if the order waited, else
        0), then its held sends go; a KV starts decoding."""
        now = self.loop.now
        while d.alive and not d.loop_busy():
            first = self.flights[d.queue[0]].ready if d.queue else float("inf")
            if not d.orders or self.flights[d.orders[0]].ordered > first:
                if first <= now:  # the first landed KV is ready (its READY serves again)
                    self._admit(d)
                return
            f = self.flights[d.orders.pop(0)]
            own = f.req.replayed.accept_s if f.req.replayed is not None else None
            hold = own if own is not None else d.spec.accept_s if now > f.ordered else 0.0
            if hold > 0:
                d.accepting = (f.req.rid, f.attempt)
                self.loop.at(now + hold, ACCEPTED, d.index, f.req.rid)
                return
            self._let_go(f)

    def _accepted(self, dw: int, rid: int) -> None:
        """A serial worker's loop took ``rid``'s order (unless re-routed since): its held sends
        go now; the loop takes its next item."""
        d, f = self.decode[dw], self.flights[rid]
        taking, d.accepting = d.accepting, None
        if d.alive and taking == (rid, f.attempt):
            self._let_go(f)
        self._serve(d)

    def _let_go(self, f: Flight) -> None:
        """``f``'s order is accepted: the sends that found it not accepted go now."""
        f.accepted = True
        for _ in range(f.deferred):
            self.loop.at(self.loop.now, SEND, f.req.rid, f.attempt)
        f.deferred = 0
