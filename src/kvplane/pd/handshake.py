"""Handshake data: the layout as wire data and the pure compatibility check.

:class:`PeerProfile` (protocol version, model id, one :class:`LayoutInfo` per pool, the
:class:`Placement` of the peer in a TP × PP layout) is what two PD peers exchange;
:func:`check_compatible` lists every reason two profiles cannot exchange KV (pools paired by
what they hold, :func:`pool_pairs`, so KV cache groups on one side only still pair) and
:func:`compat_fingerprint` digests the must-match fields. No I/O; imports only L0, the head and
layer-id rules of ``kvplane.layout`` and the TP head rule of ``kvplane.transfer.resharding``.
The pool advert in ``Hello.transport_metadata`` is not judged here: the peer table takes a
judge for it (``Participant(check_metadata=...)``, ``pipeline.advert.advert_refusal``). See
docs/pd.md ("Handshake and compatibility").
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from kvplane.errors import InvalidArgumentError, LayoutError
from kvplane.layout import check_layer_ids, heads_cover
from kvplane.transfer.resharding import tp_head_range
from kvplane.validators import require_int

__all__ = [  # heads_cover: the one head-coverage rule lives with the layout (L2)
    "LAYOUT_KINDS", "PROTOCOL_VERSION", "LayoutInfo", "PeerProfile", "Placement", "Verdict",
    "check_compatible", "compat_fingerprint", "heads_cover", "pool_pairs", "uncovered_heads",
]  # fmt: skip

PROTOCOL_VERSION = 3
"""Version of the PD control protocol; frames of any other version are dropped and counted.
2: sequenced frames, nonces in the handshake and per-connection associations. 3: the
responder's ``Hello`` moves from its ``HelloReply`` to its ``HelloConfirm`` (after freshness)."""

LAYOUT_KINDS = ("mha", "gqa", "mla", "state")

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
_Ranks = Annotated[int, msgspec.Meta(ge=1, le=1 << 10)]


class LayoutInfo(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One KV pool's layout as wire data (primitives only).

    ``head_start``/``head_end`` is the half-open TP head range this rank holds out of
    ``total_heads``; ``compat_fingerprint``, ``fingerprint`` and ``geometry_fingerprint`` are the
    L2 layout digests (opaque bytes, may be empty when the caller has none).
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
    geometry_fingerprint: Annotated[bytes, msgspec.Meta(max_length=64)] = b""

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
        cls,
        desc: Mapping[str, Any],
        *,
        compat_fingerprint: bytes = b"",
        fingerprint: bytes = b"",
        geometry_fingerprint: bytes = b"",
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
                geometry_fingerprint=geometry_fingerprint,
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidArgumentError):
                raise
            raise InvalidArgumentError(
                f"layout description {dict(desc)!r} is unusable: {exc}"
            ) from exc


class Placement(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Which rank of a parallel layout a peer is: TP rank ``tp_rank`` of ``tp_size`` in
    pipeline stage ``pp_stage`` of ``pp_size``. The default, one process holding the whole
    model, makes every pairing of the peer 1:1; a larger layout lets a sender be one member of a
    receiver's gather (see :func:`check_compatible`)."""

    tp_rank: _Count = 0
    tp_size: _Ranks = 1
    pp_stage: _Count = 0
    pp_size: _Ranks = 1

    def __post_init__(self) -> None:
        require_int("Placement.tp_size", self.tp_size, min=1)
        require_int("Placement.pp_size", self.pp_size, min=1)
        require_int("Placement.tp_rank", self.tp_rank, min=0, max=self.tp_size - 1)
        require_int("Placement.pp_stage", self.pp_stage, min=0, max=self.pp_size - 1)


class PeerProfile(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """What a peer announces about itself for the compatibility check. With ``placement.tp_size
    > 1`` every pool must hold exactly its rank's heads (:func:`tp_head_range`)."""

    protocol_version: int
    model_id: _Name
    layouts: Annotated[tuple[LayoutInfo, ...], msgspec.Meta(min_length=1, max_length=16)]
    placement: Placement = msgspec.field(default_factory=Placement)

    def __post_init__(self) -> None:
        if not self.layouts:
            raise InvalidArgumentError("PeerProfile.layouts must hold at least one layout")
        at = self.placement
        if at.tp_size == 1:
            return
        for i, lay in enumerate(self.layouts):
            try:
                want = tp_head_range(lay.total_heads, at.tp_size, at.tp_rank)
            except LayoutError as exc:
                raise InvalidArgumentError(f"PeerProfile pool {i}: {exc}") from None
            if (lay.head_start, lay.head_end) != want:
                raise InvalidArgumentError(
                    f"PeerProfile pool {i}: TP rank {at.tp_rank} of {at.tp_size} holds heads "
                    f"{want} of {lay.total_heads}, not ({lay.head_start}, {lay.head_end})"
                )


_MUST_MATCH = (
    "kind",
    "dtype",
    "layer_ids",
    "total_heads",
    "head_dim",
    "rope_dim",
    "sliding_window",
)


_GEOMETRY = tuple(name for name in _MUST_MATCH if name != "layer_ids")
"""The must-match fields compared one by one; layer ids have their own rule (pipeline stages)."""


def compat_fingerprint(profile: PeerProfile) -> bytes:
    """16-byte digest of exactly the fields two peers must agree on (see module docstring)."""
    pools = [
        [getattr(lay, f) for f in _MUST_MATCH] + [lay.compat_fingerprint, lay.geometry_fingerprint]
        for lay in profile.layouts
    ]
    body = msgspec.msgpack.encode([profile.protocol_version, profile.model_id, pools])
    return hashlib.blake2b(b"kvplane-pd-compat\0" + body, digest_size=16).digest()


class Verdict(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Result of a compatibility check; ``reasons`` is empty exactly when compatible.
    ``member``: compatible only as one sender of the receiver's gather (its heads or layers are
    a part of the receiver's: the other ranks of its layout must fill the rest)."""

    compatible: bool
    reasons: tuple[str, ...] = ()
    member: bool = False


def _not_covered(label: str, held: tuple[int, int], needed: tuple[int, int]) -> str:
    return (
        f"{label} KV heads: the receiver's {needed} are not all in the sender's {held}: "
        "one sender cannot fill them"
    )


def _label(i: int, j: int) -> str:
    """How a reason names our pool ``i`` paired with their pool ``j``."""
    return f"pool {i}" if i == j else f"pool {i} (theirs {j})"


def pool_pairs(sender: PeerProfile, receiver: PeerProfile) -> tuple[tuple[int, int], ...]:
    """``(sender pool, receiver pool)`` index pairs that exchange KV, paired by what they hold
    (pure): every paged pool with every paged pool sharing a layer (one each: those two,
    whatever their layers), then the whole-only (``state``) pools in their order. A sender's
    pool may so feed several receiver pools (one per KV cache group) or a part of one."""
    return (*_paged_pairs(sender, receiver), *_whole_pairs(sender, receiver))


def _paged_pairs(sender: PeerProfile, receiver: PeerProfile) -> list[tuple[int, int]]:
    sp, rp = _kinds(sender)[0], _kinds(receiver)[0]
    if len(sp) == 1 and len(rp) == 1:
        return [(sp[0], rp[0])]
    return [
        (i, j) for i in sp for j in rp
        if set(sender.layouts[i].layer_ids) & set(receiver.layouts[j].layer_ids)
    ]  # fmt: skip


def _whole_pairs(sender: PeerProfile, receiver: PeerProfile) -> list[tuple[int, int]]:
    return list(zip(_kinds(sender)[1], _kinds(receiver)[1], strict=False))


def _kinds(profile: PeerProfile) -> tuple[list[int], list[int]]:
    """Indexes of ``profile``'s paged pools and of its whole-only (``state``) pools."""
    kinds = [lay.kind == "state" for lay in profile.layouts]
    return [i for i, w in enumerate(kinds) if not w], [i for i, w in enumerate(kinds) if w]


def uncovered_heads(sender: PeerProfile, receiver: PeerProfile) -> list[str]:
    """One reason per pool pair (:func:`pool_pairs`) whose receiver heads the sender's pool does
    not all hold (pure): the head rule of a 1:1 pairing."""
    reasons = []
    for i, j in pool_pairs(sender, receiver):
        s, r = sender.layouts[i], receiver.layouts[j]
        held, needed = (s.head_start, s.head_end), (r.head_start, r.head_end)
        if not heads_cover(held, needed):
            reasons.append(_not_covered(_label(i, j), held, needed))
    return reasons


def _head_judgment(
    sender: PeerProfile, receiver: PeerProfile, ours_sends: bool
) -> tuple[list[str], bool]:
    """``(reasons, member)`` of the TP heads: each receiver pool covered by the sender's (1:1,
    or one sender feeding several receivers), or, from a sender of finer TP than the receiver,
    the sender's heads all inside the receiver's (a gather member); else a reason."""
    finer = sender.placement.tp_size > receiver.placement.tp_size
    reasons, member = [], False
    for i, j in pool_pairs(sender, receiver):
        s, r = sender.layouts[i], receiver.layouts[j]
        label = _label(i, j) if ours_sends else _label(j, i)
        held, needed = (s.head_start, s.head_end), (r.head_start, r.head_end)
        if heads_cover(held, needed):
            continue
        if finer and heads_cover(needed, held):
            member = True
        elif sender.placement.tp_size > 1:
            at = sender.placement
            reasons.append(
                f"{label} KV heads: the sender's {held} (TP rank {at.tp_rank} of {at.tp_size}) "
                f"neither cover the receiver's {needed} nor lie inside them with a finer TP"
            )
        else:
            reasons.append(_not_covered(label, held, needed))
    return reasons, member


def _fingerprints_differ(label: str, which: str, ours: bytes, theirs: bytes) -> list[str]:
    """A reason when both sides carry the ``label`` pair's L2 ``which`` layout fingerprint and
    they differ; none when they agree or one side carries none."""
    if not ours or not theirs or ours == theirs:
        return []
    return [f"{label} layout {which} fingerprint: ours {ours.hex()}, theirs {theirs.hex()}"]


def _roles(
    ours: PeerProfile, theirs: PeerProfile, sends: bool | None
) -> tuple[PeerProfile, PeerProfile]:
    """``(sender, receiver)`` by ``sends``; unknown (None): ours sends only if ours alone is a
    pipeline stage (the layer rule then reads the stage as the sender)."""
    if sends is None:
        sends = ours.placement.pp_size > 1 and theirs.placement.pp_size == 1
    return (ours, theirs) if sends else (theirs, ours)


def check_compatible(
    ours: PeerProfile, theirs: PeerProfile, claimed: bytes, *, sends: bool | None = None
) -> Verdict:
    """Compare two profiles; ``claimed`` is the fingerprint the peer sent with its profile.
    ``sends``: True when we send KV to this peer, False when we receive it, None to leave the TP
    head ranges unchecked (the layer rule then takes a lone pipeline stage as the sender).

    The rule. Always: protocol, model and whole-only pool count equal. Pools pair by what they
    hold (:func:`pool_pairs`), and every pair agrees on every must-match field but
    ``layer_ids``, and on the L2 layout compat fingerprints where its layer ids are equal (else
    on the geometry fingerprints, the layer-free part). Layers: the paged pools of each side
    together hold the same layers, or (the sender a pipeline stage, ``placement.pp_size > 1``)
    the sender's a proper subset of the receiver's; a whole-only pair the same, pool by pool.
    Heads: the sender's cover the receiver's, or (the sender's TP finer than the receiver's) lie
    inside them. A sender that holds only part of the receiver's heads or layers is compatible
    as a gather member (``Verdict.member``); a 1:1 pairing (a sender of placement TP 1 × PP 1)
    must cover and match. Pure: no I/O, no state. Every mismatch is one line naming the field,
    the pool indexes and both values.
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
    whole = len(_kinds(ours)[1]), len(_kinds(theirs)[1])
    if whole[0] != whole[1]:
        reasons.append(f"whole-only pools: ours {whole[0]}, theirs {whole[1]}")
    sender, receiver = _roles(ours, theirs, sends)
    ours_sends = sender is ours
    for si, ri in pool_pairs(sender, receiver):
        i, j = (si, ri) if ours_sends else (ri, si)
        a, b, label = ours.layouts[i], theirs.layouts[j], _label(i, j)
        for name in _GEOMETRY:
            va, vb = getattr(a, name), getattr(b, name)
            if va != vb:
                reasons.append(f"{label} {name}: ours {va!r}, theirs {vb!r}")
        if a.layer_ids == b.layer_ids:
            reasons += _fingerprints_differ(label, "compat", a.compat_fingerprint,
                                            b.compat_fingerprint)  # fmt: skip
        else:
            reasons += _fingerprints_differ(label, "geometry", a.geometry_fingerprint,
                                            b.geometry_fingerprint)  # fmt: skip
    layer_reasons, member = _layer_judgment(sender, receiver, ours_sends)
    reasons += layer_reasons
    if sends is not None:
        head_reasons, by_heads = _head_judgment(sender, receiver, ours_sends)
        reasons += head_reasons
        member = member or by_heads
    return Verdict(compatible=not reasons, reasons=tuple(reasons), member=member and not reasons)


def _layer_judgment(
    sender: PeerProfile, receiver: PeerProfile, ours_sends: bool
) -> tuple[list[str], bool]:
    """``(reasons, member)`` of the layers: the sender's paged pools together hold the
    receiver's paged pools' layers, or (a pipeline stage) a proper part of them (a member); each
    whole-only pair the same. A reason names both sides' layers (ours first)."""
    stage = sender.placement.pp_size > 1
    tail = ": a pipeline stage's layers must be a part of the receiver's" if stage else ""
    sp, rp = _kinds(sender)[0], _kinds(receiver)[0]
    sets = [(sp, rp)] + [([i], [j]) for i, j in _whole_pairs(sender, receiver)]
    reasons, member = [], False
    for s_idx, r_idx in sets:
        held = sorted(x for i in s_idx for x in sender.layouts[i].layer_ids)
        needed = sorted(x for j in r_idx for x in receiver.layouts[j].layer_ids)
        if held == needed:
            continue
        if stage and set(held) < set(needed):
            member = True
            continue
        if len(s_idx) == 1 and len(r_idx) == 1:
            i, j = s_idx[0], r_idx[0]
            s, r = sender.layouts[i].layer_ids, receiver.layouts[j].layer_ids
            label = _label(i, j) if ours_sends else _label(j, i)
        else:
            s, r, label = tuple(held), tuple(needed), "paged pools"
        a, b = (s, r) if ours_sends else (r, s)
        reasons.append(f"{label} layer_ids: ours {a!r}, theirs {b!r}{tail}")
    return reasons, member
