"""``codec = "auto"``: the rule on given fits, the measured choice at its two extremes, and a
tier opened with it (lossy codecs are never chosen)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvplane.errors import ConfigError
from kvplane.layout import KVLayout
from kvplane.offload import OffloadConfig
from kvplane.offload.codecs import ChunkFormat, CodecSpeed, codec_fit
from kvplane.offload.codecs.auto import auto_codec, choose, sample_chunks
from kvplane.offload.codecs.lossless import engine_support
from kvplane.offload.tiers import DiskTier
from kvplane.offload.tiers.registry import open_lower_tiers

FMT = ChunkFormat(torch.bfloat16, 4, 2, 2, 16, 2, 64)  # 64 KiB
LOSSLESS = {
    name for name, mod in (("lz4", "lz4"), ("zstd", "zstandard")) if not engine_support(mod)
}


def test_the_rule_takes_the_supported_codec_with_most_to_spare() -> None:
    fits = [
        codec_fit(CodecSpeed("lz4", 8.0, 8.0, 0.6), 1.0),  # store 1/(1/8+0.6) = 1.38
        codec_fit(CodecSpeed("zstd", 4.0, 6.0, 0.5), 1.0),  # store 1/(1/4+0.5) = 1.33
        codec_fit(CodecSpeed("slow", 1.0, 1.0, 0.1), 1.0),  # store 0.91: does not keep up
    ]
    assert choose(fits) == "lz4"
    assert choose(fits[2:]) == "raw" and choose([]) == "raw"


@pytest.mark.skipif(not LOSSLESS, reason="neither lz4 nor zstandard is installed")
def test_a_slow_tier_gets_a_lossless_codec_and_a_fast_one_stays_raw() -> None:
    samples = sample_chunks(FMT, 2)
    assert [s.numel() for s in samples] == [FMT.nbytes] * 2 and samples[0].dtype == torch.uint8
    slow = auto_codec(FMT, 1e-6, samples)
    assert slow.codec in LOSSLESS
    assert sorted(f.speed.codec.split(":")[0] for f in slow.fits) == sorted(LOSSLESS)
    fast = auto_codec(FMT, 1e6, samples)
    assert fast.codec == "raw" and len(fast.fits) == len(LOSSLESS)
    with pytest.raises(ConfigError, match="codec 'auto' needs the tier's measured GB/s"):
        auto_codec(FMT, 0.0)


def test_a_tier_configured_auto_opens_with_its_choice(tmp_path: Path) -> None:
    layout = KVLayout.gqa(num_blocks=8, block_size=16, num_layers=2, kv_heads=2, head_dim=64)
    chunk = 4 * layout.bytes_per_block
    cfg = OffloadConfig(disk_path=tmp_path / "s", disk_codec="auto", disk_gbps=1e6)
    (tier,) = open_lower_tiers(cfg, chunk, layout.fingerprint(), layout=layout)
    assert isinstance(tier, DiskTier) and tier.codec == "raw"  # nothing keeps 1 PB/s up
    tier.close()
    with pytest.raises(ConfigError, match="needs the tier's measured GB/s"):
        open_lower_tiers(OffloadConfig(disk_path=tmp_path / "t", disk_codec="auto"), chunk,
                         layout.fingerprint(), layout=layout)  # fmt: skip
    with pytest.raises(ConfigError, match=r"is not one of \['raw', .*'auto'\]"):
        OffloadConfig(remote_codec="best")
