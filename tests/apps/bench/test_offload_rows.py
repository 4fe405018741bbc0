"""How the offload bench turns paired seconds into its throughput rows and ``bench all`` rows,
on made-up seconds (exact values)."""

from __future__ import annotations

import pytest

from kvplane.apps.bench import offload_rows as o

GB = 10**9


def _measured(unavailable: str | None = None) -> o.Measured:
    limits = {"": [1.0, 1.0, 1.0], "redis_py": [2.0, 4.0, 2.0]}
    names = {"": "redis-benchmark -P 1", "redis_py": "redis-py pipeline"}
    if unavailable is not None:
        del limits[""], names[""]
    return o.Measured("remote", "store", 256 << 10, GB, [2.0, 2.0, 4.0], limits, names, unavailable)


def test_throughput_row_has_medians_and_paired_ratios_per_limit() -> None:
    assert o.throughput_row(_measured()) == {
        "tier": "remote", "op": "store", "chunk_bytes": 256 << 10, "gbps": 0.5,
        "limit_gbps": 1.0, "ratio": 0.5, "redis_py_limit_gbps": 0.5, "redis_py_ratio": 1.0,
    }  # fmt: skip


def test_rows_one_per_limit_the_main_one_with_the_target() -> None:
    main, second = o.rows(_measured(), 0.8)
    assert main == {
        "bench": "offload", "row": "remote_store_256k", "figure": 0.5, "unit": "GB/s",
        "limit": 1.0, "limit_name": "redis-benchmark -P 1", "repeats": 3, "ratio_min": 0.25,
        "ratio_median": 0.5, "ratio_max": 0.5, "stable": False, "target": 0.8, "met": False,
    }  # fmt: skip
    assert second["row"] == "remote_store_256k_vs_redis_py" and second["target"] is None
    assert (second["ratio_min"], second["ratio_median"], second["ratio_max"]) == (0.5, 1.0, 2.0)


def test_an_unavailable_limit_is_a_row_without_figures() -> None:
    m = _measured("no redis-benchmark binary on PATH")
    assert o.throughput_row(m)["limit_gbps"] is None
    assert o.throughput_row(m)["limit_unavailable"] == "no redis-benchmark binary on PATH"
    first, second = o.rows(m, 0.8)
    assert first["limit"] is None and first["ratio_median"] is None and first["met"] is None
    assert first["limit_name"] == "unavailable: no redis-benchmark binary on PATH"
    assert first["row"] == "remote_store_256k" and second["row"] == "remote_store_256k_vs_redis_py"


def test_measure_pairs_every_limit_with_each_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(o, "WARMUP", 1)
    monkeypatch.setattr(o, "REPEATS", {True: (3, 3)})
    monkeypatch.setattr(o, "SETTLE_S", 0.0)
    calls: list[str] = []

    def timed(name: str, s: float) -> o.Timed:
        return lambda: calls.append(name) or s  # type: ignore[func-returns-value]

    limits = [o.Limit("a", "", timed("a", 1.0)), o.Limit("b", "b", timed("b", 4.0))]
    m = o.measure(("host", "load", 4096, GB), timed("ours", 2.0), limits, True)
    assert calls == ["ours", "a", "b"] * 4  # a warm-up, then three repeats
    assert m.ours == [2.0] * 3 and m.limits == {"": [1.0] * 3, "b": [4.0] * 3}
    assert m.names == {"": "a", "b": "b"} and m.unavailable is None
