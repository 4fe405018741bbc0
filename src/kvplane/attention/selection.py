"""Backend selection: explicit, ``auto`` and ``measured``, each plan carrying its trace.

Candidates that cannot run on the problem's platform at all are skipped first (traced, never a
fallback). An explicit name never substitutes; ``auto`` falls through only on Unsupported;
``measured`` times and caches rankings. Owns the selection and fallback metrics. See
docs/attention.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Sequence
from functools import partial

from kvplane.attention.base import AttentionBackend, BackendRegistry, Decision, Plan, TraceEntry
from kvplane.attention.platform import platform_of
from kvplane.attention.problem import AttentionProblem
from kvplane.attention.ranking import RankedCandidate, Ranking, RankingCache, WorkloadBucket
from kvplane.attention.synthetic import twin
from kvplane.attention.timing import PerfCounterTimer, Timer
from kvplane.errors import BackendError, InvalidArgumentError, UnsupportedError
from kvplane.metrics import FALLBACK_RATIO, MetricsRegistry, fallback_ratio
from kvplane.verdicts import Supported, Unsupported, Verdict

AUTO = "auto"
MEASURED = "measured"
MODES = (AUTO, MEASURED)
"""The selection modes; any other value of a ``backend`` argument names a backend."""


def check_backend(registry: BackendRegistry, value: str) -> str:
    """``value`` when it is a mode or backend names of ``registry``, comma-separated (a model
    plans several kinds: ``torch,mha`` names one backend per kind); ``InvalidArgumentError``
    naming the choices otherwise."""
    if value in MODES:
        return value
    unknown = [n for n in value.split(",") if n not in registry]
    if unknown or not value:
        raise InvalidArgumentError(
            f"attention must be {' or '.join(MODES)} or backend names (comma-separated) of "
            f"{', '.join(registry.names())}; got {value!r}"
        )
    return value


def _why(v: Verdict) -> str:
    return "; ".join(v.reasons) if isinstance(v, Unsupported) else "supported"


def _merge(timed: Ranking, earlier: Ranking, known: Container[str]) -> Ranking:
    """``timed`` plus the entries of ``earlier`` it does not name and that are still ``known``
    (backends of the registry: a retired backend's entry is dropped), fastest first (stable)."""
    fresh = {c.name for c in timed}
    kept = [c for c in earlier if c.name not in fresh and c.name in known]
    return tuple(sorted((*timed, *kept), key=lambda c: c.seconds))


class Selector:
    """Resolves ``auto`` / ``measured`` / explicit names to a traced plan; see module docstring."""

    def __init__(
        self,
        registry: BackendRegistry,
        *,
        metrics: MetricsRegistry | None = None,
        timer: Timer | None = None,
        cache: RankingCache | None = None,
        seed: int = 0,
    ) -> None:
        self.registry = registry
        self.timer: Timer = timer if timer is not None else PerfCounterTimer(min_seconds=0.05)
        self.cache = cache if cache is not None else RankingCache()
        self.seed = seed
        self.plans = 0
        self.fallbacks = 0
        self._metrics = metrics

    def plan(self, problem: AttentionProblem, backend: str = AUTO) -> Plan:
        """A plan for ``problem`` from ``backend`` (``"auto"``, ``"measured"`` or a name)."""
        if backend == AUTO:
            plan, fallback = self._auto(problem)
        elif backend == MEASURED:
            plan, fallback = self._measured(problem)
        else:
            plan, fallback = self._explicit(problem, self._named(problem, backend)), False
        self._publish(plan, backend if backend in MODES else "explicit", fallback)
        return plan

    @property
    def fallback_ratio(self) -> float:
        return fallback_ratio(self.fallbacks, self.plans)

    # -- modes -----------------------------------------------------------------------------------
    def _named(self, problem: AttentionProblem, names: str) -> str:
        """The one of comma-separated ``names`` that declares ``problem``'s kind (the first
        such), or the single name given; never a backend not named."""
        listed = names.split(",")
        if len(listed) == 1:
            return names
        for name in listed:
            if problem.kind in self.registry.get(name).capabilities.kinds:
                return name
        raise UnsupportedError(f"none of the backends {names!r} handles kind {problem.kind.value}")

    def _explicit(self, problem: AttentionProblem, name: str) -> Plan:
        b = self.registry.get(name)
        v = b.check(problem)
        if isinstance(v, Unsupported):
            raise UnsupportedError(f"backend {name!r} cannot run this problem: {_why(v)}")
        trace = (TraceEntry(name, Decision.SELECTED, "requested explicitly"),)
        return dataclasses.replace(b.plan(problem), trace=trace)

    def _auto(self, problem: AttentionProblem) -> tuple[Plan, bool]:
        candidates, trace = self._candidates(problem)
        for i, b in enumerate(candidates):
            v = b.check(problem)
            if isinstance(v, Supported):
                plan = b.plan(problem)
                trace.append(TraceEntry(b.name, Decision.SELECTED, "first supported candidate"))
                trace.extend(
                    TraceEntry(c.name, Decision.NOT_TRIED, "after the selected candidate")
                    for c in candidates[i + 1 :]
                )
                return dataclasses.replace(plan, trace=tuple(trace)), i > 0
            trace.append(TraceEntry(b.name, Decision.UNSUPPORTED, _why(v)))
        raise UnsupportedError(self._none_supported(problem, trace))

    def _measured(self, problem: AttentionProblem) -> tuple[Plan, bool]:
        candidates, skipped = self._candidates(problem)
        verdicts = {b.name: b.check(problem) for b in candidates}
        viable = [
            b for b in candidates
            if isinstance(verdicts[b.name], Supported) and not b.capabilities.oracle
        ]  # fmt: skip
        if not viable:
            return self._auto(problem)
        bucket = WorkloadBucket.of(problem)
        ranking = self.cache.get(bucket)
        names = {b.name for b in viable}
        if ranking is None or not names <= {c.name for c in ranking}:
            # _time ranks every viable candidate (or raises), so this bucket is not re-timed
            # for these candidates again.
            ranking = _merge(self._time(problem, viable), ranking or (), self.registry)
            self.cache.put(bucket, ranking)
        ranked = [c for c in ranking if c.name in names]
        chosen = self.registry.get(ranked[0].name)
        plan = chosen.plan(problem)
        times = {c.name: c.seconds for c in ranking}
        trace = skipped
        for b in candidates:
            v = verdicts[b.name]
            if b.name == chosen.name:
                entry = TraceEntry(b.name, Decision.SELECTED, "fastest measured", times[b.name])
            elif isinstance(v, Unsupported):
                entry = TraceEntry(b.name, Decision.UNSUPPORTED, _why(v))
            elif b.name in times:
                entry = TraceEntry(b.name, Decision.SLOWER, "measured slower", times[b.name])
            else:
                entry = TraceEntry(b.name, Decision.NOT_TRIED, "oracle or not in the ranking")
            trace.append(entry)
        return dataclasses.replace(plan, trace=tuple(trace)), chosen.name != ranking[0].name

    # -- helpers ---------------------------------------------------------------------------------
    def _candidates(
        self, problem: AttentionProblem
    ) -> tuple[Sequence[AttentionBackend], list[TraceEntry]]:
        """The candidates for ``problem``'s kind that can run on its platform, in registry
        order, and a trace entry (``PLATFORM``, with the reasons) for each one that cannot."""
        candidates = self.registry.candidates(problem.kind)
        if not candidates:
            raise UnsupportedError(f"no registered backend handles kind {problem.kind.value}")
        here = platform_of(problem.device)
        runnable: list[AttentionBackend] = []
        skipped: list[TraceEntry] = []
        for b in candidates:
            why = b.capabilities.platform_reasons(here)
            if why:
                skipped.append(TraceEntry(b.name, Decision.PLATFORM, "; ".join(why)))
            else:
                runnable.append(b)
        return runnable, skipped

    def _time(self, problem: AttentionProblem, viable: Sequence[AttentionBackend]) -> Ranking:
        """Every viable candidate timed together by the timer on one synthetic twin."""
        inputs = twin(problem, seed=self.seed)
        thunks = {
            b.name: partial(b.run, b.plan(inputs.problem), inputs.query, inputs.cache)
            for b in viable
        }
        seconds = self.timer(thunks)
        missing = [name for name in thunks if name not in seconds]
        if missing:
            raise BackendError(f"the timer returned no time for {', '.join(missing)}")
        timed = sorted((seconds[b.name], i, b.name) for i, b in enumerate(viable))
        return tuple(RankedCandidate(name, t) for t, _, name in timed)

    @staticmethod
    def _none_supported(problem: AttentionProblem, trace: list[TraceEntry]) -> str:
        lines = "; ".join(f"{e.candidate}: {e.reason}" for e in trace)
        return f"no backend supports this {problem.kind.value} problem ({lines})"

    def _publish(self, plan: Plan, mode: str, fallback: bool) -> None:
        self.plans += 1
        self.fallbacks += int(fallback)
        m = self._metrics
        if m is None:
            return
        m.counter(
            "attention_plans", "Attention plans made, by backend and mode", ("backend", "mode")
        ).labels(backend=plan.backend, mode=mode).inc()
        fb = m.counter(
            "attention_fallback_plans", "Plans resolved past the first candidate of the platform"
        )
        if fallback:
            fb.inc()
        m.gauge(*FALLBACK_RATIO).set(self.fallback_ratio)
