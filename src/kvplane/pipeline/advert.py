"""What a worker tells its PD peers about its memory: pools, their layouts and regions.

:class:`PoolAdvert` rides in ``Hello.transport_metadata``; decoding rebuilds every layout and
checks it against the profile. The paged pools come first (one per KV cache group of a model
serving several), then the whole-only pools (state, tail; a TP rank's state pool with its
``state_split``). :func:`split_destination` is the ``dst_block_ids`` convention. The first
field is the format's :data:`ADVERT_VERSION`, read alone before any other. See docs/pipeline.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from kvplane.errors import InvalidArgumentError, LayoutError, ProtocolError
from kvplane.ids import RegionId
from kvplane.layout import Axis, KVLayout, LayoutKind, dtype_from_name, dtype_name
from kvplane.pd.handshake import PeerProfile
from kvplane.state_split import MambaGeometry, StateSplit

ADVERT_VERSION = 2
"""Version of the pool advert's format, its first field, read before any other
(:func:`advert_version`): an advert of another version is refused in one line naming both. 1:
one paged pool, then the whole-only ones. 2: a state pool's ``state_split``; several paged pools
(one per KV cache group) leading the whole-only ones, and ``dst_block_ids`` split per group
(:func:`split_destination`)."""
_Small = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class _Head(msgspec.Struct, frozen=True, array_like=True):
    """The first field of an advert of any version (the fields after it are not read)."""

    version: int


class LayoutDesc(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A ``KVLayout`` as wire data (every field, so it rebuilds exactly)."""

    kind: str
    num_blocks: _Small
    block_size: _Small
    layer_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=4096)]
    total_heads: _Small
    head_start: _Small
    head_end: _Small
    head_dim: _Small
    rope_dim: _Small
    dtype: str
    order: Annotated[tuple[str, ...], msgspec.Meta(min_length=6, max_length=6)]
    sliding_window: int | None = None
    layer_windows: Annotated[tuple[int | None, ...], msgspec.Meta(max_length=4096)] = ()
    state_split: Annotated[tuple[_Small, ...], msgspec.Meta(max_length=7)] = ()
    """A state pool's ``KVLayout.state_split`` as ``(H, P, G, N, K, tp_size, tp_rank)`` (the
    Mamba geometry, then the TP rank); empty for none."""


class PoolDesc(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    region: _Small
    layout: LayoutDesc


class PoolAdvert(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """The runtime's ``Hello.transport_metadata``: transport metadata plus the pools."""

    version: int
    transport: str
    transport_metadata: bytes
    pools: Annotated[tuple[PoolDesc, ...], msgspec.Meta(min_length=1, max_length=16)]


@dataclass(frozen=True, slots=True)
class RemotePool:
    """A peer's pool as the planner needs it: its layout and the region that holds it."""

    layout: KVLayout
    region: RegionId


def describe(layout: KVLayout) -> LayoutDesc:
    lo, hi = layout.head_range
    return LayoutDesc(
        kind=layout.kind.value,
        num_blocks=layout.num_blocks,
        block_size=layout.block_size,
        layer_ids=layout.layer_ids,
        total_heads=layout.total_heads,
        head_start=lo,
        head_end=hi,
        head_dim=layout.head_dim,
        rope_dim=layout.rope_dim,
        dtype=dtype_name(layout.dtype),
        order=tuple(a.name for a in layout.order),
        sliding_window=layout.sliding_window,
        layer_windows=layout.layer_windows,
        state_split=_split_desc(layout.state_split),
    )


def _split_desc(split: StateSplit | None) -> tuple[int, ...]:
    if split is None:
        return ()
    g = split.geometry
    return (g.num_heads, g.head_dim, g.num_groups, g.state_size, g.conv_kernel,
            split.tp_size, split.tp_rank)  # fmt: skip


def _split_of(desc: tuple[int, ...]) -> StateSplit | None:
    """The :class:`StateSplit` of :func:`_split_desc`'s tuple (``LayoutError`` for a bad one)."""
    if not desc:
        return None
    if len(desc) != 7:
        raise LayoutError(f"advertised state_split {desc!r} is not (H, P, G, N, K, tp, rank)")
    return StateSplit(MambaGeometry(*desc[:5]), tp_size=desc[5], tp_rank=desc[6])


def rebuild(desc: LayoutDesc) -> KVLayout:
    """The ``KVLayout`` of a description (``LayoutError`` if it is not a valid layout)."""
    try:
        order = tuple(Axis[name] for name in desc.order)
        return KVLayout(
            kind=LayoutKind(desc.kind),
            num_blocks=desc.num_blocks,
            block_size=desc.block_size,
            layer_ids=tuple(desc.layer_ids),
            total_heads=desc.total_heads,
            head_dim=desc.head_dim,
            dtype=dtype_from_name(desc.dtype),
            head_range=(desc.head_start, desc.head_end),
            rope_dim=desc.rope_dim,
            order=order,
            sliding_window=desc.sliding_window,
            layer_windows=tuple(desc.layer_windows),
            state_split=_split_of(tuple(desc.state_split)),
        )
    except (KeyError, ValueError) as exc:
        if isinstance(exc, LayoutError):
            raise
        raise LayoutError(f"advertised layout {desc!r} is not a layout: {exc}") from None


def encode_advert(transport: str, metadata: bytes, pools: list[tuple[KVLayout, RegionId]]) -> bytes:
    advert = PoolAdvert(
        version=ADVERT_VERSION,
        transport=transport,
        transport_metadata=metadata,
        pools=tuple(PoolDesc(region=int(r), layout=describe(lay)) for lay, r in pools),
    )
    return msgspec.msgpack.encode(advert)


def advert_version(blob: bytes) -> int:
    """The version of a peer's advert, its first field, read alone: whatever follows it (any
    version's fields) is not decoded. ``ProtocolError`` when ``blob`` does not start so."""
    try:
        return msgspec.msgpack.decode(blob, type=_Head).version
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"peer's pool advert is malformed: {exc}") from None


def advert_refusal(blob: bytes) -> str | None:
    """Why a peer's advert cannot be read, from its version alone (another
    :data:`ADVERT_VERSION`, both named; or a malformed first field), else None. The handshake
    judges a ``Hello``'s ``transport_metadata`` with it (``Participant(check_metadata=...)``), so
    an older or newer peer is refused before any session."""
    try:
        version = advert_version(blob)
    except ProtocolError as exc:
        return str(exc)
    if version != ADVERT_VERSION:
        return (
            f"peer's pool advert is version {version}, this worker reads version "
            f"{ADVERT_VERSION}: run one kvplane release on both sides"
        )
    return None


def decode_advert(blob: bytes, profile: PeerProfile) -> tuple[PoolAdvert, list[RemotePool]]:
    """Read a peer's advert and check it against the profile it shook hands with.
    ``ProtocolError`` in one line: another :data:`ADVERT_VERSION` (both named, before any other
    field is read), a malformed advert, or one that disagrees with ``profile``."""
    why = advert_refusal(blob)
    if why is not None:
        raise ProtocolError(why)
    try:
        advert = msgspec.msgpack.decode(blob, type=PoolAdvert)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"peer's pool advert is malformed: {exc}") from None
    if len(advert.pools) != len(profile.layouts):
        raise ProtocolError(
            f"advert lists {len(advert.pools)} pools, the handshake profile {len(profile.layouts)}"
        )
    pools = []
    for i, (desc, info) in enumerate(zip(advert.pools, profile.layouts, strict=True)):
        layout = rebuild(desc.layout)
        if info.fingerprint and layout.fingerprint() != info.fingerprint:
            raise ProtocolError(f"advertised pool {i} does not match the handshake's layout")
        pools.append(RemotePool(layout, RegionId(desc.region)))
    return advert, pools


def split_destination(
    dst_block_ids: tuple[int, ...], pools: list[RemotePool], num_tokens: int
) -> list[tuple[int, ...]]:
    """Per pool, its share of a request's ``dst_block_ids``: each paged pool's (leading, one per
    KV cache group) ``ceil(num_tokens / block_size)`` block ids one pool after the other (a
    window group's dropped entries are its null block), then one slot per whole-only pool.
    ``ProtocolError`` for another count."""
    paged = num_paged([p.layout for p in pools])
    sizes = [-(-num_tokens // p.layout.block_size) for p in pools[:paged]]
    need = sum(sizes) + len(pools) - paged
    if len(dst_block_ids) != need:
        raise ProtocolError(
            f"{len(dst_block_ids)} destination ids for {num_tokens} tokens; the pools need {need}"
        )
    out, at = [], 0
    for size in sizes:
        out.append(tuple(dst_block_ids[at : at + size]))
        at += size
    out += [(dst_block_ids[at + i],) for i in range(len(pools) - paged)]
    return out


def num_paged(layouts: list[KVLayout]) -> int:
    """How many paged pools lead the pools of ``layouts`` (one per KV cache group);
    ``InvalidArgumentError`` for none, or for a paged pool after a whole-only one."""
    kinds = [lay.whole_only for lay in layouts]
    paged = kinds.index(True) if True in kinds else len(kinds)
    if paged == 0 or any(not w for w in kinds[paged:]):
        raise InvalidArgumentError("the pools must be paged KV pools, then whole-only ones")
    return paged
