"""PlanRun: per-op progress, the in-flight window, and every way a run ends — DONE, FAILED,
IN_DOUBT, refused submits, poll errors, deadlines (transport- and executor-side), caller cancel —
driven deterministically (fake clock) over a scripted, byte-moving transport."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError, RemoteDisconnectError, TransportError
from kvplane.ids import TokenRange
from kvplane.layout import LAYER_MAJOR, KVLayout
from kvplane.transfer.executor import PlanExecutor
from kvplane.transfer.plan import TransferOp, TransferPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.progress import OpProgress, OpState, PlanOutcome
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide
from kvplane.transfer.run import CANCEL_GRACE_S
from kvplane.transports.base import FailureKind, Peer

LAYOUT = KVLayout.gqa(
    num_blocks=6, block_size=4, num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float16,
    order=LAYER_MAJOR,
)  # fmt: skip


@dataclass
class Setup:
    plan: TransferPlan
    peer: Peer
    src: torch.Tensor
    dst: torch.Tensor
    initial_dst: torch.Tensor
    expected_dst: torch.Tensor


def setup(scripted, kvref) -> Setup:
    """Four per-chunk ops (one block each), four descriptors per op ((layer, comp) runs)."""
    src, s_pool = kvref.region_with_pool(LAYOUT, 0, seed=1)
    dst, _ = kvref.region_with_pool(LAYOUT, 0, seed=2)
    s_reg, d_reg = scripted.register(src), scripted.register(dst)
    s_ids, d_ids = [5, 1, 3, 0], [2, 4, 0, 1]
    plan = plan_transfer(
        PlanSide(LAYOUT, np.array(s_ids), s_reg.region_id),
        PlanSide(LAYOUT, np.array(d_ids), d_reg.region_id),
        TokenRange(0, 16),
        options=PlanOptions(grouping=OpGrouping.CHUNK, chunk_spec=ChunkSpec(4)),
    )
    assert [op.num_descriptors for op in plan.ops] == [4, 4, 4, 4]
    expected = dst.clone()
    exp_pool = expected[: LAYOUT.pool_bytes].view(LAYOUT.dtype).view(LAYOUT.shape)
    kvref.scatter((LAYOUT, s_pool, s_ids), (LAYOUT, exp_pool, d_ids), plan.tokens, plan.layers)
    peer = scripted.connect(scripted.metadata())
    return Setup(plan, peer, src, dst, dst.clone(), expected)


def op_dst_bytes(region: torch.Tensor, op: TransferOp) -> list[bytes]:
    return [
        bytes(region[o : o + n].tolist())
        for o, n in zip(op.dst.offsets.tolist(), op.dst.lengths.tolist(), strict=True)
    ]


def executor(scripted, clock, max_inflight: int = 8) -> PlanExecutor:
    return PlanExecutor(scripted, max_inflight=max_inflight, clock=clock, sleep=clock.sleep)


def test_all_ops_done_with_per_op_progress(scripted, clock, kvref) -> None:
    s = setup(scripted, kvref)
    events: list[OpProgress] = []
    result = executor(scripted, clock).execute(
        s.plan, s.peer, local_regions=scripted.lengths(), on_progress=events.append
    )
    assert result.ok and result.outcome is PlanOutcome.DONE
    assert (result.failure, result.reason) == (None, "")
    assert result.bytes_done == result.num_bytes == s.plan.num_bytes == 16 * 2 * 32
    assert torch.equal(s.dst, s.expected_dst)
    per_op = 16 * 2 * 32 // 4
    for i in range(4):
        mine = [(e.state, e.bytes_done) for e in events if e.op_index == i]
        # one descriptor lands per poll: 0, 1/4, 2/4, 3/4, then DONE
        assert mine == [
            (OpState.PENDING, 0),
            (OpState.PENDING, per_op // 4),
            (OpState.PENDING, per_op // 2),
            (OpState.PENDING, 3 * per_op // 4),
            (OpState.DONE, per_op),
        ]
    assert [p.state for p in result.ops] == [OpState.DONE] * 4
    assert scripted.max_inflight_seen == 4
    assert scripted.cancelled == []


def test_a_done_run_ended_when_its_last_op_did(scripted, clock, kvref) -> None:
    s = setup(scripted, kvref)
    ends: list[float] = []

    def seen(e: OpProgress) -> None:
        if e.state is OpState.DONE:
            ends.append(clock.now)  # the scripted transport stamps a batch's end with its clock

    result = executor(scripted, clock).execute(
        s.plan, s.peer, local_regions=scripted.lengths(), on_progress=seen
    )
    assert result.ok and len(ends) == 4
    assert result.ended_at == max(ends)
    assert result == replace(result, ended_at=None)  # a measurement, not part of the outcome


def test_in_flight_window(scripted, clock, kvref) -> None:
    s = setup(scripted, kvref)
    result = executor(scripted, clock, max_inflight=2).execute(
        s.plan, s.peer, local_regions=scripted.lengths()
    )
    assert result.ok and scripted.max_inflight_seen == 2
    assert torch.equal(s.dst, s.expected_dst)


def test_a_failed_op_stops_the_run(scripted, clock, kvref, fault) -> None:
    s = setup(scripted, kvref)
    scripted.faults[1] = fault("fail", after=1, failure=FailureKind.REMOTE_DISCONNECT)
    result = executor(scripted, clock, max_inflight=1).execute(
        s.plan, s.peer, local_regions=scripted.lengths()
    )
    assert result.outcome is PlanOutcome.FAILED and not result.ok
    assert result.failure is FailureKind.REMOTE_DISCONNECT
    assert result.reason == "op 1 ended failed: scripted fail"
    assert result.ended_at is None  # only a DONE run has an end time
    assert [p.state for p in result.ops] == [
        OpState.DONE, OpState.FAILED, OpState.NOT_SUBMITTED, OpState.NOT_SUBMITTED,
    ]  # fmt: skip
    assert result.ops[1].bytes_done == 64  # one 64-byte descriptor landed before the failure
    assert result.ops[1].failure is FailureKind.REMOTE_DISCONNECT
    assert result.bytes_done == 256 + 64
    assert len(scripted.batches) == 2  # nothing submitted after the failure
    for op in s.plan.ops[2:]:
        assert op_dst_bytes(s.dst, op) == op_dst_bytes(s.initial_dst, op)
    assert op_dst_bytes(s.dst, s.plan.ops[0]) == op_dst_bytes(s.expected_dst, s.plan.ops[0])


def test_in_doubt_cancels_the_others(scripted, clock, kvref, fault) -> None:
    s = setup(scripted, kvref)
    scripted.faults[2] = fault("in_doubt", after=1)
    result = executor(scripted, clock).execute(s.plan, s.peer, local_regions=scripted.lengths())
    assert result.outcome is PlanOutcome.IN_DOUBT
    assert (result.failure, result.reason) == (
        FailureKind.BACKEND_ERROR,
        "op 2 ended in_doubt: scripted in_doubt",
    )
    # all four were in flight with bytes landed when op 2 turned IN_DOUBT: the others are
    # cancelled part-way, so they are in doubt too
    assert [p.state for p in result.ops] == [OpState.IN_DOUBT] * 4
    assert scripted.cancelled == [0, 1, 3]
    assert [p.failure for p in result.ops] == [
        FailureKind.CANCELLED,
        FailureKind.CANCELLED,
        FailureKind.BACKEND_ERROR,
        FailureKind.CANCELLED,
    ]


def test_in_doubt_after_earlier_ops_landed(scripted, clock, kvref, fault) -> None:
    s = setup(scripted, kvref)
    scripted.faults[2] = fault("in_doubt", after=3)
    result = executor(scripted, clock, max_inflight=1).execute(
        s.plan, s.peer, local_regions=scripted.lengths()
    )
    assert result.outcome is PlanOutcome.IN_DOUBT
    states = [OpState.DONE, OpState.DONE, OpState.IN_DOUBT, OpState.NOT_SUBMITTED]
    assert [p.state for p in result.ops] == states
    assert result.ops[2].bytes_done == 3 * 64 and scripted.cancelled == []


def test_refused_submit_moves_nothing(scripted, clock, kvref, fault) -> None:
    s = setup(scripted, kvref)
    scripted.faults[0] = fault("refuse", exc=RemoteDisconnectError("peer went away"))
    result = executor(scripted, clock).execute(s.plan, s.peer, local_regions=scripted.lengths())
    assert result.outcome is PlanOutcome.FAILED
    assert result.failure is FailureKind.REMOTE_DISCONNECT
    assert result.reason == "op 0 was refused: peer went away"
    assert result.ops[0] == OpProgress(
        0, OpState.NOT_SUBMITTED, 0, 256, FailureKind.REMOTE_DISCONNECT, "peer went away"
    )
    assert {p.state for p in result.ops} == {OpState.NOT_SUBMITTED}
    assert scripted.batches == {} and torch.equal(s.dst, s.initial_dst)


def test_poll_error_is_in_doubt(scripted, clock, kvref, fault) -> None:
    s = setup(scripted, kvref)
    scripted.faults[0] = fault("poll_error", exc=TransportError("lost track"))
    result = executor(scripted, clock, max_inflight=1).execute(
        s.plan, s.peer, local_regions=scripted.lengths()
    )
    assert result.outcome is PlanOutcome.IN_DOUBT
    assert result.ops[0].state is OpState.IN_DOUBT
    assert result.ops[0].reason == "poll failed: lost track"
    assert result.failure is FailureKind.BACKEND_ERROR


def test_deadline_cancels_a_stalled_batch(scripted, clock, kvref, fault) -> None:
    s = setup(scripted, kvref)
    scripted.faults[0] = fault("stall")
    start = clock.now
    result = executor(scripted, clock, max_inflight=1).execute(
        s.plan, s.peer, local_regions=scripted.lengths(), deadline_s=0.5
    )
    assert result.outcome is PlanOutcome.FAILED
    assert result.failure is FailureKind.TIMEOUT
    assert result.reason.startswith("plan deadline passed after 0.5")
    assert result.ops[0].state is OpState.FAILED and scripted.cancelled == [0]
    assert [p.state for p in result.ops[1:]] == [OpState.NOT_SUBMITTED] * 3
    assert 0.5 <= clock.now - start < 0.5 + 0.01


def test_a_batch_that_ignores_cancel_ends_in_doubt_after_the_grace(
    scripted, clock, kvref, fault
) -> None:
    s = setup(scripted, kvref)
    scripted.faults[0] = fault("hang")
    start = clock.now
    result = executor(scripted, clock, max_inflight=1).execute(
        s.plan, s.peer, local_regions=scripted.lengths(), deadline_s=0.5
    )
    assert result.outcome is PlanOutcome.IN_DOUBT and result.failure is FailureKind.TIMEOUT
    assert result.ops[0].state is OpState.IN_DOUBT
    assert "cannot tell whether its bytes landed" in result.ops[0].reason
    assert 0.5 + CANCEL_GRACE_S <= clock.now - start < 0.5 + CANCEL_GRACE_S + 0.01


def test_give_up_on_an_ignored_cancel_counts_from_the_stop(scripted, clock, kvref, fault) -> None:
    s = setup(scripted, kvref)
    scripted.faults[0] = fault("fail", after=2)
    scripted.faults[1] = fault("hang")
    start = clock.now
    result = executor(scripted, clock, max_inflight=2).execute(
        s.plan, s.peer, local_regions=scripted.lengths(), deadline_s=30.0
    )
    assert [p.state for p in result.ops[:2]] == [OpState.FAILED, OpState.IN_DOUBT]
    assert result.outcome is PlanOutcome.IN_DOUBT and result.failure is FailureKind.BACKEND_ERROR
    assert CANCEL_GRACE_S <= clock.now - start < CANCEL_GRACE_S + 0.01  # not the 30 s deadline


def test_transport_side_deadline(scripted, clock, kvref, fault) -> None:
    """The transport's own deadline fires when the caller's step loop is late."""
    s = setup(scripted, kvref)
    scripted.faults[0] = fault("stall")
    run = executor(scripted, clock, max_inflight=1).start(
        s.plan, s.peer, local_regions=scripted.lengths(), deadline_s=2.0
    )
    run.step()
    scripted.batches[0].deadline = clock.now + 0.25  # a transport with a tighter own deadline
    clock.sleep(1.0)
    events = run.step()
    assert events[0].state is OpState.FAILED and events[0].failure is FailureKind.TIMEOUT
    assert run.done and run.result().failure is FailureKind.TIMEOUT
    assert run.result().reason == "op 0 ended failed: deadline"


def test_caller_cancel(scripted, clock, kvref) -> None:
    s = setup(scripted, kvref)
    run = executor(scripted, clock, max_inflight=2).start(
        s.plan, s.peer, local_regions=scripted.lengths()
    )
    first = run.step()  # submits two ops, then polls each once (one descriptor lands)
    assert [(e.op_index, e.state, e.bytes_done) for e in first] == [
        (0, OpState.PENDING, 0),
        (1, OpState.PENDING, 0),
        (0, OpState.PENDING, 64),
        (1, OpState.PENDING, 64),
    ]
    with pytest.raises(InvalidArgumentError, match="not finished"):
        run.result()
    assert not run.done and run.progress()[2].state is OpState.WAITING
    run.cancel("user abort")
    run.step()
    assert run.done
    result = run.result()
    assert result.outcome is PlanOutcome.IN_DOUBT  # both had landed a descriptor
    assert (result.failure, result.reason) == (FailureKind.CANCELLED, "user abort")
    states = [OpState.IN_DOUBT, OpState.IN_DOUBT, OpState.NOT_SUBMITTED, OpState.NOT_SUBMITTED]
    assert [p.state for p in result.ops] == states
    assert run.step() == []
