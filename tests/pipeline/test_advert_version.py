"""The pool advert's version: read first, alone, so a peer of another release is refused in one
line naming both versions (never "malformed"): at the handshake (a worker's participant judges
the advert with ``advert_refusal``), and again when the prefill side links the peer."""

from __future__ import annotations

from typing import Any, cast

import msgspec
import pytest

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, SessionId, SliceId
from kvplane.pd.actions import StartSubmit
from kvplane.pd.events import HelloConfirm, HelloReply, TransferRequest
from kvplane.pd.participant import Participant
from kvplane.pd.states import Role
from kvplane.pipeline.advert import (
    ADVERT_VERSION,
    advert_refusal,
    advert_version,
    decode_advert,
)
from kvplane.pipeline.driver_records import SliceSource
from kvplane.pipeline.slice_planner import SlicePlanner
from kvplane.serving.pools import WorkerPools
from kvplane.serving.producers.synthetic import SyntheticModel, SyntheticSpec
from kvplane.transfer import OpGrouping
from kvplane.transports.local import LocalTransport

SPEC = SyntheticSpec(kind="gqa", num_layers=2, kv_heads=4, head_dim=8, state_dim=12)
LAYOUT_V1 = ["gqa", 10, 4, [0, 1], 4, 0, 4, 8, 0, "bfloat16",
             ["BLOCK", "LAYER", "COMP", "TOKEN", "HEAD", "DIM"], None]  # fmt: skip
"""A version 1 ``LayoutDesc`` as a peer of that release wrote it (no windows, no split)."""


@pytest.fixture
def transport() -> LocalTransport:
    return LocalTransport()


@pytest.fixture
def pools(transport: LocalTransport) -> WorkerPools:
    return WorkerPools(SyntheticModel(SPEC), transport, num_blocks=10, block_size=4,
                       num_slots=3)  # fmt: skip


def older() -> bytes:
    """A version 1 advert, hand-made: one paged pool of the version 1 layout fields."""
    return msgspec.msgpack.encode([1, "local", b"", [[7, LAYOUT_V1]]])


def newer() -> bytes:
    """A version 3 advert of a format this release cannot parse (pools as a map)."""
    return msgspec.msgpack.encode([3, "local", b"", {"groups": [[7, {"kind": "gqa"}]]}, 5])


def test_the_version_is_two_and_read_before_any_field(pools: WorkerPools) -> None:
    assert ADVERT_VERSION == 2
    assert advert_version(pools.advert()) == 2
    assert (advert_version(older()), advert_version(newer())) == (1, 3)
    for blob, version in ((older(), 1), (newer(), 3)):
        with pytest.raises(ProtocolError) as got:
            decode_advert(blob, pools.profile())
        assert str(got.value) == (
            f"peer's pool advert is version {version}, this worker reads version 2: "
            "run one kvplane release on both sides"
        )
    for bad in (b"\x93junk", msgspec.msgpack.encode(["two", "local"]), b""):
        with pytest.raises(ProtocolError, match=r"^peer's pool advert is malformed: "):
            advert_version(bad)
    _, remote = decode_advert(pools.advert(), pools.profile())  # the current one still reads
    assert [p.layout for p in remote] == pools.layouts
    assert advert_refusal(pools.advert()) is None
    assert advert_refusal(b"") is not None and advert_refusal(b"").startswith(
        "peer's pool advert is malformed: "
    )


def test_the_handshake_refuses_a_peer_of_another_advert_version(pools: WorkerPools) -> None:
    """Both sides judge the other's advert before its profile: the older peer is refused with
    the one line (the peer table unchanged), and refuses our newer advert the same way."""
    line = ("peer's pool advert is version {}, this worker reads version 2: "
            "run one kvplane release on both sides")  # fmt: skip
    prefill = Participant(PeerId("prefill"), pools.profile(), incarnation=1,
                          transport="local", transport_metadata=pools.advert(),
                          kv_role=Role.SENDER, check_metadata=advert_refusal)  # fmt: skip
    for blob, version in ((older(), 1), (newer(), 3)):
        decode = Participant(PeerId("decode"), pools.profile(), incarnation=1,
                             transport="local", transport_metadata=blob,
                             kv_role=Role.RECEIVER)  # fmt: skip
        reply, actions = prefill.on_hello(decode.hello(), 0.0)
        assert isinstance(reply, HelloReply) and not reply.accepted and actions == []
        assert reply.reasons == (line.format(version),)
        assert prefill.peers.get(PeerId("decode")) is None
    same = Participant(PeerId("decode"), pools.profile(), incarnation=2, transport="local",
                       transport_metadata=pools.advert(), kv_role=Role.RECEIVER)  # fmt: skip
    reply, _ = prefill.on_hello(same.hello(), 0.0)
    assert isinstance(reply, HelloConfirm)  # this release's advert is admitted
    assert prefill.counters["incompatible_peer"] == 2


class InlineEndpoint:
    """The slice planner's view of an endpoint: runs its calls inline on ``participant``."""

    def __init__(self, participant: Participant) -> None:
        self.participant = participant

    def call(self, fn: Any) -> Any:
        return fn()


def test_a_peer_of_another_advert_version_fails_its_first_slice_in_one_line(
    pools: WorkerPools, transport: LocalTransport
) -> None:
    """Without ``check_metadata`` the handshake judges the profile only and admits the older
    peer; the prefill side still refuses it when it links the peer for a slice: the line the
    driver sends the peer as its session's failure reason (``slice N cannot be planned: ...``)."""
    prefill = Participant(PeerId("prefill"), pools.profile(), incarnation=1,
                          transport="local", transport_metadata=pools.advert(),
                          kv_role=Role.SENDER)  # fmt: skip
    decode = Participant(PeerId("decode"), pools.profile(), incarnation=1,
                         transport="local", transport_metadata=older(),
                         kv_role=Role.RECEIVER)  # fmt: skip
    reply, _ = prefill.on_hello(decode.hello(), 0.0)
    assert isinstance(reply, HelloConfirm)  # admitted: the advert is not the profile's
    peer = prefill.peers.get(PeerId("decode"))
    assert peer is not None and peer.live and prefill.peers.cached_verdicts == 0
    counted: list[str] = []
    source = SliceSource("r", ())
    planner = SlicePlanner(cast(Any, InlineEndpoint(prefill)), transport, lambda _: source,
                           grouping=OpGrouping.WHOLE, count=counted.append)  # fmt: skip
    request = TransferRequest(
        session_id=SessionId("s"), epoch=1, request_id="r", dst_block_ids=(0, 1, 0, 0),
        prefix_tokens=0, num_tokens=8,
    )  # fmt: skip
    act = StartSubmit(session_id=SessionId("s"), peer_id=PeerId("decode"), slice_id=SliceId(0),
                      is_last=True, start=0, end=8, request=request)  # fmt: skip
    with pytest.raises(ProtocolError) as got:
        planner.planned(act, source)
    assert str(got.value) == (
        "peer's pool advert is version 1, this worker reads version 2: "
        "run one kvplane release on both sides"
    )
    assert planner.sessions == {} and counted == []  # nothing planned, nothing linked
    assert prefill.sessions == {}
    pools.check_idle()
