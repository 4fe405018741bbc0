"""Who may talk to an order socket: CURVE keys derived from the cluster secret, and the door.

The derivation, the socket options of both sides and the ZAP gate (only the client key derived
from the secret passes) live in ``kvplane.curve_auth``; every order server (a worker's, the
router's) admits connections through the PD endpoint's :class:`~kvplane.pd.door.ListenerDoor`
(ZAP, a 5 s zmq handshake, a cap with eviction of the oldest unproven connection). This module
names the order sockets' keys and what their door counts, in the order sockets' words. It must
not read or send orders: ``rpc`` does. See docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from kvplane.curve_auth import (
    HANDSHAKE_FAILED,
    ZAP_ENDPOINT,
    CurveKeys,
    ZapGate,
    derive_keys,
    secure_client,
)
from kvplane.pd.door import MAX_CONNECTIONS, ListenerDoor

__all__ = [
    "DOOR_KEYS", "HANDSHAKE_FAILED", "MAX_CONNECTIONS", "ZAP_ENDPOINT", "OrderKeys", "ZapGate",
    "order_door", "order_keys", "secure_client",
]  # fmt: skip

OrderKeys = CurveKeys
"""The order sockets' CURVE keypairs (one for servers, one for clients)."""
DOOR_KEYS = {
    "refused_handshakes": "refused_unauthenticated",
    "evicted_connections": "dropped_evicted",
    "refused_connections": "refused_over_cap",
}
"""The door's counter names as an order server counts them (the others keep theirs): a failed
handshake is refused unauthenticated, an unproven connection cut for a newcomer is dropped
(evicted), a newcomer cut because every held connection is proven is refused over the cap."""


def order_keys(secret: bytes) -> OrderKeys:
    """The order sockets' keys for cluster ``secret`` (non-empty bytes, else
    ``InvalidArgumentError``). Deterministic; distinct secrets give unrelated keys."""
    return derive_keys(secret, b"rpc", "the order sockets")


def order_door(
    ctx: zmq.Context[zmq.Socket[bytes]],
    *,
    secret: bytes | None,
    max_connections: int,
    name: str,
    count: Callable[[str, int], None],
) -> ListenerDoor:
    """The door of an order server in ``ctx``: CURVE with the order keys of ``secret`` (None:
    plain), at most ``max_connections`` inbound connections; each count goes to ``count``
    under its :data:`DOOR_KEYS` name. ``InvalidArgumentError`` for an empty secret or a cap
    below 1."""
    keys = None if secret is None else order_keys(secret)
    return ListenerDoor(
        ctx, keys=keys, max_connections=max_connections, name=f"{name}-door",
        count=lambda key, n: count(DOOR_KEYS.get(key, key), n),
    )  # fmt: skip
