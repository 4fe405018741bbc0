"""How ``kvplane bench vllm-pd`` lays out its run, without engines: prompt lengths, which
prompts each pair gets (the same prompts across connectors, the same lengths across modes),
the engines' cores and how a failure is reported. The engines themselves run in the bench."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

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
    assert bench.errors == {("nixl", "push"): bench._nixl[0]}
    out = bench.result(reference=[[]] * len(bench.prompts))
    assert out["modes"] == [{"connector": "nixl", "mode": "push", "error": bench._nixl[0]}]
    assert out["rows"] == []  # no ratio without both sides
    assert out["targets"]["tokens_equal"]["met"] is False


def test_quick_runs_one_kvplane_pair_for_both_modes_and_no_nixl_pair() -> None:
    assert _bench().pairs == ("kvplane",)
    full = b._Bench(False, argparse.Namespace(transport="tcp", rounds=1, cores="shared"),
                    Path("/nonexistent/model"))  # fmt: skip
    assert full.pairs == ("kvplane", "nixl-pull", "nixl-push")
    modes = {m for m, _s, _p in _bench().layout("kvplane", 0)}
    assert modes == {"pull", "pipelined"}


def test_a_quick_result_says_the_nixl_comparison_is_the_full_runs() -> None:
    out = _bench(rounds=1).result(reference=[])
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
        ("kvplane", "pipelined"): "stopped here",
        ("kvplane", "pull"): "stopped here",
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
    assert bench.reference == [[i, i] for i in range(len(bench.prompts))]
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
    assert bench.reference == [[7]] * len(bench.prompts) and bench.vllm_version == "0.x"
    assert bench.errors[("kvplane", "pull")] == "stopped here"
