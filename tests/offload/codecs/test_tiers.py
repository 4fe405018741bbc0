"""Codecs through the disk and Redis tiers: lossless round trips byte-exact (hypothesis over
formats and dtypes), raw fallback per chunk, lossy chunks decoded as the codec decodes them,
re-index, and a tier of another codec is a miss, never garbage."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import redis
import torch
from codecs_testlib import ALL_DTYPES, chunk_of, formats
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from offload_testlib import key, keys, tiny_layout

from kvplane.errors import ConfigError
from kvplane.ids import SlotId
from kvplane.metrics import MetricsRegistry
from kvplane.offload.codecs import ChunkCoder, ChunkFormat, make_codec
from kvplane.offload.config import OffloadConfig
from kvplane.offload.tiers import DiskTier, HostTier, ReadOutcome, RemoteTier
from kvplane.offload.tiers.header import ChunkHeader, payload_checksum
from kvplane.offload.tiers.registry import open_lower_tiers

FP = bytes(range(16))
OK, CORRUPT = ReadOutcome.OK, ReadOutcome.CORRUPT
LOSSLESS = ("raw", "zstd", "lz4")
FIXTURES = [HealthCheck.function_scoped_fixture]
_files = itertools.count()


def _payloads(fmt: ChunkFormat, seed: int) -> list[torch.Tensor]:
    """A compressible chunk (values or zeros), then noise (stored raw by every codec)."""
    noise = torch.randint(0, 256, (fmt.nbytes,), dtype=torch.uint8)
    first = chunk_of(fmt, seed) if fmt.dtype.is_floating_point else torch.zeros_like(noise)
    return [first, noise]


def _expected(coder: ChunkCoder, chunk: torch.Tensor) -> torch.Tensor:
    """What a read of ``chunk`` must give: the codec's own round trip."""
    enc = coder.encode(chunk)
    out = torch.empty_like(chunk)
    assert coder.decode(enc.tag, enc.data, out)
    return out


def _corrupt(m: MetricsRegistry, tier: str, reason: str) -> float:
    return m.value("offload_corrupt_chunks", {"tier": tier, "reason": reason}, "_total")


@settings(max_examples=20, deadline=None, suppress_health_check=FIXTURES)
@given(formats(ALL_DTYPES), st.integers(0, 2**31), st.sampled_from(LOSSLESS), st.booleans())
def test_lossless_disk_round_trips_are_byte_exact(
    tmp_path: Path, fmt: ChunkFormat, seed: int, codec: str, direct: bool
) -> None:
    coder = ChunkCoder(make_codec(codec), fmt)
    path = tmp_path / f"slots{next(_files)}"
    payloads = _payloads(fmt, seed)
    tier = DiskTier(path, 3, fmt.nbytes, FP, direct_io=direct, coder=coder)
    host = HostTier(2, fmt.nbytes)  # aligned outs: direct reads straight into them
    try:
        tier.write([SlotId(2), SlotId(0)], keys(1, 2), payloads)
        outs = [host.slot(SlotId(0)), torch.empty(fmt.nbytes, dtype=torch.uint8)]
        assert tier.read([SlotId(2), SlotId(0)], keys(1, 2), outs) == [OK, OK]
        assert all(torch.equal(o, p) for o, p in zip(outs, payloads, strict=True))
    finally:
        tier.close()
    again = DiskTier(path, 3, fmt.nbytes, FP, direct_io=direct, coder=coder)
    assert again.scan() == {key(1): SlotId(2), key(2): SlotId(0)}
    again.close()


@pytest.mark.parametrize("codec", ["fp8", "fp8-chunk", "int8"])
@pytest.mark.parametrize("direct", [True, False])
def test_lossy_disk_reads_decode_as_the_codec_does(
    tmp_path: Path, codec: str, direct: bool
) -> None:
    fmt = ChunkFormat.of(tiny_layout(), 2 * 2048)
    coder = ChunkCoder(make_codec(codec), fmt)
    tier = DiskTier(tmp_path / "slots", 2, fmt.nbytes, FP, direct_io=direct, coder=coder)
    chunk = chunk_of(fmt, 7)
    tier.write([SlotId(1)], keys(3), [chunk])
    out = torch.empty_like(chunk)
    assert tier.read([SlotId(1)], keys(3), [out]) == [OK]
    assert torch.equal(out, _expected(coder, chunk)) and not torch.equal(out, chunk)
    tier.close()


def test_a_disk_tier_of_another_codec_is_a_miss(tmp_path: Path) -> None:
    fmt = ChunkFormat.of(tiny_layout(), 2048)
    chunk = chunk_of(fmt, 1)
    path = tmp_path / "slots"
    tier = DiskTier(path, 2, fmt.nbytes, FP, coder=ChunkCoder(make_codec("zstd"), fmt))
    tier.write([SlotId(0)], keys(1), [chunk])
    tier.close()
    out = torch.empty_like(chunk)
    for other in ("lz4", "raw", "fp8"):
        m = MetricsRegistry()
        tier = DiskTier(path, 2, fmt.nbytes, FP, coder=ChunkCoder(make_codec(other), fmt),
                        metrics=m)  # fmt: skip
        assert tier.read([SlotId(0)], keys(1), [out]) == [CORRUPT]
        assert tier.scan() == {} and _corrupt(m, "disk", "layout") == 2
        tier.close()
    tier = DiskTier(path, 2, fmt.nbytes, FP, coder=ChunkCoder(make_codec("zstd"), fmt))
    assert tier.read([SlotId(0)], keys(1), [out]) == [OK] and torch.equal(out, chunk)
    tier.close()


def test_a_damaged_coded_payload_on_disk_is_corrupt(tmp_path: Path) -> None:
    fmt = ChunkFormat.of(tiny_layout(), 2048)
    m = MetricsRegistry()
    path = tmp_path / "slots"
    tier = DiskTier(path, 1, fmt.nbytes, FP, coder=ChunkCoder(make_codec("lz4"), fmt), metrics=m)
    tier.write([SlotId(0)], keys(1), [torch.zeros(fmt.nbytes, dtype=torch.uint8)])
    with path.open("r+b") as f:
        f.seek(3)
        f.write(b"\xff")
    out = torch.empty(fmt.nbytes, dtype=torch.uint8)
    assert tier.read([SlotId(0)], keys(1), [out]) == [CORRUPT]
    assert _corrupt(m, "disk", "checksum") == 1
    tier.close()


@settings(max_examples=8, deadline=None, suppress_health_check=FIXTURES)
@given(formats(ALL_DTYPES), st.integers(0, 2**31), st.sampled_from(LOSSLESS))
def test_lossless_redis_round_trips_are_byte_exact(
    redis_url: str, redis_namespace: str, fmt: ChunkFormat, seed: int, codec: str
) -> None:
    coder = ChunkCoder(make_codec(codec), fmt)
    payloads = _payloads(fmt, seed)
    tier = RemoteTier(redis_url, 3, fmt.nbytes, FP, namespace=redis_namespace, coder=coder)
    try:
        tier.clear()
        tier.write([SlotId(1), SlotId(2)], keys(1, 2), payloads)
        outs = [torch.empty(fmt.nbytes, dtype=torch.uint8) for _ in payloads]
        assert tier.read([SlotId(1), SlotId(2)], keys(1, 2), outs) == [OK, OK]
        assert all(torch.equal(o, p) for o, p in zip(outs, payloads, strict=True))
        assert tier.scan() == {key(1): SlotId(1), key(2): SlotId(2)}
    finally:
        tier.close()


def test_redis_lossy_reads_mismatched_codecs_and_undecodable_payloads(
    redis_url: str, redis_namespace: str
) -> None:
    fmt = ChunkFormat.of(tiny_layout(), 2 * 2048)
    coder = ChunkCoder(make_codec("int8"), fmt)
    chunk = chunk_of(fmt, 4)
    out = torch.empty_like(chunk)
    m = MetricsRegistry()
    tier = RemoteTier(redis_url, 2, fmt.nbytes, FP, namespace=redis_namespace, coder=coder,
                      metrics=m)  # fmt: skip
    try:
        tier.write([SlotId(0)], keys(1), [chunk])
        assert tier.read([SlotId(0)], keys(1), [out]) == [OK]
        assert torch.equal(out, _expected(coder, chunk))
        junk = b"\x01" * 100  # the right CRC and stored length, but not an int8 frame
        header = ChunkHeader(key(2), tier.fingerprint, fmt.nbytes, payload_checksum(junk),
                             coder.tag, len(junk))  # fmt: skip
        raw = redis.Redis.from_url(redis_url)
        raw.set(f"{redis_namespace}:slot:1", junk)
        raw.set(f"{redis_namespace}:slot:1:h", header.encode())
        raw.close()
        assert tier.read([SlotId(1)], keys(2), [out]) == [CORRUPT]
        assert _corrupt(m, "remote", "codec") == 1
    finally:
        tier.close()
    fp8 = ChunkCoder(make_codec("fp8"), fmt)
    other = RemoteTier(redis_url, 2, fmt.nbytes, FP, namespace=redis_namespace, coder=fp8,
                       metrics=m)  # fmt: skip
    try:
        assert other.read([SlotId(0)], keys(1), [out]) == [CORRUPT]
        assert other.scan() == {}  # the read and the re-index of both slots: "layout" faults
        assert _corrupt(m, "remote", "layout") == 3
    finally:
        other.close()


def test_open_lower_tiers_codes_each_tier_as_configured(tmp_path: Path) -> None:
    layout = tiny_layout()
    cfg = OffloadConfig(disk_path=tmp_path / "slots", disk_slots=2, disk_codec="fp8")
    with pytest.raises(ConfigError, match="disk_codec = 'fp8' needs the pool's layout"):
        open_lower_tiers(cfg, 2048, layout.fingerprint())
    (tier,) = open_lower_tiers(cfg, 2048, layout.fingerprint(), layout=layout)
    assert isinstance(tier, DiskTier) and tier.codec == "fp8:e4m3fn:scale=channel:rotate=hadamard"
    assert tier.fingerprint != layout.fingerprint()
    tier.close()
    (plain,) = open_lower_tiers(OffloadConfig(disk_path=tmp_path / "b"), 2048, FP)
    assert isinstance(plain, DiskTier) and (plain.codec, plain.fingerprint) == ("raw", FP)
    plain.close()
