"""``kvplane bench vllm-offload`` on made-up engine results: the workload's sizes and prompts,
the four figures' rows (ratios, spreads, targets, ``tokens_equal``) and the JSON document.

One real-engine run (marked slow: ``KVPLANE_SLOW=1``, needs ``.venv-vllm``) checks what the
figures rest on: equal tokens everywhere and the chunks each engine loaded per tier.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvplane.apps.bench import vllm_offload as bench
from kvplane.apps.bench.command import BENCHES, ON_REQUEST
from kvplane.apps.bench.vllm import MODEL_SHAPE
from kvplane.apps.bench.vllm_offload_rows import (
    hit_chunks,
    hit_row,
    p90,
    pressure_rows,
    restart_row,
)
from kvplane.errors import InvalidArgumentError

QUICK = bench.WORKLOADS[True]


def _round(seconds: float, ttft: list[float], tokens: list[list[int]]) -> dict[str, Any]:
    return {"seconds": seconds, "ttft_ms": ttft, "tokens": tokens}


TOKS = [[1, 2], [3, 4]]
PLAIN = [_round(10.0, [100, 200], TOKS), _round(4.0, [1000, 2000], TOKS),
         _round(2.0, [500, 1500], TOKS)]  # fmt: skip
OURS = [_round(9.0, [90, 180], TOKS), _round(1.0, [100, 300], TOKS),
        _round(1.0, [200, 400], TOKS)]  # fmt: skip


def test_the_kv_cache_holds_two_requests_and_vllms_null_block() -> None:
    assert QUICK.request_blocks == 34  # 1,024 + 32 + 16 tokens in 32-token blocks
    assert QUICK.num_gpu_blocks == 69
    assert bench.WORKLOADS[False].request_blocks == 34  # 1,088 tokens: 32 output tokens


def test_a_workload_needs_two_prefixes_for_a_rounds_p90() -> None:
    with pytest.raises(InvalidArgumentError, match=r"Workload\.prefixes"):
        bench.Workload(prefixes=1, rounds=1, max_tokens=1, hit_repeats=1, restart_repeats=1)
    with pytest.raises(InvalidArgumentError, match=r"Workload\.rounds"):
        bench.Workload(prefixes=2, rounds=0, max_tokens=1, hit_repeats=1, restart_repeats=1)


def test_prompts_share_each_prefix_across_rounds_and_are_deterministic() -> None:
    p = bench.prompts(QUICK)
    assert p == bench.prompts(QUICK)
    assert len(p["rounds"]) == 1 + 6 and all(len(r) == 4 for r in p["rounds"])
    first, later = p["rounds"][0], p["rounds"][3]
    assert all(len(x) == 1056 for x in first)
    assert [x[:1024] for x in first] == [x[:1024] for x in later]  # same prefixes
    assert all(a[1024:] != b[1024:] for a, b in zip(first, later, strict=True))  # new suffixes
    assert len({tuple(x[:1024]) for x in first}) == 4
    assert (len(p["hit"]), len(p["stored"]), len(p["fresh"])) == (6, 4, 4)
    warm = p["warmup"]
    assert [len(warm[n]) for n in bench.ENGINES] == [1, 1, 2, 2, 2]
    assert warm["store"][1] == warm["restart_disk"][1] == warm["restart_redis"][1]
    assert len(p["filler"]) == 40


def test_tier_configs_give_engine_b_host_and_one_lower_tier() -> None:
    conf = bench.tier_configs(QUICK, "/d/chunks.bin", "redis://127.0.0.1:7/0")
    host = {"blocks_per_chunk": 4, "host_slots": 8 * (4 + 6 + 2)}
    disk = {"disk_path": "/d/chunks.bin", "disk_slots": 8 * (2 * 4 + 4)}
    redis = {"remote_url": "redis://127.0.0.1:7/0", "remote_slots": 96}
    assert conf == {"host": host, "store": host | disk | redis, "disk": host | disk,
                    "redis": host | redis}  # fmt: skip
    assert set(bench.tier_configs(QUICK, "/d/c.bin", None)) == {"host", "store", "disk"}


def test_p90_is_linear_between_the_closest_ranks() -> None:
    assert p90([100, 300]) == 280.0
    assert p90([400, 100, 300, 200]) == 370.0


def test_pressure_rows_leave_the_warmup_round_out_and_pair_rounds() -> None:
    speed, tail = pressure_rows(PLAIN, OURS, warmup_rounds=1)
    assert speed == {
        "bench": "vllm-offload", "row": "tokens_per_s_vs_plain", "figure": 4.0,
        "unit": "tok/s", "limit": 1.333, "limit_name": "plain vLLM, same prompts and KV blocks",
        "repeats": 2, "ratio_min": 2.0, "ratio_median": 3.0, "ratio_max": 4.0,
        "stable": False, "target": 3.7, "met": False, "tokens_equal": True,
        "per_round": {"ours": [4.0, 4.0], "limit": [1.0, 2.0]},
    }  # fmt: skip
    # per round p90s: ours 280, 380; plain 1,900, 1,400; pooled 370 and 1,850
    assert (tail["figure"], tail["limit"]) == (370.0, 1850.0)
    assert tail["ratio_median"] == round((280 / 1900 + 380 / 1400) / 2, 4)
    assert (tail["ratio_min"], tail["ratio_max"]) == (round(280 / 1900, 4), round(380 / 1400, 4))
    assert (tail["target"], tail["met"]) == (0.3, True)
    assert tail["per_round"] == {"ours": [280.0, 380.0], "limit": [1900.0, 1400.0]}


def test_pressure_rows_say_when_a_warmup_token_differs() -> None:
    ours = [_round(9.0, [90, 180], [[1, 2], [3, 5]]), *OURS[1:]]
    assert [r["tokens_equal"] for r in pressure_rows(PLAIN, ours, 1)] == [False, False]


def test_host_hit_row_compares_with_vllms_own_hit_and_the_claimed_3_ms() -> None:
    same = [[7, 8], [7, 8], [7, 8]]
    phase = {"kvplane_hit_ms": [24.0, 30.0, 26.0], "vllm_hit_ms": [20.0, 25.0, 24.0],
             "tokens": [same, same, same], "reset": [True, True, True]}  # fmt: skip
    row = hit_row(phase)
    assert (row["row"], row["figure"], row["limit"]) == ("ttft_host_hit_vs_vllm_hit", 26.0, 24.0)
    assert (row["ratio_min"], row["ratio_median"], row["ratio_max"]) == (1.0833, 1.2, 1.2)
    assert (row["target"], row["met"]) == (None, None)
    assert (row["diff_ms"], row["diff_target_ms"], row["diff_met"]) == (4.0, 3.0, False)
    assert row["samples_ms"] == {"ours": [24.0, 30.0, 26.0], "limit": [20.0, 25.0, 24.0]}
    assert row["tokens_equal"] is True
    assert hit_row(phase | {"reset": [True, False, True]})["tokens_equal"] is False
    differ = [same, [[7, 8], [7, 9], [7, 8]], same]
    assert hit_row(phase | {"tokens": differ})["tokens_equal"] is False


def test_restart_row_is_the_hit_over_a_recompute_in_engine_b() -> None:
    stored = {"ttft_ms": [300.0, 310.0], "tokens": [[1], [2]]}
    phase = {"hit_ms": [40.0, 60.0], "fresh_ms": [400.0, 400.0], "tokens": [[1], [2]]}
    row = restart_row("disk", stored, phase)
    assert row == {
        "bench": "vllm-offload", "row": "ttft_disk_hit_vs_recompute", "figure": 50.0,
        "unit": "ms", "limit": 400.0, "limit_name": "recompute after the restart",
        "repeats": 2, "ratio_min": 0.1, "ratio_median": 0.125, "ratio_max": 0.15,
        "stable": False, "target": 0.13, "met": True, "tokens_equal": True,
        "samples_ms": {"ours": [40.0, 60.0], "limit": [400.0, 400.0]},
    }  # fmt: skip
    assert restart_row("redis", stored, phase | {"tokens": [[1], [3]]})["tokens_equal"] is False


def test_hit_chunks_reads_the_per_tier_counters() -> None:
    metrics = {"kvplane_vllm_hit_chunks_total{tier=host}": 8.0,
               "kvplane_vllm_hit_chunks_total{tier=disk}": 4.0,
               "kvplane_vllm_hit_tokens_total": 1536.0}  # fmt: skip
    assert hit_chunks(metrics) == {"host": 8.0, "disk": 4.0}


def _engines(with_redis: bool) -> dict[str, dict[str, Any]]:
    same = [[7], [7], [7]]
    hit = {"kvplane_hit_ms": [20.0], "vllm_hit_ms": [20.0], "tokens": [same], "reset": [True],
           "scheduler_metrics": {"kvplane_vllm_hit_chunks_total{tier=host}": 40.0}}  # fmt: skip
    restart = {"hit_ms": [40.0], "fresh_ms": [400.0], "tokens": [[1]]}
    engines = {
        "plain": {"phases": [{"rounds": PLAIN}], "engine_start_s": 10.004, "vllm_version": "v"},
        "kvplane": {"phases": [{"rounds": OURS}, hit], "engine_start_s": 12.0,
                    "integrity": "ok"},
        "store": {"phases": [{"ttft_ms": [300.0], "tokens": [[1]]}], "engine_start_s": 9.0},
        "restart_disk": {"phases": [restart], "engine_start_s": 8.0},
    }  # fmt: skip
    if with_redis:
        engines["restart_redis"] = {"phases": [restart], "engine_start_s": 7.0}
    return engines


def test_result_document_has_every_row_and_what_it_rests_on() -> None:
    doc = bench.result(QUICK, "float32", _engines(with_redis=True))
    assert [r["row"] for r in doc["rows"]] == [
        "tokens_per_s_vs_plain", "ttft_p90_vs_plain", "ttft_host_hit_vs_vllm_hit",
        "ttft_disk_hit_vs_recompute", "ttft_redis_hit_vs_recompute",
    ]  # fmt: skip
    assert all(r["tokens_equal"] for r in doc["rows"])
    assert doc["hit_chunks"] == {"kvplane": {"host": 40.0}, "store": {}, "restart_disk": {},
                                 "restart_redis": {}}  # fmt: skip
    assert doc["warmup_rounds_s"] == {"plain": [10.0], "kvplane": [9.0]}
    assert doc["engine_start_s"]["plain"] == 10.0
    assert doc["integrity"] == {"kvplane": "ok", "store": None, "restart_disk": None,
                                "restart_redis": None}  # fmt: skip
    assert doc["workload"] == {
        "prefix_tokens": 1024, "suffix_tokens": 32, "block_size": 32, "blocks_per_chunk": 4,
        "num_gpu_blocks": 69, "dtype": "float32", "prefixes": 4, "rounds": 6,
        "max_tokens": 16, "hit_repeats": 6, "restart_repeats": 4, "warmup_rounds": 1,
    }  # fmt: skip
    assert doc["vllm_version"] == "v" and doc["model"] == MODEL_SHAPE
    no_redis = bench.result(QUICK, "float32", _engines(with_redis=False))
    assert [r["row"] for r in no_redis["rows"]][-1] == "ttft_disk_hit_vs_recompute"


def test_registered_as_a_command_but_left_out_of_bench_all() -> None:
    assert "vllm_offload" in ON_REQUEST and "vllm_offload" not in BENCHES
    assert bench.NAME == "vllm-offload"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([]).dtype == "float32"
    assert parser.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.slow
def test_a_quick_run_decodes_equal_tokens_and_loads_from_every_tier() -> None:
    from kvplane.integrations.vllm.env import vllm_support

    reason = vllm_support()
    if reason is not None:
        pytest.skip(reason)
    doc = bench.run(True, argparse.Namespace(dtype="float32"))
    assert all(r["tokens_equal"] for r in doc["rows"])
    assert set(doc["integrity"].values()) == {"ok"}
    chunks = bench.CHUNKS_PER_PROMPT  # 8 per 1,024-token prefix
    # 6 timed rounds x 4 prefixes from host (vLLM's cache keeps none of them), 6 hit repeats
    assert doc["hit_chunks"]["kvplane"] == {"host": (6 * 4 + 6) * chunks}
    # B's warm-up loads the prompt engine A stored for it, then 4 repeats
    assert doc["hit_chunks"]["restart_disk"] == {"disk": 5 * chunks}
    if "restart_redis" in doc["hit_chunks"]:
        assert doc["hit_chunks"]["restart_redis"] == {"remote": 5 * chunks}
