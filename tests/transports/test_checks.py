"""checks: one check of pairing, bounds and overlap; its proof is kept with the lists, trusted by
submit (which then checks only that the regions are still there), and never covers bounds."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from kvplane.errors import PlanError, TransportError
from kvplane.ids import RegionId
from kvplane.transports import core
from kvplane.transports.base import DescriptorList, XferKind, XferState
from kvplane.transports.checks import (
    CheckedBatch,
    check_batch,
    join_batches,
    refuse_shared,
    vouched,
)
from kvplane.transports.local import LocalTransport

LENGTHS = {RegionId(1): 100}, {RegionId(2): 100}


def test_a_list_does_not_keep_itself_alive() -> None:
    """The proof kept with a source list names only its partner: no reference cycle."""
    src, dst = DescriptorList.of([(1, 0, 8)]), DescriptorList.of([(2, 0, 8)])
    check_batch(src, dst, *LENGTHS)
    probe = weakref.ref(src.regions)
    gc.disable()
    try:
        del src
        assert probe() is None  # freed by reference counting alone
    finally:
        gc.enable()


def test_check_batch_proves_and_vouches_exactly_that_pair() -> None:
    src = DescriptorList.of([(1, 0, 8), (1, 8, 4)])
    dst = DescriptorList.of([(2, 40, 8), (2, 0, 4)])
    assert vouched(src, dst) is None
    proof = check_batch(src, dst, *LENGTHS)
    assert isinstance(proof, CheckedBatch)
    assert (proof.src, proof.dst, proof.num_bytes, proof.sources_disjoint) == (src, dst, 12, False)
    assert vouched(src, dst) == proof
    assert vouched(src, DescriptorList.of([(2, 40, 8), (2, 0, 4)])) is None  # another list
    assert check_batch(src, dst, *LENGTHS) == proof  # vouched: only the bounds again
    with pytest.raises(PlanError, match=r"destination descriptors name unknown region\(s\) \[2\]"):
        check_batch(src, dst, LENGTHS[0], {RegionId(3): 100})  # bounds are never vouched
    with pytest.raises(PlanError, match=r"destination descriptor 0 .* runs past the region end 47"):
        check_batch(src, dst, LENGTHS[0], {RegionId(2): 47})
    assert vouched(src, dst) == proof


def test_refused_pairs_are_not_vouched() -> None:
    cases = [
        ("2 source descriptors but 1", [(1, 0, 4), (1, 4, 4)], [(2, 0, 4)]),
        ("pair 0: source length 4 != destination length 5", [(1, 0, 4)], [(2, 0, 5)]),
        ("source descriptor 0 .* runs past the region end 100", [(1, 98, 4)], [(2, 0, 4)]),
        (
            r"destination descriptors 0 and 1 overlap: region 2 \[0, \+4\) and \[2, \+4\)",
            [(1, 0, 4), (1, 4, 4)],
            [(2, 0, 4), (2, 2, 4)],
        ),
    ]
    for message, s, d in cases:
        src, dst = DescriptorList.of(s), DescriptorList.of(d)
        with pytest.raises(PlanError, match=message):
            check_batch(src, dst, *LENGTHS)
        assert vouched(src, dst) is None


def test_sources_read_twice_are_a_fact_for_submit_and_an_error_for_a_plan() -> None:
    src = DescriptorList.of([(1, 0, 8), (1, 4, 8)])  # the same source bytes twice
    dst = DescriptorList.of([(2, 0, 8), (2, 8, 8)])
    raw = check_batch(src, dst, *LENGTHS)
    assert raw.sources_disjoint is False and vouched(src, dst) == raw
    with pytest.raises(PlanError, match="source descriptors 0 and 1 overlap"):
        check_batch(src, dst, *LENGTHS, sources_disjoint=True)
    fine = DescriptorList.of([(1, 0, 8), (1, 8, 8)])
    check_batch(fine, dst, *LENGTHS)
    upgraded = check_batch(fine, dst, *LENGTHS, sources_disjoint=True)
    assert upgraded.sources_disjoint is True and vouched(fine, dst) == upgraded


def test_joined_batches_refuse_bytes_shared_between_them() -> None:
    a = check_batch(DescriptorList.of([(1, 0, 8)]), DescriptorList.of([(2, 0, 8)]), *LENGTHS,
                    sources_disjoint=True)  # fmt: skip
    b = check_batch(DescriptorList.of([(1, 8, 8)]), DescriptorList.of([(2, 8, 8)]), *LENGTHS,
                    sources_disjoint=True)  # fmt: skip
    both = join_batches([a, b], "ops")
    assert (both.num_bytes, both.sources_disjoint) == (16, True)
    assert both.dst.offsets.tolist() == [0, 8] and vouched(both.src, both.dst) == both
    assert both.part(a.src, a.dst) == a == vouched(a.src, a.dst)
    assert join_batches([a], "ops") is a
    again = check_batch(DescriptorList.of([(1, 20, 8)]), DescriptorList.of([(2, 4, 8)]), *LENGTHS)
    with pytest.raises(PlanError, match=r"ops share destination bytes: region 2 \[0, \+8\)"):
        join_batches([a, again], "ops")
    with pytest.raises(PlanError, match=r"plans share source bytes: region 1 \[0, \+8\)"):
        refuse_shared([(a.src, a.dst), (a.src, DescriptorList.of([(2, 50, 8)]))], "plans")
    refuse_shared([(a.src, a.dst), (a.src, DescriptorList.of([(2, 50, 8)]))], "p", sources=False)


@pytest.fixture
def loopback():
    t = LocalTransport()
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    rs, rd = t.register(src).region_id, t.register(dst).region_id
    yield t, t.connect(t.metadata()), rs, rd, src, dst
    t.close()


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []

    def counting(*args: object, **kwargs: object) -> CheckedBatch:
        calls.append(1)
        return check_batch(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(core, "check_batch", counting)
    return calls


def test_a_raw_submit_is_checked_once_and_then_trusted(loopback, monkeypatch) -> None:
    t, peer, rs, rd, src, dst = loopback
    calls = _spy(monkeypatch)
    s = DescriptorList.of([(rs, 0, 16), (rs, 32, 16)])
    d = DescriptorList.of([(rd, 16, 16), (rd, 48, 16)])
    for _ in range(3):
        assert t.wait(t.submit(XferKind.WRITE, s, d, peer)).state is XferState.DONE
    assert len(calls) == 1  # the first submit checked the pair; the others found its proof
    assert torch.equal(dst[16:32], src[:16]) and torch.equal(dst[48:], src[32:48])
    bad = DescriptorList.of([(rd, 0, 16), (rd, 8, 16)])
    for _ in range(2):  # a refused pair leaves no proof: checked (and refused) every time
        with pytest.raises(PlanError, match="destination descriptors 0 and 1 overlap"):
            t.submit(XferKind.WRITE, s, bad, peer)
    assert len(calls) == 3
    assert (t.pinned_regions(), t.live_batches()) == (0, 0)


def test_a_vouched_pair_whose_region_was_deregistered_is_refused(loopback) -> None:
    t, peer, rs, rd, _, _ = loopback
    s, d = DescriptorList.of([(rs, 0, 16)]), DescriptorList.of([(rd, 0, 16)])
    assert t.wait(t.submit(XferKind.WRITE, s, d, peer)).state is XferState.DONE
    assert vouched(s, d) is not None
    t.deregister(rd)
    again = torch.zeros(64, dtype=torch.uint8)
    assert t.register(again).region_id != rd  # ids are never reused
    with pytest.raises(TransportError, match=f"region {rd} is not registered"):
        t.submit(XferKind.WRITE, s, d, peer)  # a stale peer table still lists it: pins refuse
    with pytest.raises(PlanError, match=rf"descriptors name unknown region\(s\) \[{rd}\]"):
        t.submit(XferKind.WRITE, s, d, t.connect(t.metadata()))  # the fresh table lacks it
    assert int(again.sum()) == 0
    assert (t.pinned_regions(), t.live_batches()) == (0, 0)


def test_loopback_still_refuses_a_destination_inside_a_source_of_a_vouched_pair(loopback) -> None:
    t, peer, rs, _, _, _ = loopback
    s, d = DescriptorList.of([(rs, 0, 8)]), DescriptorList.of([(rs, 4, 8)])
    check_batch(s, d, {rs: 64}, {rs: 64})  # vouched: paired and disjoint on each side
    with pytest.raises(PlanError, match="destination descriptor 0 overlaps a source range"):
        t.submit(XferKind.WRITE, s, d, peer)  # one memory: not a fact of the lists
    assert (t.pinned_regions(), t.live_batches()) == (0, 0)
