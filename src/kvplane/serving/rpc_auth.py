"""Mutual authentication of the order sockets: zmq CURVE keys derived from the cluster secret.

The derivation, the socket options of both sides and the ZAP gate (only the client key derived
from the secret passes) live in ``kvplane.curve_auth``; this module names the order sockets'
purpose and keeps their names. It must not read or send orders: ``rpc`` does. See
docs/serving.md.
"""

from __future__ import annotations

from kvplane.curve_auth import (
    HANDSHAKE_FAILED,
    ZAP_ENDPOINT,
    CurveKeys,
    ZapGate,
    derive_keys,
    secure_client,
)

__all__ = [
    "HANDSHAKE_FAILED", "ZAP_ENDPOINT", "OrderKeys", "ZapGate", "order_keys", "secure_client",
]  # fmt: skip

OrderKeys = CurveKeys
"""The order sockets' CURVE keypairs (one for servers, one for clients)."""


def order_keys(secret: bytes) -> OrderKeys:
    """The order sockets' keys for cluster ``secret`` (non-empty bytes, else
    ``InvalidArgumentError``). Deterministic; distinct secrets give unrelated keys."""
    return derive_keys(secret, b"rpc", "the order sockets")
