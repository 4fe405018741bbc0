"""What ``kvplane bench vllm`` derives from the harness's per-repeat samples, on made-up
milliseconds: the paired hit/miss ratio, the TTFT floor and the hit against it."""

from __future__ import annotations

from kvplane.apps.bench import vllm


def test_floor_is_the_hit_bytes_at_memcpy_speed_plus_the_suffix_step() -> None:
    assert vllm.KV_BYTES_PER_TOKEN == 4096  # 4 layers x K/V x 4 heads x 64 dims x bf16
    got = {
        "hit_samples_ms": [30.0, 40.0, 60.0],
        "miss_samples_ms": [100.0, 100.0, 100.0],
        "copy_samples_ms": [2.0, 4.0, 2.0],  # of the prefix's 8 MiB
        "suffix_step_samples_ms": [18.0, 16.0, 28.0],
    }
    out = vllm.floor_fields(got, hit_tokens=1024, prefix_tokens=2048)  # half the prefix hit
    assert out["floor_samples_ms"] == [19.0, 18.0, 29.0]  # half of each copy + the step
    assert out["floor_ms"] == 19.0 and out["suffix_step_ms"] == 18.0
    assert out["hit_bytes"] == 4 << 20 and out["memcpy_gbps"] == round(8 * 2**20 / 2e-3 / 1e9, 3)
    assert out["ratio"] == 0.4  # per request: 0.3, 0.4, 0.6
    assert out["hit_vs_floor"] == round(60 / 29, 4)  # per request: 30/19, 40/18, 60/29
    vs_miss, vs_floor = out["rows"]
    assert vs_miss == {
        "bench": "vllm", "row": "ttft_hit_vs_miss", "figure": 40.0, "unit": "ms",
        "limit": 100.0, "limit_name": "prefix recomputed", "repeats": 3, "ratio_min": 0.3,
        "ratio_median": 0.4, "ratio_max": 0.6, "stable": False, "target": 0.5, "met": True,
    }  # fmt: skip
    assert vs_floor["row"] == "ttft_hit_vs_floor" and vs_floor["limit"] == 19.0
    assert vs_floor["target"] is None and vs_floor["met"] is None
    assert (vs_floor["ratio_min"], vs_floor["ratio_max"]) == (round(30 / 19, 4), round(40 / 18, 4))


def test_quick_stores_a_shorter_prefix_than_the_full_run() -> None:
    assert vllm.PREFIX_TOKENS == {True: 1024, False: 2048}
