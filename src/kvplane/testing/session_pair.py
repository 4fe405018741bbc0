"""``SessionPair``: a prefill and a decode participant over a faulty link, simulated.

A deterministic discrete-event run of the whole control plane: frames go through the real codec
and a :class:`~kvplane.testing.faulty_link.FaultyLink`, a simulated backend answers each submit
by :class:`~kvplane.testing.faults.TransferFaults`, and each application follows a
:class:`SessionPlan`; all from one seed. :meth:`SessionPair.violations` lists the protocol
guarantees a run broke (docs/pd.md, "Simulated pairs").
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RequestId, SessionId, SliceId
from kvplane.pd.actions import Action, Finished, Release, StartSubmit, Transmit
from kvplane.pd.codec import Codec, MalformedMessage
from kvplane.pd.events import (
    Cancel,
    Fail,
    StartTransfer,
    SubmitAccepted,
    SubmitSkipped,
    SubmitSlice,
    SubmitStarted,
    TransportDone,
    TransportFailed,
    TransportInDoubt,
)
from kvplane.pd.handshake import PROTOCOL_VERSION, LayoutInfo, PeerProfile
from kvplane.pd.ledger import DESTINATION
from kvplane.pd.participant import Participant
from kvplane.pd.states import RELEASING, Ownership, Role, SessionState
from kvplane.pd.timers import Timings
from kvplane.testing.faults import Fate, FrameFaults, TransferFaults
from kvplane.testing.faulty_link import FaultyLink

PREFILL = PeerId("prefill")
DECODE = PeerId("decode")
SIM_TIMINGS = Timings(
    deadline_s=2.0,
    verdict_grace_s=1.0,
    retransmit_s=0.05,
    drain_s=0.3,
    in_doubt_s=0.2,
    heartbeat_s=0.1,
    lease_s=2.0,
)
"""Short protocol timings: simulated seconds are free, but events are not."""


def sim_profile() -> PeerProfile:
    """A tiny MLA model profile both simulated workers share."""
    lay = LayoutInfo(
        kind="mla", dtype="bfloat16", layer_ids=(0, 1), total_heads=1, head_start=0,
        head_end=1, head_dim=32, rope_dim=16, block_size=16,
    )  # fmt: skip
    return PeerProfile(protocol_version=PROTOCOL_VERSION, model_id="tiny-mla", layouts=(lay,))


@dataclass(frozen=True, slots=True)
class SessionPlan:
    """What the two applications do for one session (times in simulated seconds)."""

    session_id: SessionId
    num_tokens: int
    prefix_tokens: int
    step_tokens: int
    step_s: float
    sender_opens_at: float
    receiver_opens_at: float
    cancel: tuple[Role, float] | None = None
    fail: tuple[Role, float] | None = None
    stall_after: int | None = None

    @staticmethod
    def random(rng: random.Random, session_id: str) -> SessionPlan:
        n = rng.randint(0, 300)
        prefix = rng.choice([0, 0, rng.randint(0, n)])
        side = [Role.SENDER, Role.RECEIVER]
        slices = max(1, -(-n // 64))
        return SessionPlan(
            session_id=SessionId(session_id),
            num_tokens=n,
            prefix_tokens=prefix,
            step_tokens=rng.randint(1, 128),
            step_s=rng.uniform(0.001, 0.02),
            sender_opens_at=rng.uniform(0.0, 0.05),
            receiver_opens_at=(
                rng.uniform(0.0, 0.05)
                if rng.random() < 0.9  # else decode memory came late, around the sender's deadline
                else rng.uniform(0.9, 1.02) * SIM_TIMINGS.sender_deadline_s
            ),
            cancel=(rng.choice(side), rng.uniform(0.0, 0.3)) if rng.random() < 0.15 else None,
            fail=(rng.choice(side), rng.uniform(0.0, 0.3)) if rng.random() < 0.08 else None,
            stall_after=rng.randrange(slices) if rng.random() < 0.05 else None,
        )


class SessionPair:
    """Two participants, one faulty link, one simulated clock; see the module docstring."""

    def __init__(
        self,
        *,
        seed: int,
        frames: FrameFaults,
        transfers: TransferFaults,
        timings: Timings = SIM_TIMINGS,
        secret: bytes | None = None,
        backend_s: tuple[float, float] = (0.001, 0.01),
    ) -> None:
        """``backend_s``: a simulated transfer takes uniform ``[lo, hi]`` seconds to end."""
        self.rng = random.Random(seed)
        self.codec = Codec(secret=secret)
        self.transfers = transfers
        self.backend_s = backend_s
        self.link = FaultyLink(frames, self.rng)
        profile = sim_profile()
        self.prefill = Participant(
            PREFILL, profile, incarnation=1, timings=timings, kv_role=Role.SENDER
        )
        self.decode = Participant(
            DECODE, profile, incarnation=1 << 20, timings=timings, kv_role=Role.RECEIVER
        )
        self.nodes = {PREFILL: self.prefill, DECODE: self.decode}
        reply, _ = self.prefill.on_hello(self.decode.hello(), 0.0)
        if not self.decode.on_hello_reply(reply, 0.0)[0].compatible:
            raise ProtocolError("simulated peers refused each other")
        self.now = 0.0
        self.plans: list[SessionPlan] = []
        self.admitted: Counter[tuple[PeerId, SessionId, int]] = Counter()
        self.released: Counter[tuple[PeerId, SessionId, int]] = Counter()
        self.finished: dict[tuple[PeerId, SessionId], list[SessionState]] = {}
        self.malformed = 0
        self.skipped_submits = 0
        self.release_via: Counter[tuple[Role, Ownership]] = Counter()
        self.release_log: list[tuple[float, PeerId, SessionId, int, Ownership]] = []
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    # -- scheduling ------------------------------------------------------------------------------
    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn))

    def add(self, plan: SessionPlan) -> None:
        self.plans.append(plan)
        self.at(plan.sender_opens_at, lambda: self._open_sender(plan))
        self.at(plan.receiver_opens_at, lambda: self._open_receiver(plan))
        for what, spec in (("cancel", plan.cancel), ("fail", plan.fail)):
            if spec is not None:
                role, when = spec
                self.at(when, partial(self._command, plan, role, what))

    def run(self, until: float) -> None:
        """Advance the simulation until ``until`` or until nothing is left to happen."""
        while True:
            times = [t for t in (
                self._heap[0][0] if self._heap else None,
                self.link.next_time(),
                self.prefill.next_deadline(),
                self.decode.next_deadline(),
            ) if t is not None]  # fmt: skip
            if not times or self._quiet():
                return
            t = min(times)
            if t > until:
                return
            self.now = max(self.now, t)
            for d in self.link.due(self.now):
                self._deliver(PeerId(d.src), PeerId(d.dst), d.frame)
            while self._heap and self._heap[0][0] <= self.now:
                heapq.heappop(self._heap)[2]()
            for node in (self.prefill, self.decode):
                self._route(node, node.tick(self.now))

    def _quiet(self) -> bool:
        return (
            not self._heap
            and not self.prefill.sessions
            and not self.decode.sessions
            and not len(self.link)
        )

    # -- the two applications ----------------------------------------------------------------------
    def _open_sender(self, plan: SessionPlan) -> None:
        sess, actions = self.prefill.open_sender(plan.session_id, DECODE, self.now)
        self._route(self.prefill, actions)
        if sess is None:
            return
        start, k = 0, 0
        while True:
            end = min(plan.num_tokens, start + plan.step_tokens)
            last = end >= plan.num_tokens
            if plan.stall_after is not None and k > plan.stall_after:
                break
            cmd = SubmitSlice(slice_id=SliceId(k), is_last=last, start=start, end=end)
            self.at(self.now + (k + 1) * plan.step_s, partial(self._submit, plan, cmd))
            if last:
                break
            start, k = end, k + 1

    def _submit(self, plan: SessionPlan, cmd: SubmitSlice) -> None:
        try:
            actions = self.prefill.send(plan.session_id, cmd, self.now)
        except ProtocolError:
            return  # retired (e.g. aborted by the receiver): the application keeps its memory
        self.admitted[(PREFILL, plan.session_id, int(cmd.slice_id))] += 1
        self._route(self.prefill, actions)

    def _open_receiver(self, plan: SessionPlan) -> None:
        start = StartTransfer(
            request_id=RequestId(f"req-{plan.session_id}"),
            dst_block_ids=tuple(range(-(-plan.num_tokens // 16))),
            prefix_tokens=plan.prefix_tokens,
            num_tokens=plan.num_tokens,
        )
        _, actions = self.decode.open_receiver(plan.session_id, PREFILL, start, self.now)
        self.admitted[(DECODE, plan.session_id, DESTINATION)] += 1
        self._route(self.decode, actions)

    def _command(self, plan: SessionPlan, role: Role, what: str) -> None:
        node = self.prefill if role is Role.SENDER else self.decode
        if node.session(plan.session_id) is None:
            return
        cmd = Cancel(reason="app cancel") if what == "cancel" else Fail(reason="app failure")
        self._route(node, node.send(plan.session_id, cmd, self.now))

    # -- the simulated backend -------------------------------------------------------------------
    def _backend(self, act: StartSubmit) -> None:
        sid, k, rng = act.session_id, act.slice_id, self.rng
        local = self.prefill.receive_local
        if not self.prefill.submittable(sid, k):
            self.skipped_submits += 1  # overtaken by a cancel: the slice was released unsubmitted
            return
        if act.start == act.end and rng.random() < 0.5:
            self._route(self.prefill, local(sid, SubmitSkipped(slice_id=k), self.now))
            return
        self._route(self.prefill, local(sid, SubmitStarted(slice_id=k), self.now))
        fate = self.transfers.pick(rng)
        if fate is Fate.SUBMIT_ERROR:
            fact = TransportInDoubt(slice_id=k, reason="submit raised")
            self._route(self.prefill, local(sid, fact, self.now))
            return
        self._route(self.prefill, local(sid, SubmitAccepted(slice_id=k), self.now))
        if fate is Fate.HANG:
            return
        evidence: object = TransportDone(slice_id=k)
        if fate is Fate.FAIL:
            evidence = TransportFailed(slice_id=k, reason="injected")
        elif fate is Fate.IN_DOUBT:
            evidence = TransportInDoubt(slice_id=k, reason="injected")
        when = self.now + rng.uniform(*self.backend_s)
        if fate is Fate.LATE:
            when += self.transfers.late_s
        self.at(when, lambda: self._route(self.prefill, local(sid, evidence, self.now)))

    # -- plumbing --------------------------------------------------------------------------------
    def _deliver(self, src: PeerId, dst: PeerId, frame: bytes) -> None:
        event = self.codec.decode(frame)
        if isinstance(event, MalformedMessage):
            self.malformed += 1
            return
        node = self.nodes[dst]
        self._route(node, node.on_event(src, event, self.now))

    def _route(self, node: Participant, actions: list[Action]) -> None:
        for act in actions:
            if isinstance(act, Transmit):
                self.link.send(self.now, node.peer_id, act.peer_id, self.codec.encode(act.event))
            elif isinstance(act, StartSubmit):
                self._backend(act)
            elif isinstance(act, Release):
                if act.via not in RELEASING:
                    raise ProtocolError(f"release through non-releasing state {act.via}")
                self.released[(node.peer_id, act.session_id, act.unit)] += 1
                self.release_via[(act.role, act.via)] += 1
                self.release_log.append((self.now, node.peer_id, act.session_id, act.unit, act.via))
            elif isinstance(act, Finished):
                self.finished.setdefault((node.peer_id, act.session_id), []).append(act.state)

    # -- the guarantees --------------------------------------------------------------------------
    def final_state(self, node: Participant, sid: SessionId) -> SessionState | None:
        got = self.finished.get((node.peer_id, sid))
        if got:
            return got[-1]
        tomb = node.tombstone(sid)
        return None if tomb is None else tomb.state

    def violations(self) -> list[str]:
        """Every broken guarantee, as text; empty when the run was correct."""
        bad: list[str] = []
        for node in (self.prefill, self.decode):
            if node.sessions:
                bad.append(f"{node.peer_id}: sessions left live {sorted(node.sessions)}")
            try:
                node.check_integrity()
            except ProtocolError as exc:
                bad.append(f"{node.peer_id}: integrity: {exc}")
        for key, states in self.finished.items():
            if len(states) != 1:
                bad.append(f"{key}: finished {len(states)} times {states}")
        for plan in self.plans:
            sid = plan.session_id
            s, r = self.final_state(self.prefill, sid), self.final_state(self.decode, sid)
            if r is None or not r.terminal:
                bad.append(f"{sid}: receiver not terminal ({r})")
            if s != r:
                bad.append(f"{sid}: sender {s} and receiver {r} disagree")
        for unit in set(self.admitted) | set(self.released):
            if self.admitted[unit] != 1 or self.released[unit] != 1:
                bad.append(
                    f"{unit}: admitted {self.admitted[unit]}, released {self.released[unit]}"
                )
        return bad

    @classmethod
    def random_run(
        cls,
        seed: int,
        *,
        frames: FrameFaults,
        transfers: TransferFaults,
        sessions: int = 3,
        secret: bytes | None = None,
    ) -> SessionPair:
        """A run of ``sessions`` random plans from ``seed``, simulated to completion."""
        pair = cls(seed=seed, frames=frames, transfers=transfers, secret=secret)
        for i in range(sessions):
            pair.add(SessionPlan.random(pair.rng, f"s{seed}-{i}"))
        pair.run(until=60.0)
        return pair
