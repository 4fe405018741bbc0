"""Tier sizes in bytes (GiB keys and vLLM's own cpu_bytes_to_use), turned into chunk slots."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvplane.errors import ConfigError
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.integrations.vllm.sizing import GIB, TierBytes, kv_block_bytes, slots_for, tier_bytes

CHUNK = 4 * 2 * 16 * 1024  # 4 blocks x 2 layers x 16 KiB pages = 128 KiB


def test_gib_and_vllm_byte_keys_give_byte_budgets() -> None:
    assert tier_bytes({"host_gib": 1.5, "disk_gib": "2", "remote_gib": 0.25}) == TierBytes(
        host=3 * GIB // 2, disk=2 * GIB, remote=GIB // 4
    )
    assert tier_bytes({"cpu_bytes_to_use": 10 * GIB}) == TierBytes(host=10 * GIB)
    assert tier_bytes({"cpu_bytes_to_use_per_rank": "4096"}) == TierBytes(
        host=4096, host_per_rank=True
    )
    assert tier_bytes({"host_slots": 8}) == TierBytes()
    assert not TierBytes().given and TierBytes(disk=1).given


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"host_slots": 64, "host_gib": 4},
            "the host tier is sized twice: give one of host_slots=64 and host_gib=4",
        ),
        (
            {"host_gib": 4, "cpu_bytes_to_use": 1 << 30},
            "the host tier is sized twice: give one of cpu_bytes_to_use=1073741824 and host_gib=4",
        ),
        (
            {"disk_slots": 9, "disk_gib": 1, "disk_path": "/x"},
            "the disk tier is sized twice: give one of disk_slots=9 and disk_gib=1",
        ),
        ({"remote_gib": 0}, "remote_gib must be a number > 0, got 0"),
        ({"host_gib": "lots"}, "host_gib must be a number > 0, got 'lots'"),
        ({"cpu_bytes_to_use": True}, "cpu_bytes_to_use must be a number > 0, got True"),
    ],
)
def test_a_tier_sized_twice_or_badly_is_one_config_error(
    extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_extra_config(extra, {})
    assert str(err.value) == message
    assert "\n" not in str(err.value)


def test_slots_are_derived_once_a_chunk_size_is_known() -> None:
    cfg = parse_extra_config(
        {"host_gib": 1, "disk_path": "/tmp/d.bin", "disk_gib": 1, "remote_slots": 7}, {}
    )
    assert cfg.offload.host_slots == 64  # the default until sized
    sized = cfg.sized(CHUNK)
    assert sized.tier_slots("host") == GIB // CHUNK == 8192
    assert sized.tier_slots("disk") == GIB // (CHUNK + 4096) == 7943
    assert sized.tier_slots("remote") == 7  # given in slots: kept
    assert parse_extra_config({"host_slots": 3}, {}).sized(CHUNK).tier_slots("host") == 3
    assert slots_for("host", 10_000, 5000) == 1  # a page-aligned slot: 8192 bytes
    assert slots_for("remote", 10_000, 5000) == 2


def test_with_tensor_parallel_ranks_an_engine_budget_is_split_and_a_per_rank_one_is_not() -> None:
    """vLLM's meaning: ``cpu_bytes_to_use`` (and every ``<tier>_gib``) is the engine's, all
    ranks together; ``cpu_bytes_to_use_per_rank`` is one rank's. ``CHUNK``: one rank's shard."""
    engine = parse_extra_config({"host_gib": 1, "disk_path": "/tmp/d.bin", "disk_gib": 1}, {})
    two = engine.sized(CHUNK, ranks=2)
    assert two.tier_slots("host") == GIB // 2 // CHUNK == 4096
    assert two.tier_slots("disk") == GIB // 2 // (CHUNK + 4096) == 3971
    per_rank = parse_extra_config({"cpu_bytes_to_use_per_rank": GIB}, {})
    assert per_rank.sized(CHUNK, ranks=2).tier_slots("host") == 8192
    assert (
        parse_extra_config({"cpu_bytes_to_use": GIB}, {}).sized(CHUNK, 4).tier_slots("host") == 2048
    )


def test_a_budget_below_one_chunk_is_refused() -> None:
    cfg = parse_extra_config({"cpu_bytes_to_use": 100_000}, {})
    with pytest.raises(ConfigError, match=r"host tier's 100000 bytes hold no chunk of 131072"):
        cfg.sized(CHUNK)


def test_block_bytes_come_from_vllms_kv_cache_config() -> None:
    spec = SimpleNamespace(page_size_bytes=16 * 1024)
    groups = [SimpleNamespace(layer_names=["a", "b"], kv_cache_spec=spec)]
    assert kv_block_bytes(SimpleNamespace(kv_cache_groups=groups)) == 2 * 16 * 1024
    with pytest.raises(ConfigError, match="need vLLM's kv_cache_config"):
        kv_block_bytes(None)
