"""The connector's kv_connector_extra_config parsing (the vLLM range: test_vllm_versions.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplane.errors import ConfigError, UnsupportedError
from kvplane.integrations.vllm.config import parse_extra_config
from kvplane.offload.tiers.base import SyncPolicy


def test_defaults() -> None:
    cfg = parse_extra_config(None, {})
    assert cfg.blocks_per_chunk == 4
    assert cfg.hashing.seed == 0
    assert cfg.offload.host_slots == 64
    assert cfg.lower_tiers == ()
    assert cfg.metrics_port == 0
    assert cfg.tier_slots("host") == 64
    assert cfg.load_mode == "auto"
    assert parse_extra_config({"load_mode": "async"}, {}).load_mode == "async"


def test_every_section_from_one_flat_mapping() -> None:
    cfg = parse_extra_config(
        {
            "blocks_per_chunk": 2,
            "hash_seed": 7,
            "host_slots": 8,
            "disk_path": "/tmp/x.bin",
            "disk_slots": 5,
            "disk_sync": "data",
            "remote_url": "redis://127.0.0.1:1/0",
            "remote_slots": 3,
            "policy": "arc",
            "metrics_port": "9100",
        },
        {},
    )
    assert cfg.blocks_per_chunk == 2
    assert cfg.hashing.seed == 7
    assert cfg.offload.disk_path == Path("/tmp/x.bin")
    assert cfg.offload.disk_sync is SyncPolicy.DATA
    assert cfg.offload.policy == "arc"
    assert cfg.lower_tiers == ("disk", "remote")
    assert [cfg.tier_slots(t) for t in ("host", "disk", "remote")] == [8, 5, 3]
    assert cfg.metrics_port == 9100
    assert parse_extra_config({"metrics_port": 65534}, {}).metrics_port == 65534


def test_the_extra_config_beats_the_environment_which_fills_in_the_rest() -> None:
    env = {"KVPLANE_OFFLOAD_HOST_SLOTS": "32", "KVPLANE_OFFLOAD_DISK_SLOTS": "9"}
    cfg = parse_extra_config({"host_slots": 8}, env)
    assert cfg.offload.host_slots == 8  # the engine's explicit value (flag > env)
    assert cfg.offload.disk_slots == 9  # not given per engine: the environment's
    chunk_env = {"KVPLANE_CHUNK_BLOCKS_PER_CHUNK": "2"}
    assert parse_extra_config({}, chunk_env).blocks_per_chunk == 2
    assert parse_extra_config({"blocks_per_chunk": 8}, chunk_env).blocks_per_chunk == 8


def test_an_empty_environment_variable_is_unset() -> None:
    cfg = parse_extra_config({}, {"KVPLANE_OFFLOAD_DISK_PATH": ""})
    assert cfg.offload.disk_path is None and cfg.lower_tiers == ()
    cfg = parse_extra_config({"disk_path": "/data/kv.bin"}, {"KVPLANE_OFFLOAD_DISK_PATH": ""})
    assert cfg.offload.disk_path == Path("/data/kv.bin")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"host_slot": 8}, "host_slot"),
        ({"blocks_per_chunk": 0}, "blocks_per_chunk"),
        ({"host_slots": -1}, "host_slots"),
        ({"policy": "fifo"}, "fifo"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"metrics_port": 65535}, r"\[0, 65534\]"),  # the scheduler side serves on port + 1
        ({"metrics_port": "x"}, "metrics_port"),
        (
            {"load_mode": "lazy"},
            r"load_mode must be one of \['sync', 'async', 'auto'\], got 'lazy'",
        ),
        ({"load_mode": True}, "load_mode"),
    ],
)
def test_bad_values_name_themselves(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_extra_config(extra, {})


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        parse_extra_config(["host_slots"], {})  # type: ignore[arg-type]


def test_unknown_tier_name() -> None:
    with pytest.raises(ConfigError, match="ssd"):
        parse_extra_config({}, {}).tier_slots("ssd")


def test_the_connector_module_without_vllm_is_a_typed_unsupported_error() -> None:
    import importlib
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed in this environment")
    with pytest.raises(UnsupportedError, match=r"scripts/vllm-venv\.sh"):
        importlib.import_module("kvplane.integrations.vllm.connector")


@pytest.mark.parametrize("port", [True, 1.0, -1, 65535, "x", "9100.0", None])
def test_a_bad_metrics_port_is_worded_once(port: object) -> None:
    shown = "'x'" if port == "x" else repr(port)
    with pytest.raises(ConfigError) as err:
        parse_extra_config({"metrics_port": port}, {})
    assert str(err.value) == (
        "metrics_port (the scheduler side serves on the next port) must be an int in "
        f"[0, 65534], got {shown}"
    )


def test_a_metrics_port_string_is_read_as_an_int() -> None:
    assert parse_extra_config({"metrics_port": "0"}, {}).metrics_port == 0
    assert parse_extra_config({"metrics_port": " 65534 "}, {}).metrics_port == 65534


TUNED = {  # what `kvplane tune chunks --write` puts under [tune.chunks]
    "block_bytes": 16384,
    "max_overhead": 0.1,
    "min_chunks": 64,
    "host_blocks_per_chunk": 16,
    "disk_blocks_per_chunk": 64,
    "remote_blocks_per_chunk": 128,
    "disk_gbps": 0.49,
    "remote_gbps": 1.39,
}
TIERS = {"disk_path": "/tmp/x.bin", "remote_url": "redis://127.0.0.1:1/0"}


def test_per_tier_chunk_sizes_as_keys_or_as_the_tune_table() -> None:
    flat = parse_extra_config({"blocks_per_chunk": 2, "disk_blocks_per_chunk": 8, **TIERS}, {})
    assert flat.spans == {"disk": 4, "remote": 1}
    tuned = parse_extra_config({"tune_chunks": TUNED, **TIERS}, {})
    assert tuned.spans == {"disk": 1, "remote": 1}  # until the block's bytes are known
    got = tuned.chunked(2 * 16384)  # vLLM blocks twice the tuned ones: half the blocks
    assert (got.blocks_per_chunk, got.spans, got.tuned) == (8, {"disk": 4, "remote": 8}, None)
    assert (got.offload.disk_gbps, got.offload.remote_gbps) == (0.49, 1.39)
    mine = parse_extra_config({"blocks_per_chunk": 4, "tune_chunks": TUNED, **TIERS}, {})
    assert mine.chunked(16384).spans == {"disk": 16, "remote": 32}  # the given host size wins
    keys = parse_extra_config(
        {"tune_chunks": TUNED, "disk_blocks_per_chunk": 32, "disk_gbps": 2.0, **TIERS}, {}
    ).chunked(16384)
    assert (keys.spans, keys.offload.disk_gbps) == ({"disk": 2, "remote": 8}, 2.0)
    assert parse_extra_config({"disk_blocks_per_chunk": 8}, {}).spans == {}  # no disk tier


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"blocks_per_chunk": 2, "disk_blocks_per_chunk": 5}, "not a multiple of the host"),
        ({"blocks_per_chunk": 2, "disk_blocks_per_chunk": 32}, "need host_slots >= that"),
        ({"tune_chunks": 16}, "tune_chunks must be the"),
        ({"tune_chunks": {"host": 16}}, r"unknown key\(s\) \['host'\]"),
        ({"tune_chunks": {"disk_blocks_per_chunk": -1}}, "disk_blocks_per_chunk"),
    ],
)
def test_bad_chunk_sizes_are_one_line_config_errors(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_extra_config({"host_slots": 8, "disk_path": "/tmp/x.bin", **extra}, {})


def test_byte_sized_lower_tiers_count_slots_of_their_own_chunk_size() -> None:
    extra = {"blocks_per_chunk": 2, "disk_blocks_per_chunk": 8, "disk_gib": 1.0, **TIERS}
    cfg = parse_extra_config({**extra, "remote_gib": 1.0}, {}).sized(1 << 20)
    assert cfg.tier_slots("disk") == (1 << 30) // ((4 << 20) + 4096)  # 4 MiB + a header page
    assert cfg.tier_slots("remote") == 1024  # span 1: chunks of 1 MiB
