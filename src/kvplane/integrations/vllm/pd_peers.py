"""A decode rank's handshakes with prefill engines' PD endpoints, for :mod:`.pd_worker`.

Owns :class:`PrefillPeers`: one live peer per prefill endpoint address, dialled afresh when its
handshake is gone (an attempt that gets no answer is made again on a new connection until the
connect timeout), and telling the prefill ranks this decode rank answers for that a refused
request will never be asked for (:func:`~.pd_ranks.abandon_peers`). Runs on the worker's dial
thread; opens no session and touches no KV.
"""

from __future__ import annotations

import logging
import time

from kvplane.errors import KVPlaneError, TransferTimeoutError
from kvplane.ids import PeerId
from kvplane.integrations.vllm.messages import RecvOp
from kvplane.integrations.vllm.pd_ranks import abandon_peers
from kvplane.integrations.vllm.tp import TPShard
from kvplane.pd.endpoint import Endpoint
from kvplane.validators import require_finite_positive

log = logging.getLogger(__name__)

CONNECT_ATTEMPT_S = 5.0
"""How long one handshake attempt with a prefill engine waits for its answers before it is
made again on a fresh connection."""


class PrefillPeers:
    """See the module docstring. ``endpoint``: this decode rank's PD endpoint (started);
    ``connect_timeout_s`` bounds one :meth:`connect`; ``shard``: this rank. Used from one
    thread at a time."""

    def __init__(self, endpoint: Endpoint, connect_timeout_s: float, shard: TPShard) -> None:
        self.endpoint = endpoint
        self.connect_timeout_s = require_finite_positive("connect_timeout_s", connect_timeout_s)
        self.shard = shard
        self._peers: dict[str, PeerId] = {}

    def peer(self, address: str) -> PeerId:
        """The live peer at ``address``, handshaking afresh when there is none (:meth:`connect`
        and its errors)."""
        peer = self._peers.get(address)
        if peer is None or not self._live(peer):
            peer = self._peers[address] = self.connect(address)
        return peer

    def connect(self, address: str) -> PeerId:
        """Handshake with the prefill engine at ``address``: a dial that got no answer within
        :data:`CONNECT_ATTEMPT_S` is dropped and made afresh (a new connection and nonce) until
        ``connect_timeout_s``; a refusal is final. Each timed-out attempt is logged with the
        endpoint's handshake counters."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return self.endpoint.connect(address, min(CONNECT_ATTEMPT_S, max(left, 0.001)))
            except TransferTimeoutError as exc:
                counters = {
                    k: v for k, v in self.endpoint.snapshot().items()
                    if v and any(w in k for w in ("handshake", "drop", "frames", "connection"))
                }  # fmt: skip
                log.warning("kvplane PD: %s (%s)", exc, counters)
                if left <= CONNECT_ATTEMPT_S:
                    raise

    def abandon(self, op: RecvOp) -> list[str]:
        """Tell every prefill rank this decode rank answers for that ``op``'s refused request
        (``op.abandon``, the reason) will never be asked for, so each frees its blocks now; the
        addresses that could not be told (logged), which free them at their own
        ``pd_pull_timeout_s``. One rank that cannot be told does not stop the others."""
        untold = []
        for address, sid in abandon_peers(op, self.shard):
            try:
                self.endpoint.abandon(sid, self.peer(address), op.abandon)
            except (KVPlaneError, OSError) as exc:
                log.warning("kvplane PD: cannot tell %s that %s is not wanted: %s", address,
                            op.req_id, exc)  # fmt: skip
                untold.append(address)
        return untold

    def _live(self, peer: PeerId) -> bool:
        participant = self.endpoint.participant
        return bool(self.endpoint.call(lambda: participant.peers.is_live(peer)))
