"""Plan wire codec: exact round trips (then validate), and every malformed message refused with
MalformedMessageError — garbage, truncation, size limit, version, inconsistent columns."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from kvplane.chunks import ChunkSpec
from kvplane.errors import MalformedMessageError
from kvplane.ids import ChunkKey, RegionId, SliceId, TokenRange
from kvplane.layout import LAYER_MAJOR, KVLayout
from kvplane.transfer.codec import WIRE_VERSION, decode_plan, encode_plan
from kvplane.transfer.plan import TransferPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide

LAYOUT = KVLayout.gqa(
    num_blocks=8, block_size=4, num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float16,
    order=LAYER_MAJOR,
)  # fmt: skip
KEYS = tuple(ChunkKey(bytes([i]) * 32) for i in range(3))


def chunked_plan() -> TransferPlan:
    return plan_transfer(
        PlanSide(LAYOUT, np.array([7, 2, 5, 0, 1]), RegionId(3)),
        PlanSide(LAYOUT, np.array([4, 6, 3, 1, 0]), RegionId(9), offset=64),
        TokenRange(2, 19),
        layers=[1, 0],
        options=PlanOptions(
            grouping=OpGrouping.CHUNK, chunk_spec=ChunkSpec(4, 2), chunk_keys=KEYS,
            slice_id=SliceId(5),
        ),
    )  # fmt: skip


def raw(plan: TransferPlan) -> dict[str, object]:
    decoded = msgspec.msgpack.decode(encode_plan(plan))
    assert isinstance(decoded, dict)
    return decoded


def test_round_trip_is_exact_and_still_validates() -> None:
    plan = chunked_plan()
    assert len(plan.ops) == 3
    back = decode_plan(encode_plan(plan))
    assert back.equals(plan)
    assert [op.chunk_keys for op in back.ops] == [(KEYS[0],), (KEYS[1],), (KEYS[2],)]
    assert {op.slice_id for op in back.ops} == {5}
    assert back.coverage == plan.coverage and back.coverage.moments == plan.coverage.moments
    assert (back.src_region, back.dst_region) == (plan.src_region, plan.dst_region)
    back.validate({RegionId(3): LAYOUT.pool_bytes}, {RegionId(9): 64 + LAYOUT.pool_bytes})


def test_round_trip_of_an_empty_plan_and_a_big_one() -> None:
    empty = plan_transfer(
        PlanSide(LAYOUT, np.array([0]), RegionId(0)),
        PlanSide(LAYOUT, np.array([1]), RegionId(1)),
        TokenRange(3, 3),
    )
    assert decode_plan(encode_plan(empty)).equals(empty)
    big_layout = KVLayout.mla(num_blocks=512, block_size=4, num_layers=4, order=LAYER_MAJOR)
    rng = np.random.default_rng(3)
    big = plan_transfer(
        PlanSide(big_layout, rng.permutation(512)[:256], RegionId(0)),
        PlanSide(big_layout, rng.permutation(512)[:256], RegionId(1)),
        TokenRange(0, 1024),
    )
    data = encode_plan(big)
    assert big.num_descriptors > 900
    assert len(data) < big.num_descriptors * 6 * 8 + 1024  # columnar: ~48 bytes a descriptor
    assert decode_plan(data).equals(big)


def tamper(**changes: object) -> bytes:
    fields = raw(chunked_plan())
    fields.update(changes)
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"\x00\x01garbage", "undecodable"),
        (b"", "undecodable"),
        (encode_plan(chunked_plan())[:-3], "undecodable"),
        (tamper(version=WIRE_VERSION + 1), "wire version"),
        (tamper(tokens=[5, 2]), "invalid plan message"),
        (tamper(op_ends=b"\x00" * 7), "not int64s"),
        (tamper(op_ends=np.array([1, 2], dtype="<i8").tobytes()), "2 op boundaries for 3 ops"),
        (tamper(op_ends=np.array([5, 2, 9], dtype="<i8").tobytes()), "do not partition"),
        (tamper(coverage=[-1, [0] * 7]), "invalid plan message"),
        (tamper(coverage=[0, [0, 0]]), "tuple of 7"),
        (tamper(regions=[-1, 0]), "src_region must be an int >= 0"),
        (tamper(op_ends=b"", ops=[]), r"do not partition \d+ descriptors"),  # columns, no ops
        (tamper(layers="all"), "undecodable"),
        (tamper(extra=1), "undecodable"),
    ],
)
def test_malformed_messages_are_refused(data: bytes, match: str) -> None:
    with pytest.raises(MalformedMessageError, match=match):
        decode_plan(data)


def test_a_message_that_is_not_bytes_is_refused() -> None:
    with pytest.raises(MalformedMessageError, match="a plan message is bytes, got str"):
        decode_plan("plan")  # type: ignore[arg-type]


def test_inconsistent_descriptor_columns_are_refused() -> None:
    fields = raw(chunked_plan())
    src = list(fields["src"])  # type: ignore[call-overload]
    lengths = np.frombuffer(src[2], dtype="<i8").copy()
    lengths[0] = -lengths[0]
    src[2] = lengths.tobytes()
    with pytest.raises(MalformedMessageError, match="lengths > 0"):
        decode_plan(msgspec.msgpack.encode({**fields, "src": src}))
    dst = list(fields["dst"])  # type: ignore[call-overload]
    dst[2] = dst[2][:-8]
    with pytest.raises(MalformedMessageError, match="differ in length"):
        decode_plan(msgspec.msgpack.encode({**fields, "dst": dst}))


def test_size_limit() -> None:
    data = encode_plan(chunked_plan())
    assert decode_plan(data, max_bytes=len(data)).num_descriptors > 0
    with pytest.raises(MalformedMessageError, match="exceeds"):
        decode_plan(data, max_bytes=len(data) - 1)


def test_size_limit_counts_bytes_of_a_memoryview_of_any_format() -> None:
    """A memoryview of 8-byte items has len() = bytes / 8; the limit is on bytes."""
    data = encode_plan(chunked_plan())
    padded = data + b"\x00" * (-len(data) % 8)
    wide = memoryview(padded).cast("Q")
    assert len(wide) < len(data) <= wide.nbytes
    with pytest.raises(MalformedMessageError, match=f"plan message of {wide.nbytes} bytes"):
        decode_plan(wide, max_bytes=len(data))


def test_a_memoryview_decodes_like_its_bytes_even_when_not_contiguous() -> None:
    data = encode_plan(chunked_plan())
    assert decode_plan(memoryview(data)).equals(decode_plan(data))
    spread = bytearray(2 * len(data))
    spread[::2] = data
    strided = memoryview(spread)[::2]
    assert not strided.c_contiguous and strided.nbytes == len(data)
    assert decode_plan(strided, max_bytes=len(data)).equals(decode_plan(data))
