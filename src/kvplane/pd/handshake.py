"""Handshake data: the layout as wire data and the pure compatibility check.

:class:`PeerProfile` (protocol version, model id, one :class:`LayoutInfo` per pool) is what two
PD peers exchange; :func:`check_compatible` lists every reason two profiles cannot exchange KV
(the must-match fields, TP heads by :func:`~kvplane.layout.heads_cover`) and
:func:`compat_fingerprint` digests the must-match fields. No I/O; imports only L0 and the head
and layer-id rules of ``kvplane.layout``. See docs/pd.md ("Handshake and compatibility").
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvplane.errors import InvalidArgumentError
from kvplane.layout import check_layer_ids, heads_cover
from kvplane.validators import require_int

__all__ = [  # heads_cover: the one head-coverage rule lives with the layout (L2)
    "LAYOUT_KINDS", "PROTOCOL_VERSION", "LayoutInfo", "PeerProfile", "Verdict",
    "check_compatible", "compat_fingerprint", "heads_cover", "uncovered_heads",
]  # fmt: skip

PROTOCOL_VERSION = 3
"""Version of the PD control protocol; frames of any other version are dropped and counted.
2: sequenced frames, nonces in the handshake and per-connection associations. 3: the
responder's ``Hello`` moves from its ``HelloReply`` to its ``HelloConfirm`` (after freshness)."""

LAYOUT_KINDS = ("mha", "gqa", "mla", "state")

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class LayoutInfo(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One KV pool's layout as wire data (primitives only).

    ``head_start``/``head_end`` is the half-open TP head range this rank holds out of
    ``total_heads``; ``compat_fingerprint`` and ``fingerprint`` are the L2 layout digests (opaque
    bytes, may be empty when the caller has none).
    """

    kind: str
    dtype: _Name
    layer_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=4096)]
    total_heads: _Count
    head_start: _Count
    head_end: _Count
    head_dim: _Count
    rope_dim: _Count = 0
    sliding_window: int | None = None
    block_size: _Count = 1
    compat_fingerprint: Annotated[bytes, msgspec.Meta(max_length=64)] = b""
    fingerprint: Annotated[bytes, msgspec.Meta(max_length=64)] = b""

    def __post_init__(self) -> None:
        owner = "LayoutInfo"
        if self.kind not in LAYOUT_KINDS:
            raise InvalidArgumentError(
                f"{owner}.kind must be one of {LAYOUT_KINDS}, got {self.kind!r}"
            )
        check_layer_ids(f"{owner}.layer_ids", self.layer_ids, error=InvalidArgumentError)
        require_int(f"{owner}.total_heads", self.total_heads, min=1)
        require_int(f"{owner}.head_dim", self.head_dim, min=1)
        require_int(f"{owner}.block_size", self.block_size, min=1)
        if not 0 <= self.head_start < self.head_end <= self.total_heads:
            raise InvalidArgumentError(
                f"{owner} head range [{self.head_start}, {self.head_end}) is not a non-empty "
                f"range inside total_heads={self.total_heads}"
            )
        if self.sliding_window is not None:
            require_int(f"{owner}.sliding_window", self.sliding_window, min=1)

    @classmethod
    def from_description(
        cls, desc: Mapping[str, Any], *, compat_fingerprint: bytes = b"", fingerprint: bytes = b""
    ) -> LayoutInfo:
        """Build from a plain description (the keys of ``KVLayout.describe()``)."""
        try:
            head_start, head_end = desc["head_range"]
            return cls(
                kind=str(desc["kind"]),
                dtype=str(desc["dtype"]),
                layer_ids=tuple(int(x) for x in desc["layer_ids"]),
                total_heads=int(desc["total_heads"]),
                head_start=int(head_start),
                head_end=int(head_end),
                head_dim=int(desc["head_dim"]),
                rope_dim=int(desc.get("rope_dim") or 0),
                sliding_window=desc.get("sliding_window"),
                block_size=int(desc["block_size"]),
                compat_fingerprint=compat_fingerprint,
                fingerprint=fingerprint,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidArgumentError):
                raise
            raise InvalidArgumentError(
                f"layout description {dict(desc)!r} is unusable: {exc}"
            ) from exc


class PeerProfile(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What a peer announces about itself for the compatibility check."""

    protocol_version: int
    model_id: _Name
    layouts: Annotated[tuple[LayoutInfo, ...], msgspec.Meta(min_length=1, max_length=16)]

    def __post_init__(self) -> None:
        if not self.layouts:
            raise InvalidArgumentError("PeerProfile.layouts must hold at least one layout")


_MUST_MATCH = (
    "kind",
    "dtype",
    "layer_ids",
    "total_heads",
    "head_dim",
    "rope_dim",
    "sliding_window",
)


def compat_fingerprint(profile: PeerProfile) -> bytes:
    """16-byte digest of exactly the fields two peers must agree on (see module docstring)."""
    pools = [
        [getattr(lay, f) for f in _MUST_MATCH] + [lay.compat_fingerprint] for lay in profile.layouts
    ]
    body = msgspec.msgpack.encode([profile.protocol_version, profile.model_id, pools])
    return hashlib.blake2b(b"kvplane-pd-compat\0" + body, digest_size=16).digest()


class Verdict(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Result of a compatibility check; ``reasons`` is empty exactly when compatible."""

    compatible: bool
    reasons: tuple[str, ...] = ()


def uncovered_heads(sender: PeerProfile, receiver: PeerProfile) -> list[str]:
    """One reason per pool whose receiver heads the sender's pool does not all hold (pure)."""
    reasons = []
    for i, (s, r) in enumerate(zip(sender.layouts, receiver.layouts, strict=False)):
        held, needed = (s.head_start, s.head_end), (r.head_start, r.head_end)
        if not heads_cover(held, needed):
            reasons.append(
                f"pool {i} KV heads: the receiver's {needed} are not all in the sender's "
                f"{held}: one sender cannot fill them"
            )
    return reasons


def check_compatible(
    ours: PeerProfile, theirs: PeerProfile, claimed: bytes, *, sends: bool | None = None
) -> Verdict:
    """Compare two profiles; ``claimed`` is the fingerprint the peer sent with its profile.
    ``sends``: True when we send KV to this peer (our heads must cover theirs), False when we
    receive it (theirs must cover ours), None to leave the TP head ranges unchecked.

    Pure: no I/O, no state. Every mismatch is named (field, pool index, both values).
    """
    reasons: list[str] = []
    if claimed != compat_fingerprint(theirs):
        reasons.append("peer's claimed compatibility fingerprint does not match its own profile")
    if theirs.protocol_version != ours.protocol_version:
        reasons.append(
            f"protocol_version: ours {ours.protocol_version}, theirs {theirs.protocol_version}"
        )
    if theirs.model_id != ours.model_id:
        reasons.append(f"model_id: ours {ours.model_id!r}, theirs {theirs.model_id!r}")
    if len(theirs.layouts) != len(ours.layouts):
        reasons.append(f"pools: ours {len(ours.layouts)}, theirs {len(theirs.layouts)}")
    for i, (a, b) in enumerate(zip(ours.layouts, theirs.layouts, strict=False)):
        for name in _MUST_MATCH:
            va, vb = getattr(a, name), getattr(b, name)
            if va != vb:
                reasons.append(f"pool {i} {name}: ours {va!r}, theirs {vb!r}")
        if (
            a.compat_fingerprint
            and b.compat_fingerprint
            and a.compat_fingerprint != b.compat_fingerprint
        ):
            reasons.append(
                f"pool {i} layout compat fingerprint: ours {a.compat_fingerprint.hex()}, "
                f"theirs {b.compat_fingerprint.hex()}"
            )
    if sends is not None:
        reasons += uncovered_heads(ours, theirs) if sends else uncovered_heads(theirs, ours)
    return Verdict(compatible=not reasons, reasons=tuple(reasons))
