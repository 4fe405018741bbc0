"""``kvplane bench routing`` on a small slice of the shipped Mooncake trace, through real worker
and router processes, in 2 paired rounds: every key present, the policies alternate first,
each policy's measured hits equal its own assignment replayed on the exact cache models, and
cache-aware routing loads more cached prefix than round-robin (requests sent one at a time, so
the comparison does not depend on timing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from kvplane.apps.bench.command import BENCHES, ON_REQUEST
from kvplane.apps.bench.routing import TRACE, result, solo_fit
from kvplane.apps.bench.routing_rounds import POLICIES, Solo, Workload, play, round_orders
from kvplane.apps.bench.routing_trace import load_trace, reused_groups
from kvplane.cli import build_parser

KEYS = {"policy", "hit_rate", "oracle_hit_rate", "ttft_p50_ms", "ttft_p90_ms", "requests"}


def test_a_small_replay_in_paired_rounds_hits_more_with_cache_aware_routing(
    tmp_path: Path,
) -> None:
    reqs = reused_groups(load_trace(TRACE), 3)  # 11 requests of 3 prefix groups
    w = Workload(tuple(reqs), host_slots=16, max_blocks=8, serial=True)
    assert [len(p.requests) for p in w.split(2)] == [9, 2]  # groups 0 and 2, then group 1
    solos, runs, at_s = play(tmp_path, w, rounds=2)
    assert [(r.round, r.policy) for r in runs] == [
        (0, "round-robin"), (0, "cache-aware"), (1, "cache-aware"), (1, "round-robin"),
    ]  # fmt: skip
    assert [(s.round, s.policy) for s in solos] == [(r.round, r.policy) for r in runs]
    assert all(len(s.tokens) == 5 for s in solos)  # each round warms both, in its order
    doc = cast(dict[str, Any], result(solos, runs, w, at_s))
    assert set(doc) == {
        "policies", "rounds", "rows", "round_robin_model_hit_rate", "solo_fit", "targets",
        "workload",
    }  # fmt: skip
    rr, ca = cast(list[dict[str, Any]], doc["policies"])
    assert [r["policy"] for r in (rr, ca)] == list(POLICIES)
    assert all(set(r) >= KEYS and r["requests"] == 11 for r in (rr, ca))
    assert (rr["oracle_hit_rate"], doc["round_robin_model_hit_rate"]) == (0.6364, 0.4773)
    for row in (rr, ca):  # served one at a time: the measured hits are the models' exactly
        assert row["hit_rate"] == row["assignment_model_hit_rate"], row
    assert ca["hit_rate"] > rr["hit_rate"], (rr, ca)
    assert [r["order"] for r in doc["rounds"]] == [list(o) for o in round_orders(2)]
    assert doc["targets"]["ttft_p50_ratio_spread"]["repeats"] == 2
    assert doc["workload"]["rounds"] == 2


def test_the_solo_fit_is_a_least_squares_line() -> None:
    solos = [
        Solo(0, "round-robin", (100, 300), (0.03, 0.07)),
        Solo(0, "cache-aware", (200,), (0.05,)),
    ]
    assert solo_fit(solos, 200.0) == {
        "fixed_ms": 10.0, "us_per_token": 200.0, "mean_prompt_tokens": 200.0,
        "compute_share": 0.8, "points": [[100, 30.0], [300, 70.0], [200, 50.0]],
    }  # fmt: skip
    flat = solo_fit([Solo(0, "round-robin", (100, 100), (0.02, 0.02))], 100.0)
    assert (flat["us_per_token"], flat["compute_share"]) == (0.0, 0.0)
    steep = solo_fit([Solo(0, "round-robin", (100, 200), (0.01, 0.03))], 150.0)  # fixed -10 ms
    assert (steep["fixed_ms"], steep["compute_share"]) == (-10.0, 1.0)


def test_rounds_alternate_which_policy_goes_first() -> None:
    assert round_orders(4) == [POLICIES, POLICIES[::-1], POLICIES, POLICIES[::-1]]


def test_the_bench_is_a_command_of_its_own() -> None:
    args = build_parser().parse_args(["bench", "routing", "--quick", "--groups", "3"])
    assert (args._bench.NAME, args.quick, args.groups, args.host_slots, args.rounds) == (
        "routing",
        True,
        3,
        None,
        4,
    )
    assert "routing" in ON_REQUEST and "routing" not in BENCHES  # not in `bench all`
