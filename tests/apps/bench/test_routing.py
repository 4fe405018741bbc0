"""``kvplane bench routing`` on a small slice of the shipped Mooncake trace, through real worker
and router processes: every key present, and cache-aware routing loads more cached prefix than
round-robin (requests sent one at a time, so the comparison does not depend on timing)."""

from __future__ import annotations

from pathlib import Path

from kvplane.apps.bench.command import BENCHES, ON_REQUEST
from kvplane.apps.bench.routing import POLICIES, TRACE, Workload, compare, result
from kvplane.apps.bench.routing_trace import load_trace, reused_groups
from kvplane.cli import build_parser

KEYS = {"policy", "hit_rate", "oracle_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "requests"}


def test_a_small_replay_hits_more_with_cache_aware_routing(tmp_path: Path) -> None:
    reqs = reused_groups(load_trace(TRACE), 3)  # 11 requests of 3 prefix groups
    w = Workload(tuple(reqs), host_slots=16, max_blocks=8, serial=True)
    oracle, rr_model = w.models()
    assert (len(reqs), round(oracle.hit_rate, 4), round(rr_model.hit_rate, 4)) == (
        11, 0.6364, 0.3182,
    )  # fmt: skip
    rows, _at = compare(tmp_path, w)
    assert [r["policy"] for r in rows] == list(POLICIES)
    assert all(set(r) >= KEYS and r["requests"] == 11 for r in rows)
    rr, ca = rows
    assert ca["hit_rate"] > rr["hit_rate"], rows
    assert rr["assignment_model_hit_rate"] == 0.3182  # round-robin's picks are fixed
    doc = result(rows, w, [0.0] * 11)
    assert set(doc) == {"policies", "rows", "round_robin_model_hit_rate", "targets", "workload"}
    assert doc["round_robin_model_hit_rate"] == 0.3182


def test_the_bench_is_a_command_of_its_own() -> None:
    args = build_parser().parse_args(["bench", "routing", "--quick", "--groups", "3"])
    assert (args._bench.NAME, args.quick, args.groups, args.host_slots) == (
        "routing",
        True,
        3,
        None,
    )
    assert "routing" in ON_REQUEST and "routing" not in BENCHES  # not in `bench all`
