"""The state snapshot store: a host LRU written through to its own disk tier; a snapshot comes
back byte-exact from either, a corrupt one is a miss (never wrong state), and disk
slots are reused least recently stored first without being lost or shared."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvplane.errors import InvalidArgumentError
from kvplane.ids import ChunkKey
from kvplane.offload.state_store import StateStore
from kvplane.offload.tiers.disk import DiskTier
from kvplane.offload.tiers.header import FINGERPRINT_BYTES

NBYTES = 3 * 8 * 4  # [3 layers, 8] float32
FP = b"s" * FINGERPRINT_BYTES


def _snap(i: int) -> torch.Tensor:
    return torch.arange(24, dtype=torch.float32).view(3, 8) + 100 * i


def _key(i: int) -> ChunkKey:
    return ChunkKey(bytes([i]) * 16)


def _disk(path: Path, slots: int, fp: bytes = FP) -> DiskTier:
    return DiskTier(path, slots, NBYTES, fp, direct_io=False, name="disk_state")


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
    store = StateStore(NBYTES, host_slots=1, disk=_disk(tmp_path / "s.kvc", 2))
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
    store = StateStore(NBYTES, host_slots=1, disk=_disk(path, 2))
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
    with pytest.raises(InvalidArgumentError, match="holds 64-byte slots, snapshots are 96"):
        StateStore(NBYTES, 1, DiskTier(tmp_path / "x", 1, 64, FP, direct_io=False))
    store = StateStore(NBYTES, host_slots=1)
    with pytest.raises(InvalidArgumentError, match="a state snapshot of 4 bytes"):
        store.put(_key(1), torch.zeros(1))
    assert _key(1) not in store and not store.counts
