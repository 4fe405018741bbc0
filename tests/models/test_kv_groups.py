"""KV cache groups: the partition of a model's layers by window (``KVGroups``), the per-group
pools (``GroupedKVCache``), a step's per-group pages and the model's checks of both."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models_testlib import mixed_qwen2, random_model, small_llama

from kvplane.errors import InvalidArgumentError
from kvplane.models import PagedKVCache, StepBatch, StepRequest
from kvplane.models.kv import GroupedKVCache
from kvplane.models.kv_groups import KVGroup, KVGroups

MIXED = random_model(mixed_qwen2(), seed=5)


@pytest.mark.parametrize(
    ("windows", "groups"),
    [
        ([None, None], ((None, (0, 1)),)),
        ([8, 8, 8], ((8, (0, 1, 2)),)),
        ([8, None, 8, None], ((8, (0, 2)), (None, (1, 3)))),
        ([None, 4, 8, 4, None], ((None, (0, 4)), (4, (1, 3)), (8, (2,)))),
        ({5: None, 3: 16, 9: 16}, ((16, (3, 9)), (None, (5,)))),  # a stage's layers
    ],
)
def test_groups_by_window_in_layer_order(
    windows: list[int | None] | dict[int, int | None],
    groups: tuple[tuple[int | None, tuple[int, ...]], ...],
) -> None:
    got = KVGroups.from_windows(windows)
    assert tuple((g.window, g.layer_ids) for g in got) == groups
    assert got.windows == tuple(w for w, _ in groups)
    assert got.single == (len(groups) == 1) and len(got) == len(groups)
    items = windows.items() if isinstance(windows, dict) else enumerate(windows)
    assert all(got.groups[got.group_of(i)].window == w for i, w in items)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([None, 2, 8, 16]), min_size=1, max_size=12))
def test_every_layer_is_in_exactly_the_group_of_its_window(windows: list[int | None]) -> None:
    got = KVGroups.from_windows(windows)
    flat = sorted(i for g in got for i in g.layer_ids)
    assert flat == list(range(len(windows)))
    assert [g.layer_ids[0] for g in got] == sorted(windows.index(w) for w in set(windows))
    assert all(windows[i] == g.window for g in got for i in g.layer_ids)
    assert len(got) == len(set(windows))


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: KVGroups(()), "non-empty"),
        (lambda: KVGroups(((8, (0,)),)), "KVGroup values"),  # type: ignore[arg-type]
        (lambda: KVGroups((KVGroup(8, (0,)), KVGroup(8, (1,)))), "share a window"),
        (lambda: KVGroups((KVGroup(None, (1,)), KVGroup(8, (0,)))), "ordered by first layer"),
        (lambda: KVGroups((KVGroup(None, (0, 1)), KVGroup(8, (1,)))), "in two KV cache groups"),
        (lambda: KVGroup(0, (0,)), "KVGroup.window must be"),
        (lambda: KVGroup(None, (2, 1)), "must ascend"),
        (lambda: KVGroup(None, ()), "at least one layer"),
        (lambda: KVGroups.from_windows([]), "at least one layer"),
        (lambda: KVGroups.from_windows([8]).group_of(1), "layer 1 is in no KV cache group"),
    ],
)
def test_bad_groups(make: object, words: str) -> None:
    with pytest.raises(InvalidArgumentError, match=words):
        make()  # type: ignore[operator]


def test_each_group_layout_holds_its_layers_with_the_model_window_map() -> None:
    layout = MIXED.kv_layout(10, 4)
    groups = KVGroups.of_layout(layout)
    assert groups == KVGroups.from_windows([8, None, 8, None])
    win, full = groups.layouts(layout, (3, 7))
    assert (win.layer_ids, win.num_blocks, full.layer_ids, full.num_blocks) == (
        (0, 2),
        3,
        (1, 3),
        7,
    )
    assert win.layer_windows == full.layer_windows == layout.layer_windows
    assert (win.window_start(20), full.window_start(20)) == (13, 0)
    assert groups.layouts(layout)[0].num_blocks == 10
    with pytest.raises(InvalidArgumentError, match="2 groups but 1 block counts"):
        groups.layouts(layout, (3,))
    with pytest.raises(InvalidArgumentError, match="are not those of layout"):
        KVGroups.from_windows([8, 8, None, None]).layouts(layout)


def test_a_grouped_cache_routes_each_layer_to_its_groups_pool() -> None:
    kv = GroupedKVCache.allocate(MIXED.kv_layout(3, 4), (3, 5))
    assert [c.layout.layer_ids for c in kv.caches] == [(0, 2), (1, 3)]
    assert [kv.group_of(i) for i in range(4)] == [0, 1, 0, 1]
    assert kv.pool is kv.caches[0].pool and kv.num_blocks == 3
    k = torch.ones(2, 2, 8)
    kv.write_kv(3, torch.tensor([0, 17]), k, 2 * k)
    kp, vp = kv.gqa(3).k, kv.gqa(3).v
    assert kp.data_ptr() == kv.caches[1].gqa(3).k.data_ptr()
    assert (float(kp[0, 0].sum()), float(vp[4, 1].sum())) == (16.0, 32.0)
    assert int(kv.caches[0].pool.count_nonzero()) == 0
    single = MIXED.new_kv_cache(3, 4)
    assert single.caches == (single,) and single.group_of(3) == 0
    c0, c1 = kv.caches
    with pytest.raises(InvalidArgumentError, match="the groups are"):
        GroupedKVCache(kv.groups, (c1, c0))
    with pytest.raises(InvalidArgumentError, match="a tuple of PagedKVCache"):
        GroupedKVCache(kv.groups, (c0, kv))
    half = PagedKVCache(KVGroups.of_layout(MIXED.kv_layout(3, 2)).layouts(MIXED.kv_layout(3, 2))[1])
    with pytest.raises(InvalidArgumentError, match="disagree on block size"):
        GroupedKVCache(kv.groups, (c0, half))


def test_a_step_carries_one_page_table_per_group() -> None:
    reqs = [
        StepRequest([7, 8, 9], 2, [5, 1], group_block_ids=([0, 9],)),
        StepRequest([4], 6, [3, 0, 2, 9], group_block_ids=([6, 7],)),
    ]
    batch = StepBatch.build(reqs, 4)
    assert batch.num_groups == 2
    assert batch.slot_mapping.tolist() == batch.pages(0).slot_mapping.tolist() == [22, 23, 4, 2]
    assert batch.pages(1).slot_mapping.tolist() == [2, 3, 36, 30]
    assert batch.pages(1).metadata.dense().block_table.tolist() == [[0, 9], [6, 7]]
    assert batch.pages(0).metadata is batch.metadata
    plain = StepBatch.build([StepRequest([7, 8, 9], 2, [5, 1])], 4)
    assert (plain.groups, plain.num_groups, plain.pages(0).metadata) == ((), 1, plain.metadata)
    with pytest.raises(InvalidArgumentError, match="no KV cache group 1"):
        plain.pages(1)
    with pytest.raises(InvalidArgumentError, match="request 1 names the blocks of 1 KV cache"):
        StepBatch.build([reqs[0], StepRequest([4], 6, [3, 0])], 4)
    with pytest.raises(InvalidArgumentError, match=r"blocks of 4 in KV cache group 1 cover 4"):
        StepBatch.build([StepRequest([7, 8, 9], 2, [5, 1], group_block_ids=([0],))], 4)
    with pytest.raises(InvalidArgumentError, match=r"writes slot 0 .* twice"):
        StepBatch.build([StepRequest([7, 8, 9, 1, 2], 0, [5, 1], group_block_ids=([0, 0],))], 4)


def test_grouped_pools_give_the_logits_of_one_pool() -> None:
    """The same chunked prefill and decode, into one pool of every layer and into per-group
    pools over other block ids: bit-identical float32 logits."""
    prompt = [
        int(t) for t in torch.randint(0, 97, (30,), generator=torch.Generator().manual_seed(3))
    ]
    one = MIXED.new_kv_cache(16, 4)
    grouped = GroupedKVCache.allocate(MIXED.kv_layout(16, 4), (16, 16))
    a, b, c = list(range(8)), list(range(15, 7, -1)), [2, 9, 4, 11, 0, 13, 6, 15]
    for start, end in ((0, 13), (13, 29), (29, 30)):
        toks = prompt[start:end]
        want = MIXED.forward_step(StepBatch.build([StepRequest(toks, start, a)], 4), one)
        req = StepRequest(toks, start, b, group_block_ids=(c,))
        got = MIXED.forward_step(StepBatch.build([req], 4), grouped)
        assert torch.equal(got, want)


def test_the_model_refuses_pools_and_steps_of_other_groups() -> None:
    grouped = GroupedKVCache.allocate(MIXED.kv_layout(4, 4), (4, 4))
    one_group = StepBatch.build([StepRequest([1, 2], 0, [0])], 4)
    two = StepBatch.build([StepRequest([1, 2], 0, [0], group_block_ids=([1],))], 4)
    far = StepBatch.build([StepRequest([1, 2], 0, [0], group_block_ids=([4],))], 4)
    with pytest.raises(
        InvalidArgumentError, match="pages of 1 KV cache groups; the KV cache has 2"
    ):
        MIXED.forward_step(one_group, grouped)
    with pytest.raises(
        InvalidArgumentError, match="pages of 2 KV cache groups; the KV cache has 1"
    ):
        MIXED.forward_step(two, MIXED.new_kv_cache(4, 4))
    with pytest.raises(InvalidArgumentError, match=r"slots \[16, 17\] fall outside"):
        MIXED.forward_step(far, grouped)
    uniform = random_model(small_llama(num_layers=4), seed=5)
    layout = uniform.kv_layout(4, 4)
    foreign = GroupedKVCache.allocate(MIXED.kv_layout(4, 4), (4, 4))
    with pytest.raises(InvalidArgumentError, match="does not fit this model"):
        uniform.forward_step(two, foreign)
    alone = GroupedKVCache(KVGroups.of_layout(layout), (PagedKVCache(layout),))
    assert uniform.forward_step(one_group, alone).shape == (1, 97)
