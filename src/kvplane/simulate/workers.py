"""The mutable state of a simulation: one :class:`Flight` per request, one object per worker.

Plain slotted classes the engine changes in place (they are the model's state, not values).
A flight's ``attempt`` grows each time a failure re-routes it, so events booked for an older
attempt are recognised as stale. Decode admission (batch slots and KV capacity) lives here.
"""

from __future__ import annotations

from collections import deque

from kvplane.simulate.spec import DecodeSpec
from kvplane.simulate.tiers import TierCache
from kvplane.simulate.timing import Lane
from kvplane.simulate.workload import Request


class Flight:
    """One request's progress through its latest attempt; times in simulated seconds, -1.0
    where not reached yet."""

    __slots__ = (
        "accepted",
        "attempt",
        "compute_start",
        "decode_start",
        "deferred",
        "done",
        "dw",
        "est_s",
        "finished",
        "hidden_s",
        "hit_tokens",
        "next_piece",
        "next_token",
        "ops",
        "ordered",
        "pieces",
        "pieces_total",
        "prefill_end",
        "prefill_start",
        "pw",
        "ready",
        "req",
        "transfer_s",
    )

    def __init__(self, req: Request) -> None:
        self.req = req
        self.attempt = 0
        self.finished = 0
        self.pw = self.dw = -1
        self.est_s = self.hidden_s = self.transfer_s = 0.0
        self.hit_tokens = self.next_piece = self.next_token = self.pieces_total = 0
        self.pieces: list[tuple[float, int]] = []
        """The KV's ops as (ready time, bytes), ``pieces_total`` of them once all are known."""
        self.ops: list[tuple[float, float]] = []
        """The ops booked so far, (start, end): each op's span, the ``rtt_s`` after it not."""
        self.accepted = True
        """False while a serial decode worker's loop has not taken the order."""
        self.ordered = 0.0
        """When the latest attempt's order reached a serial decode worker."""
        self.deferred = 0
        """Sends that found the order not accepted yet: made again when it is."""
        self.prefill_start = self.compute_start = self.prefill_end = -1.0
        self.ready = self.decode_start = self.done = -1.0


class PrefillWorker:
    """A prefill worker: a FIFO queue served one request at a time (or, interleaving, the
    ``running`` requests a step each in turn, ``queue`` holding the orders it has not taken
    yet), its own tiers (``chain`` holds them with the shared ones, fastest first), its
    outgoing link, and the flights it holds until their KV has landed (``flights``).
    ``current``: the request computing now, -1 when idle (-2: busy with its own work);
    ``inbox``: the orders it is taking (they join at measured times, ``Replayed.prefill_s``);
    ``owed_s``: its own time after a replayed step, spent once those orders are taken."""

    __slots__ = (
        "alive",
        "backlog_s",
        "busy_s",
        "busy_until",
        "chain",
        "current",
        "flights",
        "inbox",
        "index",
        "link",
        "local",
        "owed_s",
        "queue",
        "running",
    )

    def __init__(self, index: int, local: list[TierCache], chain: list[TierCache]) -> None:
        self.index = index
        self.alive = True
        self.queue: deque[int] = deque()
        self.running: deque[int] = deque()
        self.current = -1
        self.busy_until = self.busy_s = self.backlog_s = self.owed_s = 0.0
        self.inbox: set[int] = set()
        self.local = local
        self.chain = chain
        self.link = Lane()
        self.flights: set[int] = set()


class DecodeWorker:
    """A decode worker: up to ``max_batch`` sequences and ``kv_capacity_bytes`` of their KV;
    the rest wait in FIFO order. ``flights`` are the requests routed to it and not done;
    ``orders`` those a serial worker has not accepted yet, in arrival order; ``accepting``:
    the (request, attempt) whose order a serial worker's loop is taking, else None."""

    __slots__ = (
        "accepting",
        "active",
        "alive",
        "context",
        "flights",
        "index",
        "kv_bytes",
        "link",
        "orders",
        "queue",
        "slot_s",
        "spec",
    )

    def __init__(self, index: int, spec: DecodeSpec) -> None:
        self.index = index
        self.spec = spec
        self.alive = True
        self.queue: deque[int] = deque()
        self.active = self.context = self.kv_bytes = 0
        self.slot_s = 0.0
        self.link = Lane()
        self.flights: set[int] = set()
        self.orders: list[int] = []
        self.accepting: tuple[int, int] | None = None

    def loop_busy(self) -> bool:
        """Whether a serial worker's loop is decoding or taking an order."""
        return self.active > 0 or self.accepting is not None

    def can_admit(self, kv_bytes: int) -> bool:
        """Whether a sequence of ``kv_bytes`` fits now (an empty worker admits any one, so a
        sequence larger than the capacity still runs, alone)."""
        if self.active >= self.spec.max_batch:
            return False
        cap = self.spec.kv_capacity_bytes
        return cap == 0 or self.active == 0 or self.kv_bytes + kv_bytes <= cap

    def admit(self, context: int, kv_bytes: int) -> None:
        """Start a sequence of ``context`` tokens holding ``kv_bytes``."""
        self.active += 1
        self.context += context
        self.kv_bytes += kv_bytes

    def release(self, context: int, kv_bytes: int, held_s: float) -> None:
        """End a sequence admitted with these figures, after ``held_s`` seconds in its slot."""
        self.active -= 1
        self.context -= context
        self.kv_bytes -= kv_bytes
        self.slot_s += held_s
