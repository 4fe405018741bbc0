"""The slice driver's planner: hints wait for their request's memory (bounded) and go with
their session; plans made ahead are used only when they match the ``StartSubmit``; a peer
without a handshake is named."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from kvplane.errors import ProtocolError
from kvplane.ids import PeerId, RegionId, SessionId, SliceId, TokenRange
from kvplane.layout import KVLayout
from kvplane.pd.actions import DestinationKnown, StartSubmit
from kvplane.pd.events import TransferRequest
from kvplane.pipeline.advert import RemotePool
from kvplane.pipeline.driver_records import PeerLink, PlannedSession, SliceSource
from kvplane.pipeline.shares import shares
from kvplane.pipeline.slice_planner import MAX_WAITING, SlicePlanner
from kvplane.pipeline.slicing import LocalPool
from kvplane.transfer import OpGrouping
from kvplane.transfer.resharding import Parallelism

REQ = TransferRequest(
    session_id=SessionId("s"),
    epoch=1,
    request_id="r",
    dst_block_ids=(0, 1),
    prefix_tokens=0,
    num_tokens=32,
)


class NoPeers:
    """An endpoint that runs calls inline and has shaken hands with nobody."""

    participant = SimpleNamespace(peers={})

    def call(self, fn: Any) -> Any:
        return fn()


def planner(sources: dict[SessionId, SliceSource]) -> tuple[SlicePlanner, list[str]]:
    counted: list[str] = []
    p = SlicePlanner(
        cast(Any, NoPeers()), cast(Any, SimpleNamespace(name="tcp")), sources.get,
        grouping=OpGrouping.WHOLE, count=counted.append,
    )  # fmt: skip
    return p, counted


def hint(sid: str) -> DestinationKnown:
    return DestinationKnown(session_id=SessionId(sid), peer_id=PeerId("d"), request=REQ)


def start(sid: str, slice_id: int, lo: int, hi: int, last: bool) -> StartSubmit:
    return StartSubmit(
        session_id=SessionId(sid), peer_id=PeerId("d"), slice_id=SliceId(slice_id),
        is_last=last, start=lo, end=hi, request=REQ,
    )  # fmt: skip


def test_hints_wait_for_memory_bounded_and_go_with_their_session() -> None:
    sources: dict[SessionId, SliceSource] = {}
    p, counted = planner(sources)
    p.adopt([hint(f"s{i}") for i in range(MAX_WAITING + 3)], [])
    assert len(p.waiting) == MAX_WAITING and SessionId("s0") not in p.waiting  # oldest dropped
    p.forget(SessionId("s5"))
    assert SessionId("s5") not in p.waiting
    sources[SessionId("s9")] = SliceSource("r", ())
    p.adopt([], [SessionId("s9")])  # retried: no handshake with its peer, so not adopted
    assert SessionId("s9") not in p.waiting and not p.sessions and not counted
    with pytest.raises(ProtocolError, match="no handshake with peer d"):
        p.planned(start("s9", 0, 0, 16, False), sources[SessionId("s9")])


def test_a_plan_made_ahead_is_used_only_when_it_matches() -> None:
    schedule = ((TokenRange(0, 16), False), (TokenRange(16, 32), True))
    source = SliceSource("r", (), schedule)
    p, counted = planner({SessionId("s"): source})
    made = object()
    sess = PlannedSession(cast(Any, None), REQ, {0: cast(Any, made), 1: cast(Any, made)})
    assert p.ahead(start("s", 0, 0, 16, False), source, sess) is made
    assert sess.begun == 1 and counted == ["plans_ready"]
    assert p.ahead(start("s", 1, 16, 30, True), source, sess) is None  # asks another range
    assert sess.plans == {} and sess.begun == 1  # the stale plan is dropped


def test_a_source_with_a_share_plans_only_its_heads_and_leaves_the_tail_to_the_lead() -> None:
    model = KVLayout.gqa(num_blocks=4, block_size=16, num_layers=2, kv_heads=4, head_dim=4,
                         dtype=torch.float16)  # fmt: skip
    tail = KVLayout.state(num_slots=4, num_layers=1, state_dim=32, dtype=torch.uint8)
    prefill, decode = (Parallelism.pipeline(tp_size=tp, num_layers=2, block_size=16)
                       for tp in (2, 1))  # fmt: skip
    remote = (RemotePool(decode.rank_layout(model, 0, 0, 4), RegionId(7)),
              RemotePool(tail, RegionId(8)))  # fmt: skip
    link = PeerLink(1, cast(Any, None), remote)
    request = TransferRequest(session_id="s/0.1", epoch=1, request_id="r",
                              dst_block_ids=(0, 1, 2), prefix_tokens=0, num_tokens=32)  # fmt: skip
    got = {}
    for sender, share in shares(model, prefill, decode, 0).items():
        pools = (LocalPool(prefill.rank_layout(model, 0, sender.tp_rank, 4), RegionId(1), (2, 3)),
                 LocalPool(tail, RegionId(2), (1,)))  # fmt: skip
        source = SliceSource("r", pools, share=share)
        p, _ = planner({SessionId("s/0.1"): source})
        planned = p._plan(source, link, request, TokenRange(0, 32), slice_id=0, is_last=True)
        got[sender.tp_rank] = (planned.num_bytes, planned.dst_block_sizes)
    kv_half = 32 * 2 * 2 * 4 * 2 * 2  # tokens × K,V × 2 of 4 heads × dim × fp16 × layers
    assert got == {0: (kv_half + 32, (16, 1)), 1: (kv_half, (16,))}
