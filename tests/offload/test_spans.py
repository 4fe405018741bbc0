"""Spans: tier keys from host keys, the span-aware lookup, and the book's re-chunked decisions
(whole groups written down, one tier chunk promoted into its host chunks, pins per piece)."""

from __future__ import annotations

import pytest
from offload_testlib import key, keys

from kvplane.errors import ConfigError, IllegalTransitionError, InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload import OffloadConfig, Promotion, SlotStatus, TierBook, TierWrite, WriteDown
from kvplane.offload.spans import cover, groups, members, tier_spans


def test_tier_spans_are_multiples_of_the_host_chunk() -> None:
    assert tier_spans(4, {"disk": 16, "remote": 0}) == {"disk": 4, "remote": 1}
    with pytest.raises(ConfigError, match="disk_blocks_per_chunk = 6 is not a multiple of"):
        tier_spans(4, {"disk": 6})
    with pytest.raises(ConfigError, match="remote_blocks_per_chunk must be an int >= 0"):
        tier_spans(4, {"remote": -4})


def test_groups_are_aligned_to_the_sequence_and_keyed_by_their_last_chunk() -> None:
    ks = keys(0, 1, 2, 3, 4)
    assert groups(ks, 2) == [(0, key(1)), (2, key(3))]
    assert groups(ks, 2, first=1) == [(1, key(2)), (3, key(4))]
    assert groups(ks, 1) == [(i, key(i)) for i in range(5)]
    assert cover(ks, 4) == [key(3)] * 4 + [None]
    assert members(ks, 1, 2) == (key(1), key(2))
    with pytest.raises(InvalidArgumentError):
        members(ks, 4, 2)


def spanned(disk: int = 2, remote: int = 4, host_slots: int = 8) -> TierBook:
    cfg = OffloadConfig(host_slots=host_slots, admission_min_lookups=0)
    return TierBook.build(cfg, [("disk", 4), ("remote", 4)], spans={"disk": disk, "remote": remote})


def stored(b: TierBook, ks: list[ChunkKey], fresh: list[ChunkKey] | None = None) -> WriteDown:
    res = b.reserve_store(ks, write_through=False)
    assert res is not None
    b.gathered(res.keys, (), [True] * len(res.keys))
    down = b.write_down(ks, fresh=fresh)
    for write in down.writes:
        b.written(down.keys, write, [True] * len(ks), [True] * len(write.indices))
    return down


def test_a_write_down_writes_whole_groups_and_pins_each_member() -> None:
    b = spanned()
    res = b.reserve_store(keys(0, 1, 2, 3, 4), write_through=False)
    assert res is not None
    b.gathered(res.keys, (), [True] * 5)
    down = b.write_down(keys(0, 1, 2, 3, 4))
    assert down.writes == (
        TierWrite("disk", (0, 2), (0, 1), 2),
        TierWrite("remote", (0,), (0,), 4),
    )
    assert b.host.table.readers(key(0)) == 2 and b.host.table.readers(key(4)) == 0
    assert b.lower["disk"].status(key(3)) is SlotStatus.STORING
    b.written(down.keys, down.writes[0], [True] * 5, [True, False])
    assert b.lower["disk"].status(key(1)) is SlotStatus.READY
    assert b.lower["disk"].status(key(3)) is SlotStatus.EMPTY
    b.written(down.keys, down.writes[1], [True] * 5, [True])
    assert b.host.table.readers(key(0)) == 0
    b.check_integrity(idle=True)


def test_only_groups_holding_a_fresh_chunk_go_down() -> None:
    b = spanned(remote=2)
    stored(b, keys(0, 1), fresh=[key(0)])
    down = stored(b, keys(0, 1, 2, 3), fresh=[key(3)])
    assert [w.indices for w in down.writes] == [(2,), (2,)]
    with pytest.raises(IllegalTransitionError, match="host holds no good copy"):
        b.write_down(keys(0, 1), fresh=[key(9)])


def test_lookup_and_load_find_a_tier_chunk_from_its_host_keys() -> None:
    b = spanned()
    stored(b, keys(0, 1, 2, 3, 4))
    b.host.evict(keys(0, 1, 2, 3, 4))
    found = b.lookup(keys(0, 1, 2, 3, 4))
    assert found.where == ("disk", "disk", "disk", "disk", None) and found.hit_run == 4
    assert b.lookup(keys(0)).where == (None,)  # one key makes no group
    assert b.sources(keys(0, 1, 2)) == ["disk", "disk", None]
    res = b.reserve_load(keys(0, 1, 2, 3), limit=3)
    assert res.keys == tuple(keys(0, 1, 2))
    assert res.promotions == (
        Promotion(0, "disk", 0, key(1), 0),
        Promotion(1, "disk", 0, key(1), 1),
        Promotion(2, "disk", 1, key(3), 0),
    )
    assert b.lower["disk"].table.readers(key(1)) == 2
    assert b.promoted("disk", keys(0, 1), [True, True], pin=False) == tuple(keys(0, 1))
    assert b.lower["disk"].table.readers(key(1)) == 0
    with pytest.raises(IllegalTransitionError, match="is no promotion from 'remote'"):
        b.promoted("remote", keys(2), [True], pin=False)
    b.promoted("disk", keys(2), [False], pin=False)  # read back bad: the tier chunk is dropped
    assert b.lower["disk"].status(key(3)) is SlotStatus.EMPTY
    assert b.host.status(key(2)) is SlotStatus.EMPTY
    b.check_integrity(idle=True)


def test_an_executor_of_one_size_refuses_per_tier_sizes() -> None:
    cfg = OffloadConfig(disk_blocks_per_chunk=8)
    with pytest.raises(ConfigError, match="leave them 0"):
        TierBook.build(cfg, [("disk", 4)])
    with pytest.raises(InvalidArgumentError, match="write-through stores need every lower"):
        spanned().reserve_store(keys(0), write_through=True)
    with pytest.raises(ConfigError, match="remote_blocks_per_chunk must be an int >= 0"):
        OffloadConfig(remote_blocks_per_chunk=-1)
