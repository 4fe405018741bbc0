"""DiskTier: round trips (direct and buffered I/O), corruption is a MISS plus a metric,
re-index after restart, one process per file, and a writer SIGKILLed mid-write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from offload_testlib import key, keys

from kvplane.errors import InvalidArgumentError, OffloadError
from kvplane.ids import SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.tiers import ALIGN, DiskTier, HostTier, ReadOutcome, SyncPolicy, Tier

FP = bytes(range(16))
OK, CORRUPT, MISSING = ReadOutcome.OK, ReadOutcome.CORRUPT, ReadOutcome.MISSING


def pattern(i: int, n: int) -> torch.Tensor:
    return ((torch.arange(n, dtype=torch.int64) * 7 + i) % 251).to(torch.uint8)


def corrupt_count(m: MetricsRegistry, reason: str) -> float:
    return m.value("offload_corrupt_chunks", {"tier": "disk", "reason": reason}, "_total")


@pytest.mark.parametrize(
    ("chunk", "direct"), [(8192, True), (8192, False), (3000, True), (3000, False)]
)
def test_round_trip_direct_and_buffered(tmp_path: Path, chunk: int, direct: bool) -> None:
    tier = DiskTier(tmp_path / "slots", 4, chunk, FP, direct_io=direct)
    assert isinstance(tier, Tier) and tier.direct == direct
    host = HostTier(4, chunk)  # aligned buffers: direct I/O straight from/into host slots
    for i in range(3):
        host.slot(SlotId(i)).copy_(pattern(i, chunk))
    tier.write(
        [SlotId(2), SlotId(0), SlotId(3)], keys(0, 1, 2), [host.slot(SlotId(i)) for i in range(3)]
    )
    outs = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(3)]  # unaligned: bounce buffer
    assert tier.read([SlotId(2), SlotId(0), SlotId(3)], keys(0, 1, 2), outs) == [OK] * 3
    assert all(torch.equal(outs[i], pattern(i, chunk)) for i in range(3))
    host.buffer.zero_()
    assert tier.read([SlotId(0)], keys(1), [host.slot(SlotId(3))]) == [OK]
    assert torch.equal(host.slot(SlotId(3)), pattern(1, chunk))
    assert tier.read([SlotId(1)], keys(9), [outs[0]]) == [MISSING]  # never written
    tier.close()
    tier.close()  # idempotent


def test_sync_policy_data_round_trip(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "slots", 2, 4096, FP, sync=SyncPolicy.DATA)
    tier.write([SlotId(1)], keys(5), [pattern(5, 4096)])
    out = torch.zeros(4096, dtype=torch.uint8)
    assert tier.read([SlotId(1)], keys(5), [out]) == [OK] and torch.equal(out, pattern(5, 4096))
    tier.close()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("flip_payload", "checksum"),
        ("torn_overwrite", "checksum"),
        ("flip_header", "header"),
        ("truncate", "truncated"),
        ("wrong_key", "key"),
    ],
)
def test_damage_is_a_miss_and_a_metric_never_wrong_bytes(
    tmp_path: Path, damage: str, reason: str
) -> None:
    m = MetricsRegistry()
    path = tmp_path / "slots"
    chunk = 8192
    tier = DiskTier(path, 2, chunk, FP, metrics=m, direct_io=False)
    tier.write([SlotId(0), SlotId(1)], keys(0, 1), [pattern(0, chunk), pattern(1, chunk)])
    stride = tier.slot_stride
    with path.open("r+b") as f:
        if damage == "flip_payload":
            f.seek(stride + 1234)
            b = f.read(1)
            f.seek(stride + 1234)
            f.write(bytes([b[0] ^ 0x10]))
        elif damage == "torn_overwrite":  # a new payload half-written under the old header
            f.seek(stride)
            f.write(pattern(7, chunk).numpy().tobytes()[: chunk // 2])
        elif damage == "flip_header":
            f.seek(stride + chunk + 40)
            b = f.read(1)
            f.seek(stride + chunk + 40)
            f.write(bytes([b[0] ^ 0x01]))
        elif damage == "truncate":
            f.truncate(stride + chunk // 2)
    asked = key(0) if damage == "wrong_key" else key(1)
    out = torch.zeros(chunk, dtype=torch.uint8)
    outcomes = tier.read(
        [SlotId(0), SlotId(1)], [key(0), asked], [torch.zeros(chunk, dtype=torch.uint8), out]
    )
    assert outcomes == [OK, CORRUPT]
    assert corrupt_count(m, reason) == 1
    tier.close()
    # After a restart the damaged chunk is not re-indexed; the intact one is.
    m2 = MetricsRegistry()
    again = DiskTier(path, 2, chunk, FP, metrics=m2, direct_io=False)
    assert again.scan() == ({key(0): 0} if damage != "wrong_key" else {key(0): 0, key(1): 1})
    again.close()


def test_restart_reindexes_only_valid_chunks_of_this_layout(tmp_path: Path) -> None:
    path = tmp_path / "slots"
    tier = DiskTier(path, 4, 4096, FP)
    tier.write(
        [SlotId(3), SlotId(1), SlotId(0)], keys(0, 1, 2), [pattern(i, 4096) for i in range(3)]
    )
    with pytest.raises(OffloadError, match="in use"):
        DiskTier(path, 4, 4096, FP)  # a second owner of the same file
    tier.close()
    again = DiskTier(path, 4, 4096, FP)
    assert again.scan() == {key(0): 3, key(1): 1, key(2): 0}
    again.close()
    m = MetricsRegistry()
    other = DiskTier(path, 4, 4096, bytes(16), metrics=m)  # another layout fingerprint
    assert other.scan() == {}
    assert m.value("offload_corrupt_chunks", {"tier": "disk", "reason": "layout"}, "_total") == 3
    other.close()


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        DiskTier(tmp_path / "a", 0, 4096, FP)
    with pytest.raises(InvalidArgumentError):
        DiskTier(tmp_path / "a", 1, 4096, b"short")
    with pytest.raises(InvalidArgumentError):
        DiskTier(tmp_path / "a", 1, 4096, FP, sync="none")  # type: ignore[arg-type]
    with pytest.raises(OffloadError, match="cannot be opened"):
        DiskTier(tmp_path / "missing-dir" / "a", 1, 4096, FP)
    tier = DiskTier(tmp_path / "b", 1, 4096, FP)
    with pytest.raises(InvalidArgumentError):
        tier.write([SlotId(1)], keys(0), [pattern(0, 4096)])
    tier.close()
    with pytest.raises(OffloadError, match="closed"):
        tier.read([SlotId(0)], keys(0), [pattern(0, 4096)])


CHILD = textwrap.dedent(
    """
    import hashlib, sys, torch
    from kvplane.offload.tiers import DiskTier, SyncPolicy
    path, chunk, sync = sys.argv[1], int(sys.argv[2]), SyncPolicy(sys.argv[3])
    tier = DiskTier(path, 4, chunk, bytes(range(16)), sync=sync, direct_io=False)
    for i in range(100000):
        k = hashlib.blake2b(i.to_bytes(4, "little"), digest_size=32).digest()
        payload = ((torch.arange(chunk, dtype=torch.int64) * 7 + i) % 251).to(torch.uint8)
        print("begin", i, flush=True)
        tier.write([i % 4], [k], [payload])
        print("done", i, flush=True)
    """
)


@pytest.mark.parametrize("sync", [SyncPolicy.DATA, SyncPolicy.NONE])
def test_writer_killed_mid_write_leaves_no_ready_torn_chunk(
    tmp_path: Path, sync: SyncPolicy
) -> None:
    path = tmp_path / "slots"
    chunk = 4 << 20  # large (and with DATA an fdatasync before the header): a wide window
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(chunk), sync.value],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    victim = -1
    for line in proc.stdout:
        word, num = line.split()
        if word == "begin" and int(num) >= 6:  # every slot holds a chunk; this overwrites one
            victim = int(num)
            break
    stride = chunk + ALIGN
    fd = os.open(path, os.O_RDONLY)
    for _ in range(200000):  # kill once the new payload has started to land
        if os.pread(fd, 1, (victim % 4) * stride) == bytes([victim % 251]):
            break
    os.kill(proc.pid, signal.SIGKILL)
    os.close(fd)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL and victim >= 6
    tier = DiskTier(path, 4, chunk, FP, direct_io=False)
    found = tier.scan()
    assert {s for s in found.values()} >= {s for s in range(4) if s != victim % 4}
    # The slot under the killed write holds either nothing valid (torn: old header over a
    # partly new payload) or the whole new chunk, never the old key over new bytes.
    at_victim = [k for k, s in found.items() if s == victim % 4]
    assert at_victim in ([], [key(victim)])
    written = {key(i): i for i in range(victim + 1)}
    out = torch.empty(chunk, dtype=torch.uint8)
    for k, slot in found.items():
        i = written[k]
        assert i % 4 == slot and victim - 4 < i <= victim  # the newest write of its slot
        assert tier.read([slot], [k], [out]) == [OK]
        assert torch.equal(out, pattern(i, chunk))  # a READY chunk is never torn
    tier.close()
