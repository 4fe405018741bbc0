"""Peers of one participant: handshake judgments, leases, and the bounds of the table.

Only admitted peers are stored (an incompatible or stale ``Hello`` leaves no trace), at most
``capacity`` of them; a peer dead for ``retain_s`` is pruned, leaving only its incarnation floor.
Incarnations are monotonic: an older one is stale, never a restart. Time arrives as ``now``.
See docs/pd.md ("Peers and leases").
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvplane.ids import PeerId
from kvplane.pd.events import Hello
from kvplane.pd.handshake import PeerProfile, Verdict, check_compatible, compat_fingerprint
from kvplane.validators import require_size

DEFAULT_CAPACITY = 256
"""Peers one participant stores (live, or dead and not yet pruned)."""
DEFAULT_RETAIN_S = 60.0
"""How long a dead peer's record is kept (its sessions' late frames are judged against it)."""


class Standing(enum.Enum):
    """What a ``Hello`` is to the table: the first three may be admitted, the rest are refused."""

    NEW = "new"
    KNOWN = "known"
    """The incarnation of the stored record (a repeated handshake of the same process)."""
    RESTARTED = "restarted"
    """A newer incarnation of a live peer: the old process is gone."""
    STALE = "stale"
    """An older incarnation than one already seen (a replayed or zombie ``Hello``)."""
    FULL = "full"
    """A new peer while ``capacity`` peers are stored and none is dead."""
    INCOMPATIBLE = "incompatible"


_ADMISSIBLE = frozenset({Standing.NEW, Standing.KNOWN, Standing.RESTARTED})


@dataclass(frozen=True, slots=True)
class Judgment:
    """A ``Hello``'s verdict and standing; ``verdict.reasons`` say why when it is refused."""

    verdict: Verdict
    standing: Standing

    @property
    def admissible(self) -> bool:
        return self.standing in _ADMISSIBLE


@dataclass(slots=True)
class PeerRecord:
    """What we know about one admitted peer (mutable bookkeeping, owned by the table)."""

    peer_id: PeerId
    hello: Hello
    verdict: Verdict
    live: bool = False
    lease_s: float = 0.0
    lease_until: float = 0.0
    next_heartbeat: float = 0.0
    heartbeat_seq: int = 0
    dead_since: float | None = None


def _refused(standing: Standing, reason: str) -> Judgment:
    return Judgment(Verdict(compatible=False, reasons=(reason,)), standing)


class PeerTable:
    """Judgments and leases of the peers of one participant. ``sends``: True when it sends KV
    to its peers, False when it receives KV, None when either (no head range check).
    ``check_metadata``: the reason a peer's ``transport_metadata`` (opaque here; e.g. the
    pool advert's version) makes it incompatible, else None; judged before the profiles."""

    def __init__(
        self,
        profile: PeerProfile,
        heartbeat_s: float,
        *,
        sends: bool | None = None,
        capacity: int = DEFAULT_CAPACITY,
        retain_s: float = DEFAULT_RETAIN_S,
        check_metadata: Callable[[bytes], str | None] | None = None,
    ) -> None:
        require_size("PeerTable.capacity", capacity, min=1)
        self.profile = profile
        self.sends = sends
        self.check_metadata = check_metadata
        self.fingerprint = compat_fingerprint(profile)
        self.heartbeat_s = heartbeat_s
        self.capacity = capacity
        self.retain_s = retain_s
        self._peers: dict[PeerId, PeerRecord] = {}
        self._floors: OrderedDict[PeerId, int] = OrderedDict()  # pruned peers' incarnations
        self.cached_verdicts = 0
        self.pruned = 0

    def __contains__(self, peer_id: PeerId) -> bool:
        return peer_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def get(self, peer_id: PeerId) -> PeerRecord | None:
        return self._peers.get(peer_id)

    def is_live(self, peer_id: PeerId) -> bool:
        rec = self._peers.get(peer_id)
        return rec is not None and rec.live

    def live_peers(self) -> list[PeerId]:
        return sorted(p for p, rec in self._peers.items() if rec.live)

    def judge(self, hello: Hello) -> Judgment:
        """Our judgment of ``hello`` (see :class:`Standing`); changes only the cache counter."""
        peer_id = PeerId(hello.peer_id)
        rec = self._peers.get(peer_id)
        seen = rec.hello.incarnation if rec is not None else self._floors.get(peer_id, -1)
        if hello.incarnation < seen:
            return _refused(
                Standing.STALE,
                f"incarnation {hello.incarnation} of {peer_id} is older than {seen}, "
                "already seen: a stale or replayed Hello",
            )
        if (
            rec is not None
            and rec.hello.incarnation == hello.incarnation
            and rec.hello.fingerprint == hello.fingerprint
            and rec.hello.profile == hello.profile
        ):
            self.cached_verdicts += 1
            return Judgment(rec.verdict, Standing.KNOWN)
        if self.check_metadata is not None:
            why = self.check_metadata(hello.transport_metadata)
            if why is not None:
                return _refused(Standing.INCOMPATIBLE, why)
        verdict = check_compatible(self.profile, hello.profile, hello.fingerprint, sends=self.sends)
        if not verdict.compatible:
            return Judgment(verdict, Standing.INCOMPATIBLE)
        if rec is None:
            if len(self._peers) >= self.capacity and self._longest_dead() is None:
                return _refused(Standing.FULL, f"peer table full: {self.capacity} live peers")
            return Judgment(verdict, Standing.NEW)
        if rec.hello.incarnation == hello.incarnation:
            return Judgment(verdict, Standing.KNOWN)
        return Judgment(verdict, Standing.RESTARTED if rec.live else Standing.NEW)

    def admit(self, hello: Hello, judgment: Judgment, now: float) -> None:
        """Store ``hello``'s peer, live with a fresh lease. ``judgment`` must be this table's
        admissible judgment of ``hello`` with nothing admitted in between (a full table then
        has a dead record to evict)."""
        peer_id = PeerId(hello.peer_id)
        if peer_id not in self._peers and len(self._peers) >= self.capacity:
            dead = self._longest_dead()
            if dead is not None:
                self._prune(dead)
        rec = PeerRecord(peer_id, hello, judgment.verdict, live=True)
        rec.lease_s = hello.lease_ms / 1000.0
        rec.lease_until = now + rec.lease_s
        rec.next_heartbeat = now + self.heartbeat_s
        self._peers[peer_id] = rec

    def touch(self, peer_id: PeerId, now: float) -> bool:
        """Renew a live peer's lease on any frame from it; False for a peer that is not live."""
        rec = self._peers.get(peer_id)
        if rec is None or not rec.live:
            return False
        rec.lease_until = max(rec.lease_until, now + rec.lease_s)
        return True

    def expired(self, now: float) -> list[PeerId]:
        """Live peers whose lease ran out; they stop being live (a new handshake revives them).
        Peers dead for ``retain_s`` are pruned on the way."""
        out = []
        for peer_id, rec in sorted(self._peers.items()):
            if rec.live and now >= rec.lease_until:
                rec.live, rec.dead_since = False, now
                out.append(peer_id)
            elif rec.dead_since is not None and now >= rec.dead_since + self.retain_s:
                self._prune(peer_id)
        return out

    def lose(self, peer_id: PeerId, now: float) -> None:
        rec = self._peers.get(peer_id)
        if rec is not None and rec.live:
            rec.live, rec.dead_since = False, now

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
        times = []
        for r in self._peers.values():
            if r.live:
                times.append(min(r.lease_until, r.next_heartbeat))
            elif r.dead_since is not None:
                times.append(r.dead_since + self.retain_s)
        return min(times) if times else None

    def _longest_dead(self) -> PeerId | None:
        dead = [(r.dead_since, p) for p, r in self._peers.items() if r.dead_since is not None]
        return min(dead)[1] if dead else None

    def _prune(self, peer_id: PeerId) -> None:
        rec = self._peers.pop(peer_id)
        self._floors[peer_id] = rec.hello.incarnation
        self._floors.move_to_end(peer_id)
        while len(self._floors) > 16 * self.capacity:
            self._floors.popitem(last=False)
        self.pruned += 1
