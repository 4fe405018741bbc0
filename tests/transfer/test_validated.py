"""ValidatedPlan: a plan is validated once, from build to DONE; what validation proved is kept
and trusted by the executor and the transports, which only check that its regions still exist."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvplane.chunks import ChunkSpec
from kvplane.errors import InvalidArgumentError, PlanError
from kvplane.ids import TokenRange
from kvplane.layout import HEAD_MAJOR, KVLayout
from kvplane.transfer import plan as plan_module
from kvplane.transfer.coverage import Coverage
from kvplane.transfer.executor import PlanExecutor
from kvplane.transfer.plan import TransferPlan, ValidatedPlan
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.progress import OpState, PlanOutcome
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide
from kvplane.transports import core
from kvplane.transports.base import DescriptorList, XferKind
from kvplane.transports.checks import CheckedBatch, check_batch, vouched
from kvplane.transports.local import LocalTransport

SRC_LAYOUT = KVLayout.gqa(
    num_blocks=6, block_size=4, num_layers=2, kv_heads=4, head_dim=4, dtype=torch.bfloat16
)
DST_LAYOUT = KVLayout.gqa(
    num_blocks=5, block_size=8, num_layers=2, kv_heads=4, head_dim=4, dtype=torch.bfloat16,
    head_range=(2, 4), order=HEAD_MAJOR,
)  # fmt: skip
S_IDS, D_IDS = [4, 0, 2, 5], [3, 1]
PLAN_BYTES = 13 * 2 * 2 * 2 * 4 * 2  # tokens [2, 15) x layers x K,V x 2 shared heads x dim x 2 B


class Pools:
    """Two pools registered on one loopback ``LocalTransport`` and a 4-op CHUNK plan between."""

    def __init__(self, kvref, t: LocalTransport, seed: int = 3) -> None:
        self.src, s_pool = kvref.region_with_pool(SRC_LAYOUT, 0, seed=seed)
        self.dst, _ = kvref.region_with_pool(DST_LAYOUT, 0, seed=seed + 1)
        s_reg, d_reg = t.register(self.src), t.register(self.dst)
        self.ids = (s_reg.region_id, d_reg.region_id)
        self.lengths = {s_reg.region_id: s_reg.length}, {d_reg.region_id: d_reg.length}
        self.plan = plan_transfer(
            PlanSide(SRC_LAYOUT, np.array(S_IDS), s_reg.region_id),
            PlanSide(DST_LAYOUT, np.array(D_IDS), d_reg.region_id),
            TokenRange(2, 15),
            options=PlanOptions(grouping=OpGrouping.CHUNK, chunk_spec=ChunkSpec(4)),
        )
        self.initial = self.dst.clone()
        self.expected = self.dst.clone()
        exp_pool = self.expected[: DST_LAYOUT.pool_bytes].view(DST_LAYOUT.dtype)
        kvref.scatter((SRC_LAYOUT, s_pool, S_IDS),
                      (DST_LAYOUT, exp_pool.view(DST_LAYOUT.shape), D_IDS),
                      self.plan.tokens, self.plan.layers)  # fmt: skip


@pytest.fixture
def local():
    t = LocalTransport()
    yield t
    t.close()


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count every call of the one check function, from validation and from submit."""
    calls: list[str] = []

    def counting(where: str):  # type: ignore[no-untyped-def]
        def call(*args: object, **kwargs: object) -> CheckedBatch:
            calls.append(where)
            return check_batch(*args, **kwargs)  # type: ignore[arg-type]

        return call

    monkeypatch.setattr(plan_module, "check_batch", counting("validate"))
    monkeypatch.setattr(core, "check_batch", counting("submit"))
    return calls


def test_validate_returns_the_facts_it_proved(kvref, local) -> None:
    p = Pools(kvref, local)
    v = p.plan.validate(*p.lengths)
    assert isinstance(v, ValidatedPlan)
    assert v.plan is p.plan and v.plans == (p.plan,) and not v.empty
    assert len(p.plan.ops) == len(v.batches) == 4
    for op, batch in zip(p.plan.ops, v.batches, strict=True):
        assert batch.src is op.src and batch.dst is op.dst and batch.sources_disjoint
        assert vouched(op.src, op.dst) == batch and batch.num_bytes == op.num_bytes
    assert v.num_bytes == v.logical_bytes == v.whole.num_bytes == PLAN_BYTES == 832
    (s_id, s_len), (d_id, d_len) = v.src_regions[0], v.dst_regions[0]
    assert (len(v.src_regions), len(v.dst_regions)) == (1, 1)
    assert (s_id, d_id) == p.ids and (s_len, d_len) == (len(p.src), len(p.dst))
    with pytest.raises(InvalidArgumentError, match=r"comes from TransferPlan\.validate"):
        ValidatedPlan(v.plans, v.whole, v.src_regions, v.dst_regions)
    other = Pools(kvref, local, seed=7)
    with pytest.raises(InvalidArgumentError, match="joins 2 plans"):
        _ = ValidatedPlan.join([v, other.plan.validate(*other.lengths)]).plan


def test_a_plan_is_checked_once_from_build_to_done(kvref, local, monkeypatch) -> None:
    calls = _spy(monkeypatch)
    p = Pools(kvref, local)
    ex = PlanExecutor(local)
    peer = local.connect(local.metadata())
    v = p.plan.validate(*p.lengths)
    assert calls == ["validate"]
    for _ in range(2):  # run twice: the plan is trusted, every batch of it vouched
        result = ex.execute(v, peer)
        assert result.outcome is PlanOutcome.DONE and result.bytes_done == PLAN_BYTES
        assert len(result.ops) == 4
    assert calls == ["validate"]
    assert torch.equal(p.dst, p.expected)
    plain = Pools(kvref, local, seed=11)  # a plain plan: validated by start, once
    peer = local.connect(local.metadata())  # a table that lists its regions
    done = ex.execute(
        plain.plan, peer, local_regions={r.region_id: r.length for r in local.regions()}
    )
    assert done.outcome is PlanOutcome.DONE and calls == ["validate", "validate"]
    assert torch.equal(plain.dst, plain.expected)
    assert (local.pinned_regions(), local.live_batches()) == (0, 0)


def test_a_raw_submit_beside_a_validated_plan_is_still_checked(kvref, local, monkeypatch) -> None:
    calls = _spy(monkeypatch)
    p = Pools(kvref, local)
    peer = local.connect(local.metadata())
    v = p.plan.validate(*p.lengths)
    op = p.plan.ops[0]
    assert v.batches[0] == vouched(op.src, op.dst)  # batches (built on first use) vouch
    copy = DescriptorList(op.dst.regions.copy(), op.dst.offsets.copy(), op.dst.lengths.copy())
    assert local.wait(local.submit(XferKind.WRITE, op.src, copy, peer)).bytes_done == op.num_bytes
    assert calls == ["validate", "submit"]  # equal content, but not the list validated
    shifted = DescriptorList(copy.regions, copy.offsets + len(p.dst), copy.lengths)
    with pytest.raises(PlanError, match="runs past the region end"):
        local.submit(XferKind.WRITE, op.src, shifted, peer)
    assert calls == ["validate", "submit", "submit"]
    assert (local.pinned_regions(), local.live_batches()) == (0, 0)


def test_a_plan_validated_against_regions_since_deregistered_is_refused(kvref, local) -> None:
    p = Pools(kvref, local)
    v = p.plan.validate(*p.lengths)
    local.deregister(p.ids[1])
    ex = PlanExecutor(local)
    result = ex.execute(v, local.connect(local.metadata()))
    assert result.outcome is PlanOutcome.FAILED and result.bytes_done == 0
    assert [op.state for op in result.ops] == [OpState.NOT_SUBMITTED] * 4
    assert f"unknown region(s) [{p.ids[1]}]" in result.reason
    assert torch.equal(p.dst, p.initial)
    assert (local.pinned_regions(), local.live_batches()) == (0, 0)


def test_validated_plans_join_into_one_run(kvref, local, monkeypatch) -> None:
    calls = _spy(monkeypatch)
    a, b = Pools(kvref, local), Pools(kvref, local, seed=5)
    va, vb = a.plan.validate(*a.lengths), b.plan.validate(*b.lengths)
    joint = ValidatedPlan.join([va, vb])
    assert joint.plans == (a.plan, b.plan) and len(joint.batches) == 4
    assert joint.num_bytes == joint.logical_bytes == 2 * PLAN_BYTES
    assert joint.src_regions == tuple(sorted((*va.src_regions, *vb.src_regions)))
    assert joint.dst_regions == tuple(sorted((*va.dst_regions, *vb.dst_regions)))
    for k, batch in enumerate(joint.batches):
        assert len(batch.src) == len(a.plan.ops[k].src) + len(b.plan.ops[k].src)
        assert vouched(batch.src, batch.dst) == batch
    assert ValidatedPlan.join([va]) is va
    result = PlanExecutor(local).execute(joint, local.connect(local.metadata()))
    assert result.outcome is PlanOutcome.DONE and result.bytes_done == 2 * PLAN_BYTES
    assert torch.equal(a.dst, a.expected) and torch.equal(b.dst, b.expected)
    assert calls == ["validate", "validate"]
    with pytest.raises(PlanError, match="plans run jointly share destination bytes"):
        ValidatedPlan.join([va, va])
    with pytest.raises(InvalidArgumentError, match="one or more ValidatedPlans"):
        ValidatedPlan.join([])
    assert (local.pinned_regions(), local.live_batches()) == (0, 0)


def test_start_needs_local_regions_only_for_plans_not_validated(kvref, local) -> None:
    p = Pools(kvref, local)
    peer = local.connect(local.metadata())
    ex = PlanExecutor(local)
    with pytest.raises(InvalidArgumentError, match="need local_regions"):
        ex.start(p.plan, peer)
    run = ex.start(p.plan.validate(*p.lengths), peer)  # validated: no tables needed
    while not run.done:
        run.step()
    assert run.result().outcome is PlanOutcome.DONE and torch.equal(p.dst, p.expected)
    empty = TransferPlan((), TokenRange(0, 0), (0,), Coverage.zero(), *p.ids)
    with pytest.raises(PlanError, match="no op to carry the notification"):
        ex.start(empty.validate(*p.lengths), peer, notify=b"end")
