"""Wire form of a :class:`TransferPlan`: versioned, size-limited msgpack via msgspec (no pickle).

The descriptors of every op are concatenated into six little-endian int64 byte strings (region,
offset and length for each side) plus the op boundaries, so a plan of a hundred thousand
descriptors encodes as a few large ``bin`` fields rather than a hundred thousand objects. Decoding
checks the size limit and version, decodes into typed structs (msgspec rejects any missing,
extra-typed or malformed field) and rebuilds the frozen plan, whose constructors re-check pairing
and annotations. Every failure is a ``MalformedMessageError`` naming the problem. A decoded plan is
still only *well formed*: call :meth:`TransferPlan.validate` against the regions before running it.
"""

from __future__ import annotations

import msgspec
import numpy as np

from kvplane.errors import KVPlaneError, MalformedMessageError
from kvplane.ids import ChunkKey, RegionId, SliceId, TokenRange
from kvplane.transfer.coverage import Coverage
from kvplane.transfer.op import TransferOp
from kvplane.transfer.plan import TransferPlan
from kvplane.transports.base import DescriptorList, Int64Array

WIRE_VERSION = 2
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
"""Largest encoded plan :func:`decode_plan` accepts unless told otherwise (256 MiB)."""

_LE_INT64 = np.dtype("<i8")


class _WireOp(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    tokens: tuple[int, int]
    layers: list[int]
    chunk_keys: list[bytes]
    slice_id: int | None


class _WirePlan(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    tokens: tuple[int, int]
    layers: list[int]
    coverage: tuple[int, tuple[int, ...]]
    regions: tuple[int, int]
    src_fingerprint: bytes
    dst_fingerprint: bytes
    op_ends: bytes
    src: tuple[bytes, bytes, bytes]
    dst: tuple[bytes, bytes, bytes]
    ops: list[_WireOp]


def _pack(values: Int64Array) -> bytes:
    return values.astype(_LE_INT64, copy=False).tobytes()


def _unpack(raw: bytes, what: str) -> Int64Array:
    if len(raw) % 8:
        raise MalformedMessageError(f"plan field {what} has {len(raw)} bytes, not int64s")
    return np.frombuffer(raw, dtype=_LE_INT64).astype(np.int64)


def encode_plan(plan: TransferPlan) -> bytes:
    """The plan as one msgpack message."""
    src, dst = plan.src_descriptors(), plan.dst_descriptors()
    ends = np.cumsum([op.num_descriptors for op in plan.ops], dtype=np.int64)
    c = plan.coverage
    wire = _WirePlan(
        version=WIRE_VERSION,
        tokens=(plan.tokens.start, plan.tokens.end),
        layers=list(plan.layers),
        coverage=(c.num_bytes, c.moments),
        regions=(plan.src_region, plan.dst_region),
        src_fingerprint=plan.src_fingerprint,
        dst_fingerprint=plan.dst_fingerprint,
        op_ends=_pack(ends),
        src=(_pack(src.regions), _pack(src.offsets), _pack(src.lengths)),
        dst=(_pack(dst.regions), _pack(dst.offsets), _pack(dst.lengths)),
        ops=[
            _WireOp(
                tokens=(op.tokens.start, op.tokens.end),
                layers=list(op.layers),
                chunk_keys=[bytes(k) for k in op.chunk_keys],
                slice_id=op.slice_id,
            )
            for op in plan.ops
        ],
    )
    return msgspec.msgpack.encode(wire)


def decode_plan(
    data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> TransferPlan:
    """Rebuild a plan from :func:`encode_plan` output (``MalformedMessageError`` if it is not).

    ``data`` is ``bytes``, a ``bytearray`` or a ``memoryview`` of any item format and layout;
    ``max_bytes`` bounds its size in bytes (``memoryview.nbytes``, not its item count), checked
    before anything is decoded or copied."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise MalformedMessageError(f"a plan message is bytes, got {type(data).__name__}")
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    if size > max_bytes:
        raise MalformedMessageError(f"plan message of {size} bytes exceeds {max_bytes}")
    if isinstance(data, memoryview) and not data.c_contiguous:
        data = data.tobytes()  # msgspec reads contiguous buffers only (bounded: size is checked)
    try:
        wire = msgspec.msgpack.decode(data, type=_WirePlan)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise MalformedMessageError(f"undecodable plan message: {exc}") from None
    if wire.version != WIRE_VERSION:
        raise MalformedMessageError(f"plan wire version {wire.version}, expected {WIRE_VERSION}")
    try:
        return _rebuild(wire)
    except KVPlaneError as exc:
        raise MalformedMessageError(f"invalid plan message: {exc}") from None


def _descriptors(cols: tuple[bytes, bytes, bytes], side: str) -> DescriptorList:
    return DescriptorList(
        _unpack(cols[0], f"{side}.regions"),
        _unpack(cols[1], f"{side}.offsets"),
        _unpack(cols[2], f"{side}.lengths"),
    )


def _rebuild(wire: _WirePlan) -> TransferPlan:
    src = _descriptors(wire.src, "src")
    dst = _descriptors(wire.dst, "dst")
    ends = _unpack(wire.op_ends, "op_ends")
    if len(ends) != len(wire.ops):
        raise MalformedMessageError(f"{len(ends)} op boundaries for {len(wire.ops)} ops")
    starts = np.concatenate(([0], ends[:-1])) if len(ends) else ends
    covered = int(ends[-1]) if len(ends) else 0  # no ops: no descriptors either
    if np.any(ends < starts) or covered != len(src):
        raise MalformedMessageError(f"op boundaries do not partition {len(src)} descriptors")
    if len(src) != len(dst):
        raise MalformedMessageError(f"{len(src)} source but {len(dst)} destination descriptors")
    ops = []
    for w, lo, hi in zip(wire.ops, starts.tolist(), ends.tolist(), strict=True):
        ops.append(
            TransferOp(
                src=DescriptorList(src.regions[lo:hi], src.offsets[lo:hi], src.lengths[lo:hi]),
                dst=DescriptorList(dst.regions[lo:hi], dst.offsets[lo:hi], dst.lengths[lo:hi]),
                tokens=TokenRange(*w.tokens),
                layers=tuple(w.layers),
                chunk_keys=tuple(ChunkKey(k) for k in w.chunk_keys),
                slice_id=None if w.slice_id is None else SliceId(w.slice_id),
            )
        )
    return TransferPlan(
        ops=tuple(ops),
        tokens=TokenRange(*wire.tokens),
        layers=tuple(wire.layers),
        coverage=Coverage(wire.coverage[0], tuple(wire.coverage[1])),
        src_region=RegionId(wire.regions[0]),
        dst_region=RegionId(wire.regions[1]),
        src_fingerprint=wire.src_fingerprint,
        dst_fingerprint=wire.dst_fingerprint,
    )
