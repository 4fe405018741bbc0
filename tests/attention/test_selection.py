"""Selection: explicit never substitutes, auto falls through on Unsupported, measured ranks and
caches; traces and the fallback-ratio metric, with a deterministic injected timer."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from kvplane import native as native_build
from kvplane.attention import (
    AUTO,
    MEASURED,
    BackendRegistry,
    Decision,
    QueryLayout,
    RankingCache,
    Selector,
    TraceEntry,
    WorkloadBucket,
)
from kvplane.attention.backends import (
    ReferenceBackend,
    SDPABackend,
    TorchMLABackend,
)
from kvplane.attention.ranking import RankedCandidate
from kvplane.errors import BackendError, InvalidArgumentError, UnsupportedError
from kvplane.metrics import MetricsRegistry
from kvplane.verdicts import Unsupported

TIMES = {"torch": 3.0, "torch_splitkv": 1.0, "sdpa": 2.0, "cpu_fused": 4.0}
FUSED = native_build.compiler() is not None
"""Whether this machine can build the C kernel (it has a C compiler)."""


class FakeTimer:
    """Runs each thunk once (so the timed plan really executes) and reports a fixed time."""

    def __init__(self, times: dict[str, float]) -> None:
        self.times = times
        self.calls: list[str] = []

    def __call__(self, thunks: Mapping[str, Callable[[], object]]) -> dict[str, float]:
        for name, fn in thunks.items():
            fn()
            self.calls.append(name)
        return {name: self.times[name] for name in thunks}


def test_explicit_never_substitutes(registry, mla_inputs) -> None:
    metrics = MetricsRegistry()
    sel = Selector(registry, metrics=metrics)
    split = mla_inputs([1], [5], layout=QueryLayout.SPLIT)
    with pytest.raises(
        UnsupportedError, match="backend 'sdpa' cannot run this problem: split query"
    ):
        sel.plan(split.problem, "sdpa")
    with pytest.raises(UnsupportedError, match=r"'flashinfer' cannot run.*no CUDA device"):
        sel.plan(split.problem, "flashinfer")
    with pytest.raises(InvalidArgumentError, match="unknown attention backend 'fast'"):
        sel.plan(split.problem, "fast")
    assert sel.plans == 0 and metrics.value("attention_fallback_ratio") == 0.0
    plan = sel.plan(split.problem, "reference")
    assert plan.backend == "reference"
    assert plan.trace == (TraceEntry("reference", Decision.SELECTED, "requested explicitly"),)
    assert (
        metrics.value("attention_plans_total", {"backend": "reference", "mode": "explicit"}) == 1.0
    )


def test_auto_walks_candidates_and_traces(registry, mla_inputs) -> None:
    metrics = MetricsRegistry()
    sel = Selector(registry, metrics=metrics)
    inputs = mla_inputs([1, 1], [5, 9])
    plan = sel.plan(inputs.problem, AUTO)
    assert plan.backend == "torch"
    assert [(e.candidate, e.decision) for e in plan.trace] == [
        ("flashinfer", Decision.PLATFORM),  # CUDA-only: skipped before selection
        ("triton", Decision.PLATFORM),
        ("torch", Decision.SELECTED),
        ("torch_splitkv", Decision.NOT_TRIED),
        ("sdpa", Decision.NOT_TRIED),
        ("cpu_fused", Decision.NOT_TRIED),
        ("reference", Decision.NOT_TRIED),
    ]
    # the device first; then each package this process lacks (installed ones add nothing)
    for entry, package in zip(plan.trace[:2], ("flashinfer", "triton"), strict=True):
        missing = [] if importlib.util.find_spec(package) else [f"package {package} not installed"]
        assert entry.reason == "; ".join(["device cpu not supported", *missing])
    assert all(e.seconds is None for e in plan.trace)
    # the first candidate that runs on this platform is not a fallback
    assert metrics.value("attention_fallback_plans_total") == 0.0
    assert metrics.value("attention_fallback_ratio") == 0.0
    # the plan runs; the result equals the backend's own
    out = registry.get(plan.backend).run(plan, inputs.query, inputs.cache)
    assert out.out.shape == (2, 4, 64)


def test_fallback_ratio_counts_non_first_candidates(mla_inputs) -> None:
    metrics = MetricsRegistry()
    reg = BackendRegistry([SDPABackend(), TorchMLABackend(), ReferenceBackend()])
    sel = Selector(reg, metrics=metrics)
    assert sel.plan(mla_inputs([1], [5]).problem).backend == "sdpa"  # first candidate
    split = mla_inputs([1], [5], layout=QueryLayout.SPLIT)
    assert sel.plan(split.problem).backend == "torch"  # fell through sdpa
    assert (sel.plans, sel.fallbacks, sel.fallback_ratio) == (2, 1, 0.5)
    assert metrics.value("attention_fallback_ratio") == 0.5
    assert metrics.value("attention_plans_total", {"backend": "sdpa", "mode": "auto"}) == 1.0


def test_measured_ranks_by_time_and_caches(registry, mla_inputs) -> None:
    timer = FakeTimer(TIMES)
    sel = Selector(registry, timer=timer, metrics=MetricsRegistry())
    inputs = mla_inputs([1, 1], [5, 9])
    plan = sel.plan(inputs.problem, MEASURED)
    assert plan.backend == "torch_splitkv"
    fused = ["cpu_fused"] if FUSED else []
    assert timer.calls == ["torch", "torch_splitkv", "sdpa", *fused]
    assert [(e.candidate, e.decision, e.seconds) for e in plan.trace] == [
        ("flashinfer", Decision.PLATFORM, None),
        ("triton", Decision.PLATFORM, None),
        ("torch", Decision.SLOWER, 3.0),
        ("torch_splitkv", Decision.SELECTED, 1.0),
        ("sdpa", Decision.SLOWER, 2.0),
        ("cpu_fused", *((Decision.SLOWER, 4.0) if FUSED else (Decision.UNSUPPORTED, None))),
        ("reference", Decision.NOT_TRIED, None),
    ]
    ranking = sel.cache.get(WorkloadBucket.of(inputs.problem))
    assert ranking is not None
    assert [c.name for c in ranking] == ["torch_splitkv", "sdpa", "torch", *fused]
    # same bucket (kv 9 -> 12 stays in the 16 bucket): no new timing
    assert sel.plan(mla_inputs([1, 1], [6, 12]).problem, MEASURED).backend == "torch_splitkv"
    assert len(timer.calls) == 3 + len(fused)
    # a different bucket is timed anew
    sel.plan(mla_inputs([1, 1], [5, 40]).problem, MEASURED)
    assert len(timer.calls) == 2 * (3 + len(fused)) and len(sel.cache) == 2
    assert sel.fallbacks == 0


def test_measured_skips_a_ranked_name_the_registry_no_longer_has(registry, mla_inputs) -> None:
    timer = FakeTimer(TIMES)
    sel = Selector(registry, timer=timer)
    problem = mla_inputs([1], [5]).problem
    # the fastest entry names a backend this registry no longer has: the next viable one wins
    ranked = ("retired", "sdpa", "torch_splitkv", "torch", "cpu_fused")
    sel.cache.put(
        WorkloadBucket.of(problem), tuple(RankedCandidate(n, i + 1.0) for i, n in enumerate(ranked))
    )
    plan = sel.plan(problem, MEASURED)
    assert plan.backend == "sdpa" and timer.calls == []
    assert (sel.plans, sel.fallbacks) == (1, 1)


def test_measured_never_reuses_a_ranking_of_the_other_query_layout(mla_inputs) -> None:
    """sdpa cannot run a split query: a ranking timed on one must not decide packed queries."""
    timer = FakeTimer({"torch": 3.0, "sdpa": 1.0})
    sel = Selector(BackendRegistry([TorchMLABackend(), SDPABackend()]), timer=timer)
    split = mla_inputs([1, 1], [5, 9], layout=QueryLayout.SPLIT)
    assert sel.plan(split.problem, MEASURED).backend == "torch"
    assert timer.calls == ["torch"]
    plan = sel.plan(mla_inputs([1, 1], [5, 9]).problem, MEASURED)
    assert plan.backend == "sdpa" and timer.calls == ["torch", "torch", "sdpa"]
    assert [(e.candidate, e.decision, e.seconds) for e in plan.trace] == [
        ("torch", Decision.SLOWER, 3.0),
        ("sdpa", Decision.SELECTED, 1.0),
    ]
    assert len(sel.cache) == 2 and sel.fallbacks == 0
    # both rankings are kept: neither layout is timed again
    assert sel.plan(split.problem, MEASURED).backend == "torch"
    assert sel.plan(mla_inputs([1, 1], [6, 12]).problem, MEASURED).backend == "sdpa"
    assert len(timer.calls) == 3


def test_measured_retimes_when_a_viable_candidate_is_missing(mla_inputs) -> None:
    """A cached ranking without one of the viable candidates is timed again (not trusted)."""
    timer = FakeTimer({"torch": 3.0, "sdpa": 1.0})
    sel = Selector(BackendRegistry([TorchMLABackend(), SDPABackend()]), timer=timer)
    problem = mla_inputs([1], [5]).problem
    bucket = WorkloadBucket.of(problem)
    sel.cache.put(bucket, (RankedCandidate("torch", 0.5), RankedCandidate("gone", 2.0)))
    assert sel.plan(problem, MEASURED).backend == "sdpa"
    assert timer.calls == ["torch", "sdpa"]
    # the new times replace the old ones; "gone" (no backend of the registry) is dropped
    assert sel.cache.get(bucket) == (RankedCandidate("sdpa", 1.0), RankedCandidate("torch", 3.0))
    assert sel.plan(problem, MEASURED).backend == "sdpa" and len(timer.calls) == 2


class ParityBackend(TorchMLABackend):
    """The torch backend under another name, Supported only for an odd (or even) longest KV:
    two problems of one bucket (kv 5 and kv 6 share the 8 bucket) with different candidates."""

    def __init__(self, name: str, odd: bool) -> None:
        super().__init__()
        self._parity_name, self._odd = name, odd

    @property
    def name(self) -> str:
        return self._parity_name

    def check(self, problem):
        if (problem.metadata.structure().max_kv_len % 2 == 1) != self._odd:
            return Unsupported(("wrong parity",))
        return super().check(problem)

    def plan(self, problem):
        return dataclasses.replace(super().plan(problem), backend=self._parity_name)

    def run(self, plan, query, cache):
        return super().run(dataclasses.replace(plan, backend="torch"), query, cache)


def test_a_bucket_with_varying_candidates_is_timed_once_per_new_candidate(mla_inputs) -> None:
    reg = BackendRegistry(
        [TorchMLABackend(), ParityBackend("odd", True), ParityBackend("even", False)]
    )
    timer = FakeTimer({"torch": 3.0, "odd": 2.0, "even": 1.0})
    sel = Selector(reg, timer=timer)
    odd, even = mla_inputs([1], [5]).problem, mla_inputs([1], [6]).problem
    assert WorkloadBucket.of(odd) == WorkloadBucket.of(even)
    assert sel.plan(odd, MEASURED).backend == "odd"
    assert sel.plan(even, MEASURED).backend == "even"  # "even" was never timed: timed now
    assert timer.calls == ["torch", "odd", "torch", "even"]
    for _ in range(2):  # the merged ranking holds all three: no more timing
        assert sel.plan(odd, MEASURED).backend == "odd"
        assert sel.plan(even, MEASURED).backend == "even"
    assert len(timer.calls) == 4
    assert [c.name for c in sel.cache.get(WorkloadBucket.of(odd)) or ()] == ["even", "odd", "torch"]


def test_measured_ranking_persists_across_selectors(tmp_path: Path, registry, mla_inputs) -> None:
    path = tmp_path / "rankings.json"
    first = FakeTimer(TIMES)
    Selector(registry, timer=first, cache=RankingCache(path)).plan(
        mla_inputs([1], [5]).problem, MEASURED
    )
    second = FakeTimer({"torch": 0.1, "torch_splitkv": 9.0, "sdpa": 9.0, "cpu_fused": 9.0})
    plan = Selector(registry, timer=second, cache=RankingCache(path)).plan(
        mla_inputs([1], [7]).problem, MEASURED
    )
    assert plan.backend == "torch_splitkv" and second.calls == []


def test_measured_uses_oracle_only_as_last_resort(mla_inputs) -> None:
    timer = FakeTimer({})
    sel = Selector(BackendRegistry([SDPABackend(), ReferenceBackend()]), timer=timer)
    plan = sel.plan(mla_inputs([1], [5], layout=QueryLayout.SPLIT).problem, MEASURED)
    assert plan.backend == "reference" and timer.calls == []
    assert plan.trace[0].decision is Decision.UNSUPPORTED


def test_no_backend_at_all(mla_inputs) -> None:
    sel = Selector(BackendRegistry([SDPABackend()]))
    with pytest.raises(
        UnsupportedError, match=r"no backend supports this mla problem \(sdpa: split"
    ):
        sel.plan(mla_inputs([1], [5], layout=QueryLayout.SPLIT).problem)
    with pytest.raises(UnsupportedError, match="no registered backend handles kind gqa"):
        sel.plan(_gqa_problem())


def _gqa_problem():
    import torch

    from kvplane.attention import GQAKVCache, GQAQuery, gqa_problem
    from kvplane.attention.synthetic import synthetic_metadata

    meta, pages = synthetic_metadata([1], [3], 4)
    kv = torch.zeros(pages, 4, 1, 8)
    return gqa_problem(
        GQAQuery(torch.zeros(1, 2, 8)), GQAKVCache(kv, kv), meta, sm_scale=1.0, causal=True
    )


class BrokenPlanBackend(TorchMLABackend):
    """The real torch backend whose plan fails: selection must publish nothing."""

    @property
    def name(self) -> str:
        return "broken"

    def plan(self, problem):
        raise RuntimeError("plan failed")


def test_failed_plan_publishes_nothing(mla_inputs) -> None:
    metrics = MetricsRegistry()
    sel = Selector(BackendRegistry([BrokenPlanBackend(), TorchMLABackend()]), metrics=metrics)
    with pytest.raises(RuntimeError, match="plan failed"):
        sel.plan(mla_inputs([1], [5]).problem, AUTO)  # auto does not fall through on a failure
    assert sel.plans == 0 and len(sel.cache) == 0
    assert metrics.value("attention_plans_total", {"backend": "broken", "mode": "auto"}) == 0.0


def test_perf_counter_timer_runs_warmup_and_repeats() -> None:
    from kvplane.attention import PerfCounterTimer

    calls: list[int] = []
    seconds = PerfCounterTimer(warmup=2, rounds=3)({"x": lambda: calls.append(1)})
    assert len(calls) == 5 and seconds["x"] >= 0.0
    with pytest.raises(InvalidArgumentError, match="warmup=1, rounds=0"):
        PerfCounterTimer(warmup=1, rounds=0)


def test_a_timer_that_skips_a_candidate_publishes_nothing(registry, mla_inputs) -> None:
    timer = FakeTimer(TIMES)
    sel = Selector(
        registry, timer=lambda thunks: {"torch": timer({"torch": thunks["torch"]})["torch"]}
    )
    with pytest.raises(BackendError, match="the timer returned no time for torch_splitkv, sdpa"):
        sel.plan(mla_inputs([1], [5]).problem, MEASURED)
    assert timer.calls == ["torch"] and sel.plans == 0 and len(sel.cache) == 0


def test_names_one_per_kind_never_substitute(registry, mla_inputs) -> None:
    from kvplane.attention.selection import check_backend

    sel = Selector(registry)
    plan = sel.plan(mla_inputs([1], [5]).problem, "mha,torch")
    assert plan.backend == "torch"  # mha does not declare the absorbed mla kind
    assert plan.trace == (TraceEntry("torch", Decision.SELECTED, "requested explicitly"),)
    with pytest.raises(UnsupportedError, match="none of the backends 'mha,torch' handles kind gqa"):
        sel.plan(_gqa_problem(), "mha,torch")
    assert check_backend(registry, "measured") == "measured"
    assert check_backend(registry, "torch,mha") == "torch,mha"
    for bad in ("", "torch,", "fastest"):
        with pytest.raises(InvalidArgumentError, match="attention must be auto or measured"):
            check_backend(registry, bad)
