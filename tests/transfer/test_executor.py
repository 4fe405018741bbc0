"""PlanExecutor: the plan is validated against local and peer regions before any byte moves;
notifications follow all bytes; READ and WRITE; argument checks; injected metrics; and plans run
over the real LocalTransport (loopback, and between two transports of one fabric)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError, PlanError
from kvplane.ids import RegionId, TokenRange
from kvplane.layout import HEAD_MAJOR, KVLayout
from kvplane.metrics import MetricsRegistry
from kvplane.transfer.coverage import Coverage
from kvplane.transfer.executor import PlanExecutor, PlanRunAbortedError
from kvplane.transfer.plan import TransferPlan, joint_ops
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.progress import OpProgress, OpState, PlanOutcome
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide
from kvplane.transfer.run import PlanRun
from kvplane.transports.base import Peer, XferKind, XferState
from kvplane.transports.descriptors import concat_descriptors
from kvplane.transports.local import LocalFabric, LocalTransport

SRC_LAYOUT = KVLayout.gqa(
    num_blocks=6, block_size=4, num_layers=2, kv_heads=4, head_dim=4, dtype=torch.bfloat16
)
DST_LAYOUT = KVLayout.gqa(
    num_blocks=5, block_size=8, num_layers=2, kv_heads=4, head_dim=4, dtype=torch.bfloat16,
    head_range=(2, 4), order=HEAD_MAJOR,
)  # fmt: skip
S_IDS, D_IDS = [4, 0, 2, 5], [3, 1]


def build(transport, kvref, grouping: OpGrouping = OpGrouping.CHUNK):
    """Register two pools on ``transport``; plan 13 tokens across block sizes and TP ranges."""
    src, s_pool = kvref.region_with_pool(SRC_LAYOUT, 0, seed=3)
    dst, _ = kvref.region_with_pool(DST_LAYOUT, 0, seed=4)
    s_reg, d_reg = transport.register(src), transport.register(dst)
    plan = plan_transfer(
        PlanSide(SRC_LAYOUT, np.array(S_IDS), s_reg.region_id),
        PlanSide(DST_LAYOUT, np.array(D_IDS), d_reg.region_id),
        TokenRange(2, 15),
        options=PlanOptions(grouping=grouping, chunk_spec=ChunkSpec(4)),
    )
    expected = dst.clone()
    exp_pool = expected[: DST_LAYOUT.pool_bytes].view(DST_LAYOUT.dtype).view(DST_LAYOUT.shape)
    kvref.scatter((SRC_LAYOUT, s_pool, S_IDS), (DST_LAYOUT, exp_pool, D_IDS), plan.tokens,
                  plan.layers)  # fmt: skip
    return plan, src, dst, expected, (s_reg.region_id, d_reg.region_id)


def test_invalid_plan_is_refused_before_any_byte_moves(scripted, clock, kvref) -> None:
    plan, _, dst, _, (_, d_id) = build(scripted, kvref)
    before = dst.clone()
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    small_peer = Peer(scripted.connect(b"").peer_id, {d_id: 64})
    with pytest.raises(PlanError, match=r"destination descriptor .* runs past the region end 64"):
        ex.execute(plan, small_peer, local_regions=scripted.lengths())
    with pytest.raises(PlanError, match=r"source descriptors name unknown region\(s\)"):
        ex.execute(plan, scripted.connect(b""), local_regions={d_id: 10**6})
    assert scripted.batches == {} and torch.equal(dst, before)


def _run_with_a_broken_callback(
    scripted: Any, clock: Any, kvref: Any, fault: Any, match: str
) -> PlanRunAbortedError:
    """Execute a LAYER plan whose every op has ``fault`` and whose progress callback raises:
    the error ``execute`` raises (matching ``match``), caused by the callback's."""
    plan, _, _, _, _ = build(scripted, kvref, OpGrouping.LAYER)
    scripted.faults = {i: fault for i in range(len(plan.ops))}

    def broken(event: OpProgress) -> None:
        raise RuntimeError("bug in the callback")

    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    with pytest.raises(PlanRunAbortedError, match=match) as info:
        ex.execute(
            plan, scripted.connect(b""), local_regions=scripted.lengths(), on_progress=broken
        )
    assert isinstance(info.value.__cause__, RuntimeError)
    return info.value


def test_a_raising_progress_callback_cancels_the_run_before_it_propagates(
    scripted, clock, kvref, fault
) -> None:
    """The caller never gets the run, so execute itself must end every batch it started."""
    err = _run_with_a_broken_callback(scripted, clock, kvref, fault("stall"), "ended failed")
    assert str(err.__cause__) == "bug in the callback"
    started = sorted(scripted.batches)
    assert started and scripted.cancelled == started
    assert all(b.poll.state is not XferState.PENDING for b in scripted.batches.values())
    result = err.result
    assert result.outcome is PlanOutcome.FAILED
    assert {op.state for op in result.ops} <= {OpState.FAILED, OpState.NOT_SUBMITTED}


def test_a_raising_callback_over_a_batch_that_ignores_cancel_reports_the_run_in_doubt(
    scripted, clock, kvref, fault
) -> None:
    """The run gives up on a batch still PENDING CANCEL_GRACE_S after the cancel; the caller
    must learn that (IN_DOUBT: the transport may still write the memory), not just the bug."""
    err = _run_with_a_broken_callback(scripted, clock, kvref, fault("hang"), "ended in_doubt")
    result = err.result
    assert result.outcome is PlanOutcome.IN_DOUBT
    hung = [b for b in scripted.batches.values() if b.poll.state is XferState.PENDING]
    assert hung  # the transport still holds them: exactly what IN_DOUBT tells the caller
    in_doubt = [op for op in result.ops if op.state is OpState.IN_DOUBT]
    assert len(in_doubt) == len(hung)


def test_an_interrupt_in_the_callback_ends_the_run_and_propagates_unchanged(
    scripted, clock, kvref, fault
) -> None:
    plan, _, _, _, _ = build(scripted, kvref, OpGrouping.LAYER)
    scripted.faults = {i: fault("stall") for i in range(len(plan.ops))}

    def interrupted(event: OpProgress) -> None:
        raise KeyboardInterrupt

    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    with pytest.raises(KeyboardInterrupt):
        ex.execute(
            plan, scripted.connect(b""), local_regions=scripted.lengths(), on_progress=interrupted
        )
    assert scripted.batches
    assert all(b.poll.state is not XferState.PENDING for b in scripted.batches.values())


def test_an_error_of_the_run_itself_is_not_reported_as_the_callbacks(
    scripted, clock, kvref, monkeypatch
) -> None:
    """Only the callback is wrapped: a failing step propagates as it is, with no cancel loop
    that would step the broken run again."""
    plan, _, _, _, _ = build(scripted, kvref, OpGrouping.LAYER)
    calls = []

    def broken_step(self: PlanRun) -> list[OpProgress]:
        calls.append(self)
        raise RuntimeError("bug in step")

    monkeypatch.setattr(PlanRun, "step", broken_step)
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    with pytest.raises(RuntimeError, match="bug in step"):
        ex.execute(plan, scripted.connect(b""), local_regions=scripted.lengths(),
                   on_progress=lambda event: None)  # fmt: skip
    assert len(calls) == 1


def test_a_region_longer_than_any_descriptor_can_reach_is_no_error(scripted, clock, kvref) -> None:
    plan, _, _, _, (s_id, d_id) = build(scripted, kvref)
    plan.validate({s_id: 1 << 63}, {d_id: (1 << 64) + 5})  # clamped, never cast into int64


def test_write_and_read_move_the_same_bytes(scripted, clock, kvref) -> None:
    plan, _, dst, expected, (_, d_id) = build(scripted, kvref)
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    peer = scripted.connect(scripted.metadata())
    # READ: the plan's sources are the peer's regions, destinations local
    result = ex.execute(plan, peer, local_regions={d_id: int(dst.numel())}, kind=XferKind.READ)
    assert result.ok and torch.equal(dst, expected)
    with pytest.raises(PlanError, match="unknown region"):
        ex.execute(plan, Peer(peer.peer_id, {d_id: 10**6}), local_regions={d_id: 10**6},
                   kind=XferKind.READ)  # fmt: skip


def test_notify_follows_every_byte(scripted, clock, kvref) -> None:
    plan, _, dst, expected, _ = build(scripted, kvref)
    assert len(plan.ops) == 4
    events: list[OpProgress] = []
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    result = ex.execute(
        plan, scripted.connect(b""), local_regions=scripted.lengths(), notify=b"slice-0-done",
        on_progress=events.append,
    )  # fmt: skip
    assert result.ok and torch.equal(dst, expected)
    last_submitted = events.index(OpProgress(3, OpState.PENDING, 0, plan.ops[3].num_bytes))
    done_before = {e.op_index for e in events[:last_submitted] if e.state is OpState.DONE}
    assert done_before == {0, 1, 2}
    assert [b.notify for b in scripted.batches.values()] == [None, None, None, b"slice-0-done"]
    assert scripted.notifications() == [("loopback", b"slice-0-done")]
    assert scripted.notifications() == []


def test_empty_plan(scripted, clock) -> None:
    empty = TransferPlan((), TokenRange(5, 5), (0,), Coverage.zero(), RegionId(0), RegionId(1))
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    result = ex.execute(empty, scripted.connect(b""), local_regions={})
    assert result.outcome is PlanOutcome.DONE and result.ops == () and result.num_bytes == 0
    with pytest.raises(PlanError, match="no op to carry the notification"):
        ex.execute(empty, scripted.connect(b""), local_regions={}, notify=b"x")


def test_arguments_are_checked(scripted, clock) -> None:
    with pytest.raises(InvalidArgumentError, match="max_inflight"):
        PlanExecutor(scripted, max_inflight=0)
    with pytest.raises(InvalidArgumentError, match="max_idle_s"):
        PlanExecutor(scripted, max_idle_s=0)
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    empty = TransferPlan((), TokenRange(5, 5), (0,), Coverage.zero(), RegionId(0), RegionId(1))
    peer = scripted.connect(b"")
    for bad in (0, -1.0, True, "1"):
        with pytest.raises(InvalidArgumentError, match="deadline_s"):
            ex.start(empty, peer, local_regions={}, deadline_s=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="XferKind"):
        ex.start(empty, peer, local_regions={}, kind="write")  # type: ignore[arg-type]


def test_metrics_are_recorded_in_the_injected_registry(scripted, clock, kvref, fault) -> None:
    registry = MetricsRegistry()
    plan, *_ = build(scripted, kvref)
    ex = PlanExecutor(scripted, metrics=registry, max_inflight=1, clock=clock, sleep=clock.sleep)
    assert ex.execute(plan, scripted.connect(b""), local_regions=scripted.lengths()).ok
    scripted.faults[len(scripted.batches) + 1] = fault("fail", after=0)
    failed = ex.execute(plan, scripted.connect(b""), local_regions=scripted.lengths())
    assert failed.outcome is PlanOutcome.FAILED
    labels = {"transport": "scripted"}
    done_bytes = plan.num_bytes + plan.ops[0].num_bytes
    assert registry.value("plan_exec_bytes", labels, "_total") == done_bytes
    assert registry.value("plan_exec_ops", {**labels, "state": "done"}, "_total") == 5
    assert registry.value("plan_exec_ops", {**labels, "state": "failed"}, "_total") == 1
    assert registry.value("plan_exec_ops", {**labels, "state": "not_submitted"}, "_total") == 2
    assert registry.value("plan_descriptors_per_op", suffix="_count") == 4 + 2
    described = sum(op.num_descriptors for op in plan.ops) + sum(
        op.num_descriptors for op in plan.ops[:2]
    )
    assert registry.value("plan_descriptors_per_op", suffix="_sum") == described
    for outcome in ("done", "failed"):
        assert registry.value("plan_exec_seconds", {**labels, "outcome": outcome}, "_count") == 1


@pytest.mark.parametrize("grouping", list(OpGrouping))
def test_plans_run_over_the_local_transport_loopback(kvref, grouping: OpGrouping) -> None:
    transport = LocalTransport()
    try:
        plan, src, dst, expected, (s_id, d_id) = build(transport, kvref, grouping)
        before_src = src.clone()
        events: list[OpProgress] = []
        result = PlanExecutor(transport).execute(
            plan, transport.connect(transport.metadata()), deadline_s=10.0,
            local_regions={s_id: int(src.numel()), d_id: int(dst.numel())},
            notify=b"done", on_progress=events.append,
        )  # fmt: skip
        assert result.ok, result
        assert torch.equal(dst, expected) and torch.equal(src, before_src)
        assert [p.state for p in result.ops] == [OpState.DONE] * len(plan.ops)
        assert {e.op_index for e in events if e.state is OpState.DONE} == set(range(len(plan.ops)))
        assert transport.notifications() == [(transport.agent, b"done")]
    finally:
        transport.close()


@pytest.mark.parametrize("kind", list(XferKind))
def test_plans_run_between_two_local_transports(kvref, kind: XferKind) -> None:
    fabric = LocalFabric()
    sender, receiver = LocalTransport(fabric=fabric), LocalTransport(fabric=fabric)
    try:
        src, s_pool = kvref.region_with_pool(SRC_LAYOUT, 0, seed=5)
        dst, _ = kvref.region_with_pool(DST_LAYOUT, 0, seed=6)
        s_reg, d_reg = sender.register(src), receiver.register(dst)
        plan = plan_transfer(
            PlanSide(SRC_LAYOUT, np.array(S_IDS), s_reg.region_id),
            PlanSide(DST_LAYOUT, np.array(D_IDS), d_reg.region_id),
            TokenRange(0, 16),
            options=PlanOptions(grouping=OpGrouping.LAYER),
        )
        expected = dst.clone()
        exp_pool = expected[: DST_LAYOUT.pool_bytes].view(DST_LAYOUT.dtype)
        kvref.scatter((SRC_LAYOUT, s_pool, S_IDS), (DST_LAYOUT, exp_pool.view(DST_LAYOUT.shape),
                      D_IDS), plan.tokens, plan.layers)  # fmt: skip
        if kind is XferKind.WRITE:  # the sender pushes into the receiver's pool
            runner, peer = sender, sender.connect(receiver.metadata())
            local = {s_reg.region_id: int(src.numel())}
        else:  # the receiver pulls from the sender's pool
            runner, peer = receiver, receiver.connect(sender.metadata())
            local = {d_reg.region_id: int(dst.numel())}
        result = PlanExecutor(runner).execute(
            plan, peer, local_regions=local, kind=kind, notify=b"end"
        )
        assert result.ok, result
        assert torch.equal(dst, expected)
        other = receiver if kind is XferKind.WRITE else sender
        assert other.notifications() == [(runner.agent, b"end")]
    finally:
        sender.close()
        receiver.close()


def test_region_ids_are_whatever_the_transport_assigned(scripted, clock, kvref) -> None:
    scripted.register(torch.zeros(16, dtype=torch.uint8))  # shift the ids
    plan, _, dst, expected, ids = build(scripted, kvref)
    assert ids == (RegionId(1), RegionId(2))
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    assert ex.execute(plan, scripted.connect(b""), local_regions=scripted.lengths()).ok
    assert torch.equal(dst, expected)


STATE_LAYOUT = KVLayout.state(num_slots=3, num_layers=2, state_dim=8, dtype=torch.uint8)


def _state_plan(transport, slot: int):
    """A whole-only plan: slot ``slot`` of a 3-slot state pool into slot 2 of another."""
    src = torch.arange(STATE_LAYOUT.pool_bytes, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros(STATE_LAYOUT.pool_bytes, dtype=torch.uint8)
    s_reg, d_reg = transport.register(src), transport.register(dst)
    plan = plan_transfer(
        PlanSide(STATE_LAYOUT, np.array([slot]), s_reg.region_id),
        PlanSide(STATE_LAYOUT, np.array([2]), d_reg.region_id),
        None,
    )
    return plan, src, dst


def test_plans_run_jointly_share_batches(scripted, clock, kvref) -> None:
    """A 4-op KV plan and a 1-op state plan run jointly: 4 batches, the first carrying both
    plans' descriptors; the bytes are those of running each alone; one result for both."""
    kv, _, dst, expected, _ = build(scripted, kvref)
    state, s_src, s_dst = _state_plan(scripted, slot=1)
    assert (len(kv.ops), len(state.ops)) == (4, 1)
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    run = ex.start(
        (kv, state), scripted.connect(b""), local_regions=scripted.lengths(), notify=b"end"
    )
    while not run.done:
        run.step()
        clock.sleep(1e-3)
    result = run.result()
    assert result.ok and result.num_bytes == kv.num_bytes + state.num_bytes == result.bytes_done
    batches = list(scripted.batches.values())
    assert len(batches) == 4 == len(result.ops)
    assert len(batches[0].src) == len(kv.ops[0].src) + len(state.ops[0].src)
    assert [len(b.src) for b in batches[1:]] == [len(op.src) for op in kv.ops[1:]]
    assert [b.notify for b in batches] == [None, None, None, b"end"]
    assert [p.num_bytes for p in result.ops] == [
        kv.ops[0].num_bytes + state.ops[0].num_bytes,
        *(op.num_bytes for op in kv.ops[1:]),
    ]
    assert torch.equal(dst, expected)
    row = STATE_LAYOUT.pool_bytes // 3
    assert torch.equal(s_dst[2 * row :], s_src[row : 2 * row])
    assert int(s_dst[: 2 * row].sum()) == 0


def test_joint_plans_that_share_bytes_are_refused_before_any_byte_moves(scripted, clock) -> None:
    one, _, dst = _state_plan(scripted, slot=0)
    other = TransferPlan(
        one.ops, one.tokens, one.layers, one.coverage, one.src_region, one.dst_region
    )  # the same bytes again
    ex = PlanExecutor(scripted, clock=clock, sleep=clock.sleep)
    peer = scripted.connect(b"")
    with pytest.raises(PlanError, match="plans run jointly share destination bytes"):
        ex.start((one, other), peer, local_regions=scripted.lengths())
    with pytest.raises(InvalidArgumentError, match="a TransferPlan or a sequence of them"):
        ex.start((), peer, local_regions=scripted.lengths())
    with pytest.raises(InvalidArgumentError, match="a TransferPlan or a sequence of them"):
        ex.start((one, "plan"), peer, local_regions=scripted.lengths())
    assert scripted.batches == {} and int(dst.sum()) == 0


@settings(max_examples=40, deadline=None)
@given(
    plans=st.lists(
        st.tuples(
            st.integers(0, 15),  # token range start
            st.integers(1, 16),  # token count
            st.sampled_from(list(OpGrouping)),
        ),
        min_size=1,
        max_size=3,
    ),
    seed=st.integers(0, 2**16),
)
def test_a_joint_run_moves_the_bytes_of_each_plan_run_alone(kvref, plans, seed) -> None:
    """Plans of several pool pairs (random token ranges and op groupings) run jointly over the
    local loopback: one batch per op position, each holding that op of every plan in plan order,
    and every destination byte as if each plan had run alone."""
    transport = LocalTransport()
    try:
        built, alone, lengths = [], [], {}
        for i, (start, count, grouping) in enumerate(plans):
            src, _ = kvref.region_with_pool(SRC_LAYOUT, 0, seed=seed + 2 * i)
            dst, _ = kvref.region_with_pool(DST_LAYOUT, 0, seed=seed + 2 * i + 1)
            s_reg, d_reg = transport.register(src), transport.register(dst)
            lengths.update({s_reg.region_id: s_reg.length, d_reg.region_id: d_reg.length})
            end = min(start + count, 16)
            plan = plan_transfer(
                PlanSide(SRC_LAYOUT, np.array(S_IDS), s_reg.region_id),
                PlanSide(DST_LAYOUT, np.array(D_IDS), d_reg.region_id),
                TokenRange(start, end),
                options=PlanOptions(grouping=grouping, chunk_spec=ChunkSpec(4)),
            )
            expected = dst.clone()
            kvref.memcpy(plan, {s_reg.region_id: src, d_reg.region_id: expected})
            built.append(plan)
            alone.append((dst, expected))
        batches = joint_ops(built)
        assert len(batches) == max(len(p.ops) for p in built)
        for k, (src_list, dst_list) in enumerate(batches):
            ops = [p.ops[k] for p in built if k < len(p.ops)]
            assert src_list.equals(concat_descriptors([o.src for o in ops]))
            assert dst_list.equals(concat_descriptors([o.dst for o in ops]))
        run = PlanExecutor(transport).start(
            built, transport.connect(transport.metadata()), local_regions=lengths
        )
        while not run.done:
            run.step()
        result = run.result()
        assert result.ok and len(result.ops) == len(batches)
        assert result.bytes_done == sum(p.num_bytes for p in built)
        for dst, expected in alone:
            assert torch.equal(dst, expected)
    finally:
        transport.close()
