"""The state snapshot store: a host LRU written through to its own lower tiers (disk, real Redis:
private or shared); a snapshot comes back byte-exact from any, a corrupt one is a miss (never
wrong state), slots are reused least recently stored first without being lost or shared, a new
store re-indexes what the tiers hold (a restart), and a shared store's snapshots of another
engine are found by key."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
import torch

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.state_store import StateStore
from kvplane.offload.tiers.disk import DiskTier
from kvplane.offload.tiers.header import FINGERPRINT_BYTES
from kvplane.offload.tiers.remote import RemoteTier
from kvplane.offload.tiers.shared import SharedTier

NBYTES = 3 * 8 * 4  # [3 layers, 8] float32
FP = b"s" * FINGERPRINT_BYTES


def _snap(i: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).view(3, 8) + 100 * i


def _key(i: int) -> ChunkKey:
    return ChunkKey(bytes([i]) * 16)


def _disk(path: Path, slots: int, fp: bytes = FP) -> DiskTier:
    return DiskTier(path, slots, NBYTES, fp, direct_io=False)


def _as_f32(data: torch.Tensor | None) -> torch.Tensor:
    assert data is not None
    return data.view(torch.float32).view(3, 8)


def test_host_lru_keeps_exact_copies_and_evicts_the_oldest() -> None:
    store = StateStore(NBYTES, host_slots=2)
    snap = _snap(1)
    store.put(_key(1), snap)
    snap.add_(1)  # the store kept a copy
    store.put(_key(2), _snap(2))
    assert torch.equal(_as_f32(store.get(_key(1))), _snap(1))  # 1 is now the newest
    store.put(_key(3), _snap(3))
    assert _key(2) not in store and _key(1) in store and _key(3) in store
    assert store.held_run([_key(1), _key(3), _key(2), _key(1)]) == 2
    assert store.get(_key(2)) is None
    assert dict(store.counts) == {"stored": 3, "host_hits": 1, "misses": 1}
    store.check_integrity()


def test_disk_write_through_serves_what_the_host_evicted(tmp_path: Path) -> None:
    store = StateStore(NBYTES, host_slots=1, lower=[_disk(tmp_path / "s.kvc", 2)])
    for i in (1, 2, 3):  # disk holds 2: key 1's slot is reused for key 3
        store.put(_key(i), _snap(i))
    assert _key(1) not in store
    assert torch.equal(_as_f32(store.get(_key(2))), _snap(2))  # from disk, back on the host
    assert torch.equal(_as_f32(store.get(_key(2))), _snap(2))  # from the host
    assert torch.equal(_as_f32(store.get(_key(3))), _snap(3))  # disk again: 2 took the host
    assert (store.counts["disk_hits"], store.counts["host_hits"]) == (2, 1)
    store.check_integrity()
    store.close()


def test_a_corrupt_snapshot_on_disk_is_a_miss(tmp_path: Path) -> None:
    path = tmp_path / "s.kvc"
    store = StateStore(NBYTES, host_slots=1, lower=[_disk(path, 2)])
    store.put(_key(1), _snap(1))
    store.put(_key(2), _snap(2))  # key 1 is on disk only now
    with path.open("r+b") as fh:  # flip one payload byte of slot 0 (key 1)
        fh.seek(5)
        byte = fh.read(1)
        fh.seek(5)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert store.get(_key(1)) is None
    assert store.counts["corrupt"] == 1 and _key(1) not in store
    store.check_integrity()  # the slot went back to the free list
    store.close()


def test_bad_arguments_are_refused_before_anything_is_stored(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="host_slots"):
        StateStore(NBYTES, host_slots=0)
    small = DiskTier(tmp_path / "x", 1, 64, FP, direct_io=False)
    with pytest.raises(InvalidArgumentError, match="holds 64-byte slots, snapshots are 96"):
        StateStore(NBYTES, 1, [small])
    small.close()
    store = StateStore(NBYTES, host_slots=1)
    with pytest.raises(InvalidArgumentError, match="a state snapshot of 4 bytes"):
        store.put(_key(1), torch.zeros(1))
    assert _key(1) not in store and not store.counts


def test_a_new_store_reindexes_the_disk_tier(tmp_path: Path) -> None:
    """A restart: the file's valid snapshots are held again (slots and LRU order kept), a
    corrupt one is not, and the freed slots are reused."""
    path = tmp_path / "s.kvc"
    store = StateStore(NBYTES, host_slots=1, lower=[_disk(path, 3)])
    for i in (1, 2, 3):
        store.put(_key(i), _snap(i))
    store.close()
    _flip(path, 0)  # key 1's payload
    again = StateStore(NBYTES, host_slots=1, lower=[_disk(path, 3)])
    assert [_key(i) in again for i in (1, 2, 3)] == [False, True, True]
    assert again.held_run([_key(2), _key(3), _key(1)]) == 2
    assert torch.equal(_as_f32(again.get(_key(3))), _snap(3))
    again.put(_key(4), _snap(4))  # into key 1's freed slot: 2 and 3 stay
    assert [_key(i) in again for i in (2, 3, 4)] == [True, True, True]
    assert dict(again.counts) == {"disk_hits": 1, "stored": 1}
    again.check_integrity()
    again.close()


def _remote(url: str, ns: str, slots: int = 4) -> RemoteTier:
    return RemoteTier(url, slots, NBYTES, FP, namespace=ns, timeout_s=1.0, lease_s=2.0)


def test_redis_write_through_serves_after_a_restart_and_corrupt_is_a_miss(
    tmp_path: Path, redis_url: str, redis_namespace: str
) -> None:
    """Disk and a private Redis tier: a restart with Redis only finds every snapshot there;
    one whose payload was changed on the server is a miss; a corrupt disk copy falls through
    to the Redis one."""
    path, ns = tmp_path / "s.kvc", redis_namespace
    store = StateStore(NBYTES, host_slots=1, lower=[_disk(path, 4), _remote(redis_url, ns)])
    for i in (1, 2, 3):
        store.put(_key(i), _snap(i))
    store.check_integrity()
    store.close()
    client = redis.Redis.from_url(redis_url)
    client.setrange(f"{ns}:slot:0", 7, b"\xff")  # key 1's payload (slot 0)
    client.close()
    only = StateStore(NBYTES, host_slots=1, lower=[_remote(redis_url, ns)])
    assert only.held_run([_key(1), _key(2), _key(3)]) == 3  # headers only: read to verify
    assert only.get(_key(1)) is None
    assert torch.equal(_as_f32(only.get(_key(2))), _snap(2))
    assert dict(only.counts) == {"corrupt": 1, "misses": 1, "remote_hits": 1}
    assert _key(1) not in only
    only.check_integrity()
    only.close()
    _flip(path, 2)  # key 3's disk copy
    both = StateStore(NBYTES, host_slots=1, lower=[_disk(path, 4), _remote(redis_url, ns)])
    assert torch.equal(_as_f32(both.get(_key(3))), _snap(3))
    assert dict(both.counts) == {"remote_hits": 1}  # the disk re-index had dropped it
    both.put(_key(3), _snap(3))  # written back to the disk tier only (Redis holds it)
    assert both.counts["stored"] == 0
    both.check_integrity()
    both.close()
    disk = StateStore(NBYTES, host_slots=1, lower=[_disk(path, 4)])
    assert disk.held_run([_key(1), _key(2), _key(3)]) == 3
    assert torch.equal(_as_f32(disk.get(_key(3))), _snap(3))
    disk.close()


def test_a_shared_store_serves_another_engines_snapshots(
    redis_url: str, redis_namespace: str
) -> None:
    """Two engines on one shared namespace: what one publishes after the other started is
    found (discovered by key, adopted into this engine's slots) and read back exactly."""
    ns = redis_namespace
    mine = StateStore(NBYTES, 1, [SharedTier([redis_url], 2, NBYTES, FP, namespace=ns)])
    theirs = StateStore(NBYTES, 1, [SharedTier([redis_url], 4, NBYTES, FP, namespace=ns)])
    for i in (1, 2, 3):
        theirs.put(_key(i), _snap(i))
    assert mine.held_run([_key(1), _key(2), _key(3)]) == 2  # its 2 slots
    assert mine.counts["discovered"] == 2
    assert torch.equal(_as_f32(mine.get(_key(2))), _snap(2))
    assert torch.equal(_as_f32(mine.get(_key(1))), _snap(1))
    assert mine.counts["remote_hits"] == 2
    mine.check_integrity()
    theirs.close()
    mine.close()
    late = StateStore(NBYTES, 1, [SharedTier([redis_url], 4, NBYTES, FP, namespace=ns)])
    assert late.held_run([_key(1), _key(2), _key(3)]) == 3  # the re-index, no discovery
    assert "discovered" not in late.counts
    late.close()


def _flip(path: Path, slot: int) -> None:
    """Flip one payload byte of ``slot`` of a disk tier of ``NBYTES`` (buffered) slots."""
    probe = DiskTier(path.with_suffix(".probe"), 1, NBYTES, FP, direct_io=False)
    stride = probe.slot_stride
    probe.close()
    with path.open("r+b") as fh:
        fh.seek(slot * stride + 5)
        byte = fh.read(1)
        fh.seek(slot * stride + 5)
        fh.write(bytes([byte[0] ^ 0xFF]))
