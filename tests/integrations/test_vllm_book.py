"""TierBook: the scheduler-side slot protocol of the tier cascade, on its own."""

from __future__ import annotations

from pathlib import Path

from kvplane.config import ChunkConfig, HashConfig
from kvplane.ids import ChunkKey
from kvplane.integrations.vllm.book import TierBook
from kvplane.integrations.vllm.config import ConnectorConfig
from kvplane.offload.config import OffloadConfig
from kvplane.offload.policies.arc import ARCPolicy


def keys(*idx: int) -> list[ChunkKey]:
    return [ChunkKey(bytes([i + 1]) * 32) for i in idx]


def book(tmp_path: Path, policy: str = "lru", host_slots: int = 4) -> TierBook:
    offload = OffloadConfig(
        host_slots=host_slots, policy=policy, disk_path=str(tmp_path / "d"), disk_slots=4
    )
    return TierBook(ConnectorConfig(offload, ChunkConfig(), HashConfig()))


def test_arc_counts_neither_the_write_through_nor_a_promotion_as_a_hit(tmp_path: Path) -> None:
    b = book(tmp_path, "arc")
    arc = b.host.policy
    assert isinstance(arc, ARCPolicy)
    b.record_lookup(keys(0, 1))
    res = b.reserve_store(keys(0, 1))
    assert res is not None and [w.tier for w in res.writes] == ["disk"]
    b.gathered(res.keys, res.writes, [True, True])  # host pins both for the disk write
    assert (arc.t1, arc.t2) == (keys(0, 1), [])  # stored once, never requested: T1
    b.written(res.keys, res.writes[0], [True, True], [True, True])
    assert (arc.t1, arc.t2) == (keys(0, 1), [])
    load = b.reserve_load(keys(0))
    b.loaded(load.keys, load.promotions, [True])
    assert (arc.t1, arc.t2) == (keys(1), keys(0))  # a requested load is a hit
    b.check_integrity(idle=True)
