"""The remote tier's limit: ``redis-benchmark``'s command line, its CSV parsed into seconds, and
(where the binary and a server exist) a real run against the test server."""

from __future__ import annotations

import pytest

from kvplane.apps.bench import redis_limit as rl
from kvplane.errors import InvalidArgumentError, OffloadError

CSV = (
    '"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms",'
    '"p99_latency_ms","max_latency_ms"\n'
    '"SET","1280.00","20.464","16.928","16.943","23.999","23.999","23.999"\n'
    '"GET","3047.62","4.692","2.120","2.127","7.263","7.263","7.263"\n'
)


def test_csv_gives_requests_per_second_per_test() -> None:
    assert rl.parse_csv(CSV) == {"SET": 1280.0, "GET": 3047.62}
    assert rl.parse_csv("WARNING: could not fetch server CONFIG\n" + CSV)["GET"] == 3047.62


def test_csv_without_header_or_with_a_bad_rps_is_refused() -> None:
    with pytest.raises(OffloadError, match="no CSV header"):
        rl.parse_csv("ERROR: connection refused\n")
    with pytest.raises(OffloadError, match="not a number"):
        rl.parse_csv('"test","rps"\n"SET","fast"\n')


def test_command_line_names_server_size_depth_and_one_connection() -> None:
    rb = rl.RedisBenchmark("redis://127.0.0.1:7000/0", 262144, 32, 64)
    assert rb.name == "redis-benchmark -P 32"
    assert rb.argv("GET") == [
        "redis-benchmark", "-u", "redis://127.0.0.1:7000/0", "-c", "1", "-n", "64",
        "-P", "32", "-d", "262144", "-t", "get", "--csv",
    ]  # fmt: skip
    with pytest.raises(InvalidArgumentError):
        rb.argv("INCR")
    with pytest.raises(InvalidArgumentError):
        rl.RedisBenchmark("redis://127.0.0.1:7000/0", 0, 32, 64)
    with pytest.raises(InvalidArgumentError):
        rl.RedisBenchmark("redis://127.0.0.1:7000/0", 1, 0, 64)


def test_a_real_run_times_both_tests(redis_url: str) -> None:
    if rl.redis_benchmark_support() is not None:
        pytest.skip(rl.redis_benchmark_support())
    best = rl.fastest(redis_url, 4096, 8, 2)
    assert set(best) == {"SET", "GET"}
    assert all(rb.pipeline in (1, 2, 4, 8) and rb.value_bytes == 4096 for rb in best.values())
    assert best["GET"].seconds("GET") > 0
