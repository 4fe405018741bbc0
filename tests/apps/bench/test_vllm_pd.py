"""How ``kvplane bench vllm-pd`` lays out its run, without engines: prompt lengths, which
prompts each pair gets (the same prompts across connectors, the same lengths across modes),
the engines' cores and how a failure is reported. The engines themselves run in the bench."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvplane.apps.bench import vllm_pd as b
from kvplane.errors import ConfigError, IntegrationError


def _bench(rounds: int = 2) -> b._Bench:
    args = argparse.Namespace(transport="shm", rounds=rounds, cores="shared")
    return b._Bench(True, args, Path("/nonexistent/model"))


def test_lengths_are_evenly_spaced_from_shortest_to_longest() -> None:
    assert b.lengths(8, 1024, 4096) == [1024, 1462, 1901, 2340, 2779, 3218, 3657, 4096]
    assert b.lengths(4, 512, 1024) == [512, 682, 853, 1024]
    assert b.lengths(1, 512, 1024) == [512]


def test_pairs_share_prompts_across_connectors_and_lengths_across_modes() -> None:
    bench = _bench()
    n = b.SIZES[True][0]
    assert len(bench.prompts) == 2 + 2 * 2 * n  # two warm-ups, two sets per round
    kv = bench.layout("kvplane", 1)
    assert [m for m, _s, _p in kv] == ["pull", "pipelined"] * (n + 1)
    assert [s for _m, s, _p in kv] == [None, None, 4, 4, 5, 5, 6, 6, 7, 7]
    pull = bench.layout("nixl-pull", 1)
    push = bench.layout("nixl-push", 1)
    assert pull[0] == ("pull", None, bench.warm[0]) and push[0] == ("push", None, bench.warm[1])
    # the same prompt for the same slot and mode family, in both connectors
    assert [(s, p) for m, s, p in kv[2:] if m == "pull"] == [(s, p) for _m, s, p in pull[1:]]
    assert [(s, p) for m, s, p in kv[2:] if m == "pipelined"] == [(s, p) for _m, s, p in push[1:]]
    lens = {p: len(bench.prompts[p]) for p in range(len(bench.prompts))}
    for (_m, s1, a), (_n, s2, c) in zip(pull[1:], push[1:], strict=True):
        assert s1 == s2 and a != c and lens[a] == lens[c]  # other prompts, same lengths
    assert bench.base["dtype"] == "float32" and bench.base["prefix_caching"] is False
    assert bench.base["wait_s"] == b.PAIR_TIMEOUT_S[True]


def test_engine_cores_split_only_where_each_engine_keeps_two() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    both = b.engine_cores("shared")
    assert both == (cpus, cpus)
    auto = b.engine_cores("auto")
    if len(cpus) >= 4:
        assert auto == (cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :])
    else:
        assert auto == both
    if len(cpus) >= 2:
        prefill, decode = b.engine_cores("split")
        assert prefill + decode == cpus and prefill and decode
    else:
        with pytest.raises(ConfigError):
            b.engine_cores("split")


def test_a_failed_pair_is_reported_without_vllm_warning_noise() -> None:
    text = "\n".join(
        ["PD pair failed: prefill exited with -9 (killed here: no result within 300 s):"]
        + ["(MainProcess pid=1) WARNING 12-05 [base.py:380] noise"] * 50
        + ["[rank0]: TransferTimeoutError: address did not appear within 300.0s"]
    )
    got = b._reason(IntegrationError(text))
    assert got.splitlines() == [
        "PD pair failed: prefill exited with -9 (killed here: no result within 300 s):",
        "[rank0]: TransferTimeoutError: address did not appear within 300.0s",
    ]
    assert len(b._reason(IntegrationError("x" * 5000))) == 2003


def test_a_pair_that_cannot_start_becomes_error_rows_for_its_modes() -> None:
    bench = _bench(rounds=1)
    bench._nixl = ["nixl does not import in /x/python: ModuleNotFoundError"]
    bench.run_pair("nixl-push", 0)
    assert bench.errors == {("nixl", "push", 1): bench._nixl[0]}
    out = bench.result()
    assert out["modes"] == [{"connector": "nixl", "mode": "push", "tp": 1, "error": bench._nixl[0]}]
    assert out["rows"] == []  # no ratio without both sides
    assert out["targets"]["tokens_equal"]["met"] is False


def test_quick_runs_one_kvplane_pair_for_both_modes_and_no_nixl_pair() -> None:
    assert _bench().pairs == {1: ("kvplane",)}
    full = b._Bench(False, argparse.Namespace(transport="tcp", rounds=1, cores="shared"),
                    Path("/nonexistent/model"))  # fmt: skip
    assert full.tps == (1, 2)
    every = ("kvplane", "nixl-pull", "nixl-push")
    assert full.pairs == {1: every, 2: every}  # NIXL push at TP 2 too: its params carry the TP
    modes = {m for m, _s, _p in _bench().layout("kvplane", 0)}
    assert modes == {"pull", "pipelined"}


def test_a_quick_result_says_the_nixl_comparison_is_the_full_runs() -> None:
    out = _bench(rounds=1).result()
    assert out["rows"] == [] and out["modes"] == []
    assert out["targets"]["kvplane_pull_le_nixl_pull"] == {
        "met": False, "value": None, "limit": 1.0,
        "why": f"NIXL pull pair: {b.NOT_IN_QUICK}",
    }  # fmt: skip


def test_a_pair_started_early_serves_only_after_the_given_file(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[dict[str, object]] = []

    def pair(pre: dict[str, object], dec: dict[str, object], **_: object) -> None:
        seen.extend([pre, dec])
        raise IntegrationError("stopped here")

    monkeypatch.setattr(b, "run_pd_pair", pair)
    bench = _bench(rounds=1)
    bench.run_pair("kvplane", 0, Path("/tmp/flag"))
    assert [s["start_after"] for s in seen] == ["/tmp/flag", "/tmp/flag"]
    assert bench.errors == {
        ("kvplane", "pipelined", 1): "stopped here",
        ("kvplane", "pull", 1): "stopped here",
    }
    bench._nixl = [None]  # NIXL present: its pair is started, without the file
    bench.run_pair("nixl-pull", 0)
    assert len(seen) == 4 and "start_after" not in seen[-1]


def test_quick_reference_tokens_come_from_the_prefill_engine_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[dict[str, object]] = []
    bench = _bench(rounds=1)

    def pair(pre: dict[str, object], dec: dict[str, object], **_: object) -> tuple[object, object]:
        seen.extend([pre, dec])
        tokens = [[i, i] for i in range(len(bench.prompts))]
        records = {
            f"r{k}": {"added_at": 1.0, "first_at": 1.5, "finished_at": 1.2, "tokens": [k]}
            for k in range(len(pre["prompts"]))  # type: ignore[arg-type]
        }
        side: dict[str, object] = {"affinity": {}, "thread_cpu_s": []}
        return {**side, "prefill": records, "reference": tokens}, {**side, "decode": records}

    monkeypatch.setattr(b, "run_pd_pair", pair)
    bench.run_pair("kvplane", 0, reference=True)
    assert seen[0]["reference_prompts"] == bench.prompts and "reference_prompts" not in seen[1]
    assert bench.reference == {1: [[i, i] for i in range(len(bench.prompts))]}
    assert b.REFERENCE[True].startswith("the kvplane pair's prefill engine alone")


def test_the_full_runs_reference_engine_runs_while_the_first_pair_waits_for_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    flag = tmp_path / "reference-done"
    bench = _bench(rounds=1)
    order: list[str] = []

    def harness(spec: dict[str, object], timeout: float) -> dict[str, object]:
        order.append("reference")
        return {"tokens": [[[7]] * len(bench.prompts)], "vllm_version": "0.x"}

    def pair(pre: dict[str, object], dec: dict[str, object], **_: object) -> None:
        assert pre["start_after"] == str(flag)
        while not flag.exists():  # as the decode engine waits before saying "ready"
            time.sleep(0.01)
        order.append("pair serves")
        raise IntegrationError("stopped here")

    monkeypatch.setattr(b, "run_harness", harness)
    monkeypatch.setattr(b, "run_pd_pair", pair)
    b._with_reference_engine(bench, "kvplane", flag)
    assert order == ["reference", "pair serves"]
    assert bench.reference == {1: [[7]] * len(bench.prompts)} and bench.vllm_version == "0.x"
    assert bench.errors[("kvplane", "pull", 1)] == "stopped here"


def _bench_at(tp: str, quick: bool = True, rounds: int = 1, nixl: str | None = None) -> b._Bench:
    args = argparse.Namespace(transport="tcp", rounds=rounds, cores="shared", tp=tp, nixl=nixl)
    return b._Bench(quick, args, Path("/nonexistent/model"))


def test_tp_sizes_default_to_1_quick_and_1_2_full_and_a_full_run_has_every_pair_at_each() -> None:
    assert _bench_at("").tps == (1,) and _bench_at("", quick=False).tps == (1, 2)
    assert _bench_at("2").pairs == {2: ("kvplane",)}
    assert _bench_at("1,2").not_run() == {
        "nixl-pull": b.NOT_IN_QUICK, "nixl-push": b.NOT_IN_QUICK,
        "nixl-pull_tp2": b.NOT_IN_QUICK, "nixl-push_tp2": b.NOT_IN_QUICK,
    }  # fmt: skip
    assert _bench_at("1,2", quick=False).not_run() == {}


def test_nixl_adds_the_nixl_pairs_to_a_quick_run() -> None:
    assert _bench_at("2", nixl="pull").pairs == {2: ("kvplane", "nixl-pull")}
    assert _bench_at("2", nixl="pull").not_run() == {"nixl-push_tp2": b.NOT_IN_QUICK}
    every = ("kvplane", "nixl-pull", "nixl-push")
    assert _bench_at("1,2", nixl="pull,push").pairs == {1: every, 2: every}
    assert _bench_at("1,2", nixl="pull,push").not_run() == {}


def test_a_tp_2_pair_runs_both_engines_at_tp_2_and_its_rows_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bench = _bench_at("2")
    seen: list[dict[str, object]] = []

    def pair(pre: dict[str, Any], dec: dict[str, Any], **_: object) -> tuple[object, object]:
        seen.extend([pre, dec])
        # request k: prefilled from 10k s for 0.5 s, decode added 5 ms later, first token 40 ms
        # on; it decodes [its prompt's index], as does the reference of that prompt
        prompts = [bench.prompts.index(p) for p in pre["prompts"]]
        prefill = {f"r{k}": {"added_at": 10.0 * k, "finished_at": 10.0 * k + 0.5}
                   for k in range(len(prompts))}  # fmt: skip
        decode = {f"r{k}": {"added_at": 10.0 * k + 0.505, "first_at": 10.0 * k + 0.545,
                            "tokens": [p]} for k, p in enumerate(prompts)}  # fmt: skip
        side: dict[str, object] = {"affinity": {"cpus": [0, 1]}, "thread_cpu_s": []}
        reference = [[p] for p in range(len(bench.prompts))]
        return {**side, "prefill": prefill, "reference": reference}, {**side, "decode": decode}

    monkeypatch.setattr(b, "run_pd_pair", pair)
    bench.run_pair("kvplane", 0, reference=True, tp=2)
    assert [s["tensor_parallel_size"] for s in seen] == [2, 2]
    assert seen[0]["reference_prompts"] == bench.prompts
    assert set(bench.reference) == {2} and set(bench.affinity) == {"kvplane_tp2"}
    assert sorted(bench.samples) == [("kvplane", "pipelined", 2), ("kvplane", "pull", 2)]
    out = bench.result()
    pull = next(r for r in out["modes"] if r["mode"] == "pull")
    assert pull == {
        "connector": "kvplane", "mode": "pull", "tp": 2, "ttft_ms": 540.0,
        "ttft_range_ms": [540.0, 540.0], "decode_ttft_ms": 40.0, "prefill_ms": 500.0,
        "exposed_tail_ms": 45.0, "transfer_tail_ms": None, "tokens_equal": True,
        "repeats": b.SIZES[True][0],
    }  # fmt: skip
    assert set(out["ratios"]) == {
        "kvplane_pull_vs_nixl_pull_tp2", "pipelined_vs_pull_tp2", "pipelined_vs_nixl_push_tp2",
        "decode_ttft_kvplane_pull_vs_nixl_pull_tp2", "prefill_kvplane_pull_vs_nixl_pull_tp2",
    }  # fmt: skip
    assert out["targets"]["kvplane_pull_le_nixl_pull_tp2"]["why"].startswith("NIXL pull pair")


def test_tp_2_without_a_core_per_rank_in_each_engine_is_an_error_row() -> None:
    bench = _bench_at("2")
    bench.cores = ([0], [1])
    bench.run_pair("kvplane", 0, tp=2)
    why = "TP 2 needs a core per rank in each engine: ([0], [1])"
    assert bench.errors == {("kvplane", "pull", 2): why, ("kvplane", "pipelined", 2): why}
    assert [r for r in bench.result()["modes"] if r["mode"] == "pull"] == [
        {"connector": "kvplane", "mode": "pull", "tp": 2, "error": why}
    ]


def test_rounds_alternate_the_pairs_per_tp_size_and_round_0_kvplane_gives_the_reference(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[tuple[str, int, bool, int]] = []

    def record(bench: b._Bench) -> None:
        def run_pair(c: str, r: int, reference: bool = False, tp: int = 1) -> None:
            calls.append((c, r, reference, tp))

        monkeypatch.setattr(bench, "run_pair", run_pair)

    quick = _bench_at("1,2", rounds=2)
    record(quick)
    b._run_pairs(quick, True, tmp_path)
    assert calls == [("kvplane", 0, True, 1), ("kvplane", 0, True, 2),
                     ("kvplane", 1, False, 1), ("kvplane", 1, False, 2)]  # fmt: skip
    calls.clear()
    full = _bench_at("1,2", quick=False, rounds=2)
    record(full)
    monkeypatch.setattr(b, "_with_reference_engine", lambda *a: calls.append(("ref", 0, True, 1)))
    b._run_pairs(full, False, tmp_path)
    assert calls == [
        ("ref", 0, True, 1), ("nixl-pull", 0, False, 1), ("nixl-push", 0, False, 1),
        ("kvplane", 0, True, 2), ("nixl-pull", 0, False, 2), ("nixl-push", 0, False, 2),
        ("nixl-push", 1, False, 1), ("nixl-pull", 1, False, 1), ("kvplane", 1, False, 1),
        ("nixl-push", 1, False, 2), ("nixl-pull", 1, False, 2), ("kvplane", 1, False, 2),
    ]  # fmt: skip
