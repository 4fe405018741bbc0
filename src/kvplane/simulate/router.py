"""The simulated router: which prefill and which decode worker a request goes to.

``round-robin`` cycles through the workers it believes alive; ``least-loaded`` picks the prefill
worker with the least estimated backlog and the decode worker with the fewest sequences;
``prefix-aware`` picks the prefill worker with the earliest estimated finish (backlog plus the
compute its cached prefix leaves), like Mooncake's conductor. The router learns of a death only
when the lease runs out, so it is told, never looks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvplane.errors import InvalidArgumentError
from kvplane.simulate.spec import ROUTERS


class Router:
    """Routing state: the policy, who is believed alive, the round-robin cursors."""

    def __init__(self, policy: str, prefill_workers: int, decode_workers: int) -> None:
        if policy not in ROUTERS:
            raise InvalidArgumentError(f"router policy must be one of {ROUTERS}, got {policy!r}")
        self.policy = policy
        self.alive = {"prefill": [True] * prefill_workers, "decode": [True] * decode_workers}
        self._next = {"prefill": 0, "decode": 0}

    def mark_dead(self, role: str, index: int) -> None:
        """The lease of worker ``index`` of ``role`` ran out: route nothing more to it."""
        self.alive[role][index] = False

    def _round_robin(self, role: str) -> int:
        alive = self.alive[role]
        i = self._next[role]
        while not alive[i % len(alive)]:
            i += 1
        self._next[role] = (i + 1) % len(alive)
        return i % len(alive)

    def _argmin(self, role: str, cost: Callable[[int], float]) -> int:
        """The live worker of least ``cost``, the lowest index on ties."""
        best, best_cost = -1, 0.0
        for i, up in enumerate(self.alive[role]):
            if up:
                c = cost(i)
                if best < 0 or c < best_cost:
                    best, best_cost = i, c
        return best

    def pick_prefill(self, backlog_s: Sequence[float], finish_s: Callable[[int], float]) -> int:
        """A prefill worker: ``backlog_s[i]`` is worker ``i``'s estimated queued work,
        ``finish_s(i)`` its estimated finish of this request (prefix-aware only)."""
        if self.policy == "round-robin":
            return self._round_robin("prefill")
        if self.policy == "least-loaded":
            return self._argmin("prefill", backlog_s.__getitem__)
        return self._argmin("prefill", finish_s)

    def pick_decode(self, sequences: Sequence[int]) -> int:
        """A decode worker: ``sequences[i]`` counts worker ``i``'s active, queued and incoming
        sequences."""
        if self.policy == "round-robin":
            return self._round_robin("decode")
        return self._argmin("decode", lambda i: float(sequences[i]))
