"""Property tests of the planner: random layouts (kinds, memory orders, block sizes, TP head
ranges, dtypes, windows), random block tables, token and layer ranges and op groupings →
``validate()`` holds, the plan is maximally coalesced, and executing it — with the reference
memcpy and through ``PlanExecutor`` over ``LocalTransport`` — moves exactly the bytes of the
reference gather/scatter. A stateful machine sends a sequence as pipelined slices."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvplane.chunks import ChunkSpec
from kvplane.ids import ChunkKey, RegionId, SliceId, TokenRange
from kvplane.layout import Axis, KVLayout, LayoutKind
from kvplane.transfer.planner import plan_transfer
from kvplane.transfer.request import OpGrouping, PlanOptions, PlanSide
from kvplane.transfer.stats import contiguous_runs
from kvplane.transports.descriptors import concat_descriptors

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn]
ORDERS = [(*perm, Axis.DIM) for perm in itertools.permutations(list(Axis)[:5])]


@st.composite
def layout_pair(draw: st.DrawFn) -> tuple[KVLayout, KVLayout, tuple[int, ...]]:
    """Two compatible layouts that may differ in block size, order, head range and layers,
    and the layers both hold."""
    kind = draw(st.sampled_from(["gqa", "mha", "mla"]))
    dtype = draw(st.sampled_from(DTYPES))
    universe = list(range(5))
    common = draw(st.lists(st.sampled_from(universe), min_size=1, max_size=3, unique=True))
    layouts = []
    heads = draw(st.integers(1, 5))
    head_dim = draw(st.integers(1, 4))
    window = draw(st.none() | st.integers(1, 12)) if kind == "gqa" else None
    rope = draw(st.integers(1, 3))
    for _ in range(2):
        extra = draw(st.lists(st.sampled_from(universe), max_size=2, unique=True))
        layer_ids = tuple(draw(st.permutations(sorted(set(common) | set(extra)))))
        block_size = draw(st.integers(1, 6))
        order = draw(st.sampled_from(ORDERS))
        num_blocks = 24
        if kind == "mla":
            layouts.append(
                KVLayout.mla(
                    num_blocks=num_blocks, block_size=block_size, layer_ids=layer_ids,
                    latent_dim=head_dim, rope_dim=rope, dtype=dtype, order=order,
                )
            )  # fmt: skip
            continue
        if kind == "mha":
            layouts.append(
                KVLayout(
                    kind=LayoutKind.MHA, num_blocks=num_blocks, block_size=block_size,
                    layer_ids=layer_ids, total_heads=heads, head_dim=head_dim, dtype=dtype,
                    order=order,
                )
            )  # fmt: skip
            continue
        lo = draw(st.integers(0, heads - 1))
        head_range = (lo, draw(st.integers(lo + 1, heads)))
        layouts.append(
            KVLayout.gqa(
                num_blocks=num_blocks, block_size=block_size, layer_ids=layer_ids,
                kv_heads=heads, head_dim=head_dim, dtype=dtype, head_range=head_range,
                order=order, sliding_window=window,
            )
        )  # fmt: skip
    a, b = layouts
    if kind == "gqa" and max(a.head_range[0], b.head_range[0]) >= min(
        a.head_range[1], b.head_range[1]
    ):
        b = KVLayout.gqa(
            num_blocks=b.num_blocks, block_size=b.block_size, layer_ids=b.layer_ids,
            kv_heads=heads, head_dim=head_dim, dtype=dtype, head_range=a.head_range,
            order=b.order, sliding_window=window,
        )  # fmt: skip
    return a, b, tuple(common)


@st.composite
def plan_case(draw: st.DrawFn) -> dict[str, object]:
    a, b, common = draw(layout_pair())
    end = draw(st.integers(0, 20))
    start = draw(st.integers(0, end))
    need_a = -(-end // a.block_size)
    need_b = -(-end // b.block_size)
    ids_a = draw(st.permutations(range(a.num_blocks)))[: need_a + draw(st.integers(0, 2))]
    ids_b = draw(st.permutations(range(b.num_blocks)))[: need_b + draw(st.integers(0, 2))]
    layers = draw(st.none() | st.permutations(common).map(lambda p: p[: max(1, len(p) - 1)]))
    if layers is None and not set(a.layer_ids) <= set(b.layer_ids):
        layers = common
    grouping = draw(st.sampled_from(list(OpGrouping)))
    chunk = ChunkSpec(a.block_size, draw(st.integers(1, 3)))
    options = PlanOptions(
        prefix_tokens=draw(st.just(0) | st.integers(0, 22)),
        grouping=grouping,
        chunk_spec=chunk,
        chunk_keys=tuple(ChunkKey(bytes([i]) * 32) for i in range(4)),
        slice_id=draw(st.none() | st.integers(0, 9).map(SliceId)),
    )
    offsets = (
        draw(st.integers(0, 3)) * a.element_size * 4,
        draw(st.integers(0, 3)) * b.element_size * 2,
    )
    return dict(
        src=(a, ids_a), dst=(b, ids_b), tokens=TokenRange(start, end), layers=layers,
        options=options, offsets=offsets, seed=draw(st.integers(0, 1000)),
    )  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_case())
def test_random_plans_validate_and_match_the_reference(kvref, case) -> None:
    check_case(kvref, case)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=plan_case())
def test_random_plans_soak(kvref, case) -> None:
    check_case(kvref, case)


def check_case(kvref, case) -> None:
    args = (case["src"], case["dst"], case["tokens"])
    kwargs = dict(layers=case["layers"], options=case["options"], offsets=case["offsets"],
                  seed=case["seed"])  # fmt: skip
    plan = kvref.plan_and_check(*args, **kwargs)
    # the same request executed through PlanExecutor over a real LocalTransport
    over_local = kvref.plan_and_check(*args, **kwargs, via_local=True)
    assert over_local.num_descriptors == plan.num_descriptors
    stats = plan.stats()
    options = case["options"]
    if plan.empty:
        assert plan.num_bytes == 0
        return
    if options.grouping is OpGrouping.WHOLE:
        assert len(plan.ops) == 1
        assert stats.descriptors == stats.contiguous_runs  # maximally coalesced
    elif options.grouping is OpGrouping.LAYER:
        assert [op.layers for op in plan.ops] == [(x,) for x in plan.layers]
        assert all(op.tokens == plan.tokens for op in plan.ops)
    else:
        step = options.chunk_spec.tokens_per_chunk
        bounds = [(op.tokens.start, op.tokens.end) for op in plan.ops]
        assert bounds[0][0] == plan.tokens.start and bounds[-1][1] == plan.tokens.end
        assert all(x[1] == y[0] for x, y in itertools.pairwise(bounds))
        assert all(s // step == (e - 1) // step for s, e in bounds)
    # within every op, no two descriptors could have been one
    for op in plan.ops:
        assert contiguous_runs(op.src, op.dst) == op.num_descriptors
    assert all(op.slice_id == options.slice_id for op in plan.ops)
    assert stats.amplification == 1.0


class PipelinedSlices(RuleBasedStateMachine):
    """Send one sequence slice by slice (arbitrary, unaligned slice sizes); after every slice the
    receiver holds exactly the reference bytes of ``[0, sent)`` and nothing else changed."""

    def __init__(self, ref) -> None:
        super().__init__()
        self.ref = ref

    @initialize(
        pair=layout_pair(), total=st.integers(1, 30), seed=st.integers(0, 100), data=st.data()
    )
    def setup(self, pair, total, seed, data) -> None:
        ref = self.ref
        a, b, common = pair
        if a.sliding_window is not None:  # the window is a whole-sequence rule; not per slice
            a = KVLayout.gqa(
                num_blocks=a.num_blocks, block_size=a.block_size, layer_ids=a.layer_ids,
                kv_heads=a.total_heads, head_dim=a.head_dim, dtype=a.dtype,
                head_range=a.head_range, order=a.order,
            )  # fmt: skip
            b = KVLayout.gqa(
                num_blocks=b.num_blocks, block_size=b.block_size, layer_ids=b.layer_ids,
                kv_heads=b.total_heads, head_dim=b.head_dim, dtype=b.dtype,
                head_range=b.head_range, order=b.order,
            )  # fmt: skip
        total = min(total, a.num_blocks * a.block_size, b.num_blocks * b.block_size)
        ids_a = data.draw(st.permutations(range(a.num_blocks)))[: -(-total // a.block_size)]
        ids_b = data.draw(st.permutations(range(b.num_blocks)))[: -(-total // b.block_size)]
        self.a, self.b, self.layers, self.total = a, b, tuple(common), total
        self.ids_a, self.ids_b = ids_a, ids_b
        s_region, self.s_pool = ref.region_with_pool(a, 0, seed)
        d_region, self.d_pool = ref.region_with_pool(b, 0, seed + 1)
        self.initial_dst = d_region.clone()
        self.regions = {RegionId(0): s_region, RegionId(1): d_region}
        self.src = PlanSide(a, np.array(ids_a), RegionId(0))
        self.dst = PlanSide(b, np.array(ids_b), RegionId(1))
        self.sent = 0
        self.slice_id = 0
        self.dst_written = []

    @rule(size=st.integers(0, 9))
    def send_slice(self, size: int) -> None:
        end = min(self.sent + size, self.total)
        plan = plan_transfer(
            self.src, self.dst, TokenRange(self.sent, end), layers=self.layers,
            options=PlanOptions(slice_id=SliceId(self.slice_id)),
        )  # fmt: skip
        plan.validate(self.ref.lengths(self.regions), self.ref.lengths(self.regions))
        self.ref.memcpy(plan, self.regions)
        self.dst_written.append(plan.dst_descriptors())
        self.sent, self.slice_id = end, self.slice_id + 1

    @invariant()
    def receiver_holds_exactly_the_sent_prefix(self) -> None:
        if not hasattr(self, "sent"):
            return
        expected = self.initial_dst.clone()
        pool = expected[: self.b.pool_bytes].view(self.b.dtype).view(self.b.shape)
        self.ref.scatter(
            (self.a, self.s_pool, self.ids_a), (self.b, pool, self.ids_b),
            TokenRange(0, self.sent), self.layers,
        )  # fmt: skip
        assert torch.equal(self.regions[RegionId(1)], expected)
        # slices never write the same destination byte twice
        assert concat_descriptors(self.dst_written).facts.overlap is None


def test_pipelined_slices_compose(kvref) -> None:
    run_state_machine_as_test(
        lambda: PipelinedSlices(kvref),
        settings=settings(
            max_examples=25, stateful_step_count=8, deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )  # fmt: skip
