"""Peers of one participant: handshake verdicts (cached per peer) and leases.

Time arrives as ``now``. See docs/pd.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.ids import PeerId
from kvplane.pd.events import Hello
from kvplane.pd.handshake import PeerProfile, Verdict, check_compatible, compat_fingerprint


@dataclass(slots=True)
class PeerRecord:
    """What we know about one peer (mutable bookkeeping, owned by the table)."""

    peer_id: PeerId
    hello: Hello
    verdict: Verdict
    live: bool = False
    lease_s: float = 0.0
    lease_until: float = 0.0
    next_heartbeat: float = 0.0
    heartbeat_seq: int = 0


class PeerTable:
    """Handshake verdicts and leases of the peers of one participant. ``sends``: True when it
    sends KV to its peers, False when it receives KV, None when either (no head range check)."""

    def __init__(
        self, profile: PeerProfile, heartbeat_s: float, *, sends: bool | None = None
    ) -> None:
        self.profile = profile
        self.sends = sends
        self.fingerprint = compat_fingerprint(profile)
        self.heartbeat_s = heartbeat_s
        self._peers: dict[PeerId, PeerRecord] = {}
        self.cached_verdicts = 0

    def __contains__(self, peer_id: PeerId) -> bool:
        return peer_id in self._peers

    def get(self, peer_id: PeerId) -> PeerRecord | None:
        return self._peers.get(peer_id)

    def is_live(self, peer_id: PeerId) -> bool:
        rec = self._peers.get(peer_id)
        return rec is not None and rec.live

    def live_peers(self) -> list[PeerId]:
        return sorted(p for p, rec in self._peers.items() if rec.live)

    def judge(self, hello: Hello) -> tuple[Verdict, bool]:
        """Our verdict on ``hello``; the bool is True for a new incarnation of a live peer."""
        peer_id = PeerId(hello.peer_id)
        rec = self._peers.get(peer_id)
        if (
            rec is not None
            and rec.hello.fingerprint == hello.fingerprint
            and rec.hello.incarnation == hello.incarnation
            and rec.hello.profile == hello.profile
        ):
            self.cached_verdicts += 1
            return rec.verdict, False
        verdict = check_compatible(self.profile, hello.profile, hello.fingerprint, sends=self.sends)
        restarted = rec is not None and rec.live and rec.hello.incarnation != hello.incarnation
        self._peers[peer_id] = PeerRecord(peer_id, hello, verdict)
        return verdict, restarted

    def admit(self, peer_id: PeerId, now: float) -> None:
        """Make a judged, compatible peer live with a fresh lease."""
        rec = self._peers[peer_id]
        if not rec.verdict.compatible:
            return
        rec.live = True
        rec.lease_s = rec.hello.lease_ms / 1000.0
        rec.lease_until = now + rec.lease_s
        rec.next_heartbeat = now + self.heartbeat_s

    def refuse(self, peer_id: PeerId, verdict: Verdict) -> None:
        """Record that the peer refused us (its verdict on our ``Hello``)."""
        rec = self._peers.get(peer_id)
        if rec is not None:
            rec.verdict = verdict
            rec.live = False

    def touch(self, peer_id: PeerId, now: float) -> bool:
        """Renew a live peer's lease on any frame from it; False for a peer that is not live."""
        rec = self._peers.get(peer_id)
        if rec is None or not rec.live:
            return False
        rec.lease_until = max(rec.lease_until, now + rec.lease_s)
        return True

    def expired(self, now: float) -> list[PeerId]:
        """Live peers whose lease ran out; they stop being live (a new handshake revives them)."""
        out = []
        for peer_id, rec in sorted(self._peers.items()):
            if rec.live and now >= rec.lease_until:
                rec.live = False
                out.append(peer_id)
        return out

    def lose(self, peer_id: PeerId) -> None:
        rec = self._peers.get(peer_id)
        if rec is not None:
            rec.live = False

    def heartbeats_due(self, now: float) -> list[tuple[PeerId, int]]:
        """``(peer, seq)`` for each live peer owed a heartbeat now; schedules the next one."""
        out = []
        for peer_id, rec in sorted(self._peers.items()):
            if rec.live and now >= rec.next_heartbeat:
                rec.heartbeat_seq += 1
                rec.next_heartbeat = now + self.heartbeat_s
                out.append((peer_id, rec.heartbeat_seq))
        return out

    def next_deadline(self) -> float | None:
        times = [min(r.lease_until, r.next_heartbeat) for r in self._peers.values() if r.live]
        return min(times) if times else None
