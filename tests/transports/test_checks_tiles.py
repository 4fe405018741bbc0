"""checks' tiles: a template proved once (``check_tiles``) is copied to any distinct units of a
lattice per side; each batch of copies moves exactly the bytes its brute-force copies name, is
vouched (a submit does not check it again) and merges a one-run template's continuing copies.
Templates whose copies could meet or leave their region, and bad units, are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.errors import PlanError
from kvplane.ids import RegionId
from kvplane.transports import core
from kvplane.transports.base import DescriptorList, XferKind, XferState
from kvplane.transports.checks import (
    SMALL_UNITS,
    CheckedBatch,
    Lattice,
    Tiles,
    check_batch,
    check_tiles,
    vouched,
)
from kvplane.transports.local import LocalTransport

POOL, SLOTS = RegionId(1), RegionId(2)
LENGTHS = {POOL: 64, SLOTS: 120}
# a layer-major pool of 4 blocks x 2 layers, 8 bytes per block and layer: block b is bytes
# [8b, 8b + 8) and [32 + 8b, ...); slots of 2 blocks (16 bytes each), 40 bytes apart (padded)
POOL_LEVELS = [Lattice(8, 4)]
SLOT_LEVELS = [Lattice(16, 2), Lattice(40, 3)]


def _template(src: list[tuple[int, int, int]], dst: list[tuple[int, int, int]]) -> CheckedBatch:
    return check_batch(DescriptorList.of(src), DescriptorList.of(dst), LENGTHS, LENGTHS,
                       sources_disjoint=True)  # fmt: skip


def _tiles() -> Tiles:
    template = _template([(1, 0, 8), (1, 32, 8)], [(2, 0, 8), (2, 8, 8)])
    return check_tiles(template, POOL_LEVELS, SLOT_LEVELS, LENGTHS, LENGTHS)


def _triples(d: DescriptorList) -> list[tuple[int, int, int]]:
    return list(zip(d.regions.tolist(), d.offsets.tolist(), d.lengths.tolist(), strict=True))


@settings(max_examples=40, deadline=None)
@given(picks=st.data())
def test_copies_at_distinct_units_are_the_brute_force_runs_and_vouched(
    picks: st.DataObject,
) -> None:
    tiles = _tiles()
    n = picks.draw(st.integers(0, 2))
    slots = picks.draw(st.permutations(range(3)))[:n]
    ids = picks.draw(st.permutations(range(4)))[: 2 * n]
    batch = tiles.batch(np.array(ids, dtype=np.int64), np.array(slots, dtype=np.int64))
    want_src, want_dst = [], []
    for i, block in enumerate(ids):  # copy i: block ids[i] into block i % 2 of slot i // 2
        at = slots[i // 2] * 40 + (i % 2) * 16
        want_src += [(1, 8 * block, 8), (1, 32 + 8 * block, 8)]
        want_dst += [(2, at, 8), (2, at + 8, 8)]
    assert (_triples(batch.src), _triples(batch.dst)) == (want_src, want_dst)
    assert batch.num_bytes == 32 * n and batch.sources_disjoint
    assert vouched(batch.src, batch.dst) == batch
    fresh = DescriptorList.of(want_src), DescriptorList.of(want_dst)  # the independent check
    check_batch(*fresh, LENGTHS, LENGTHS, sources_disjoint=True)
    for made, computed in zip((batch.src, batch.dst), fresh, strict=True):  # facts it knew
        for fact in ("single_region", "region_ids", "region_ends"):
            assert np.array_equal(getattr(made.facts, fact), getattr(computed.facts, fact))


def test_a_one_run_templates_continuing_copies_merge_when_that_halves_the_runs() -> None:
    lengths = {POOL: 128, SLOTS: 128}
    template = check_batch(DescriptorList.of([(1, 0, 16)]), DescriptorList.of([(2, 0, 16)]),
                           lengths, lengths, sources_disjoint=True)  # fmt: skip
    tiles = check_tiles(template, [Lattice(16, 8)], [Lattice(16, 2), Lattice(32, 4)],
                        lengths, lengths)  # fmt: skip

    def runs(ids: list[int], slots: list[int]) -> list[tuple[int, int, int, int]]:
        b = tiles.batch(np.array(ids), np.array(slots))
        assert b.num_bytes == 16 * len(ids) and b.src.lengths is b.dst.lengths
        return list(zip(b.src.offsets.tolist(), b.dst.offsets.tolist(), b.src.lengths.tolist(),
                        b.dst.regions.tolist(), strict=True))  # fmt: skip

    assert runs([2, 3, 4, 5], [1, 2]) == [(32, 32, 64, 2)]  # one run: both sides continue
    assert runs([2, 3, 6, 7], [1, 2]) == [(32, 32, 32, 2), (96, 64, 32, 2)]
    assert runs([2, 3, 4, 0], [1, 2]) == [(32, 32, 48, 2), (0, 80, 16, 2)]  # 4 -> 2 runs
    assert runs([2, 3, 5, 0], [1, 2]) == [(32, 32, 16, 2), (48, 48, 16, 2), (80, 64, 16, 2),
                                          (0, 80, 16, 2)]  # 4 -> 3 runs: not worth it  # fmt: skip


def test_templates_whose_copies_could_meet_or_leave_the_region_are_refused() -> None:
    slot = _template([(1, 0, 8), (1, 32, 8)], [(2, 0, 8), (2, 8, 8)])
    cases = [
        ("source template cells lie closer than 4", [(1, 0, 8), (1, 16, 8)], POOL_LEVELS),
        ("a source template run crosses a 8-byte cell", [(1, 0, 8), (1, 28, 8)], POOL_LEVELS),
        ("source copies by .* leave region 1 .64 bytes", [(1, 0, 8), (1, 32, 8)],
         [Lattice(8, 5)]),
        ("needs step and count >= 1", [(1, 0, 8), (1, 32, 8)], [Lattice(0, 4)]),
        ("needs one region and at least one", [(1, 0, 8), (1, 32, 8)], []),
    ]  # fmt: skip
    for match, src, levels in cases:
        template = _template(src, [(2, 0, 8), (2, 8, 8)])
        with pytest.raises(PlanError, match=match):
            check_tiles(template, levels, SLOT_LEVELS, LENGTHS, LENGTHS)
    with pytest.raises(PlanError, match=r"destination copies by .* leave region 2"):
        check_tiles(slot, POOL_LEVELS, [Lattice(16, 2), Lattice(40, 4)], LENGTHS, LENGTHS)
    with pytest.raises(PlanError, match="needs one region"):
        check_tiles(_template([(1, 0, 8), (2, 64, 8)], [(2, 0, 8), (2, 8, 8)]),
                    POOL_LEVELS, SLOT_LEVELS, LENGTHS, LENGTHS)  # fmt: skip
    src, dst = DescriptorList.of(_triples(slot.src)), DescriptorList.of(_triples(slot.dst))
    unproved = check_batch(src, dst, LENGTHS, LENGTHS)  # sources not proved disjoint
    empty = CheckedBatch(DescriptorList.empty(), DescriptorList.empty(), 0, True)
    for template in (unproved, empty):
        with pytest.raises(PlanError, match="needs runs and sources proved disjoint"):
            check_tiles(template, POOL_LEVELS, SLOT_LEVELS, LENGTHS, LENGTHS)


@pytest.mark.parametrize("count", [4, SMALL_UNITS + 40], ids=["list-check", "numpy-check"])
def test_repeated_or_out_of_range_units_are_refused(count: int) -> None:
    lengths = {POOL: count, SLOTS: count}
    one = check_batch(DescriptorList.of([(1, 0, 1)]), DescriptorList.of([(2, 0, 1)]),
                      lengths, lengths, sources_disjoint=True)  # fmt: skip
    tiles = check_tiles(one, [Lattice(1, count)], [Lattice(1, count)], lengths, lengths)
    units = np.arange(count)[::-1].copy()
    assert tiles.batch(units, units).num_bytes == count
    twice = units.copy()
    twice[-1] = 3
    with pytest.raises(PlanError, match="ids repeat 3"):
        tiles.batch(twice, units, ("ids", "slots"))
    with pytest.raises(PlanError, match=rf"slots must lie in 0..{count - 1}, got 0..{count}"):
        tiles.batch(units, units + (units == count - 1), ("ids", "slots"))
    with pytest.raises(PlanError, match=r"ids must lie in .*, got -1"):
        tiles.batch(units - 1, units, ("ids", "slots"))
    with pytest.raises(PlanError, match=f"{count} source copies against 1 destination"):
        tiles.batch(units, units[:1])
    with pytest.raises(PlanError, match="one-dimensional"):
        tiles.batch(units.reshape(1, -1), units)


def test_a_tiled_batch_is_submitted_without_another_check(monkeypatch) -> None:
    t = LocalTransport()
    pool, slots = torch.arange(64, dtype=torch.uint8), torch.zeros(120, dtype=torch.uint8)
    assert (t.register(pool).region_id, t.register(slots).region_id) == (POOL, SLOTS)
    peer = t.connect(t.metadata())
    checked: list[int] = []
    monkeypatch.setattr(core, "check_batch", lambda *a, **k: checked.append(1))
    batch = _tiles().batch(np.array([3, 0]), np.array([2]))
    assert t.wait(t.submit(XferKind.WRITE, batch.src, batch.dst, peer)).state is XferState.DONE
    assert checked == []  # vouched: only its regions were looked up
    want = torch.cat([pool[24:32], pool[56:64], pool[0:8], pool[32:40]])
    assert torch.equal(slots[80:112], want) and not slots[:80].any() and not slots[112:].any()
    assert (t.pinned_regions(), t.live_batches()) == (0, 0)
    t.close()
