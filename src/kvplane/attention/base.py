"""The attention backend contract: capabilities as data, check, plan, run; and the registry.

``check`` never raises for an unsupported problem, ``plan`` reads structure only, ``run``
executes exactly its plan. :class:`BackendRegistry` order is the ``auto`` order. See
docs/attention.md.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, runtime_checkable

import torch

from kvplane.attention.metadata import PagedStructure, QueryClass
from kvplane.attention.platform import Platform
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    LSEBase,
    MLAShape,
    QueryLayout,
)
from kvplane.errors import BackendError, InvalidArgumentError
from kvplane.verdicts import Verdict

ALL_QUERY_CLASSES = frozenset(QueryClass)
BOTH_CAUSAL = frozenset({False, True})
BOTH_LAYOUTS = frozenset(QueryLayout)
S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend supports; a ``None`` set means "any value"."""

    kinds: frozenset[AttentionKind]
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    lse_base: LSEBase
    query_classes: frozenset[QueryClass] = ALL_QUERY_CLASSES
    causal: frozenset[bool] = BOTH_CAUSAL
    query_layouts: frozenset[QueryLayout] = BOTH_LAYOUTS
    head_counts: frozenset[int] | None = None
    page_sizes: frozenset[int] | None = None
    mla_dims: frozenset[tuple[int, int]] | None = None
    """Allowed ``(kv_lora_rank, rope_dim)`` pairs for MLA kinds."""
    sliding_window: bool = False
    """Whether it honours :attr:`AttentionProblem.window` (a problem with one is unsupported
    otherwise)."""
    oracle: bool = False
    """A correctness oracle: ``auto`` may fall back to it, ``measured`` never times it."""
    min_cuda_arch: tuple[int, int] | None = None
    """Oldest CUDA architecture ``(major, minor)`` it runs on (None: any)."""
    cpu_isa: frozenset[str] = frozenset()
    """CPU ISA flags it needs on a CPU device (``/proc/cpuinfo`` names, e.g. ``avx2``)."""
    packages: frozenset[str] = frozenset()
    """Python packages it needs importable (its engine: ``flashinfer``, ``triton``...)."""

    def platform_reasons(self, platform: Platform) -> tuple[str, ...]:
        """Why this backend cannot run on ``platform`` at all, whatever the problem (empty
        when it can): selection skips such a backend before it looks at the problem."""
        out = [] if platform.device in self.devices else [f"device {platform.device} not supported"]
        arch, need = platform.cuda_arch, self.min_cuda_arch
        if platform.device == "cuda" and need is not None and arch is not None and arch < need:
            out.append(f"CUDA arch sm{arch[0]}{arch[1]} < sm{need[0]}{need[1]}")
        if platform.device == "cpu" and not self.cpu_isa <= platform.cpu_isa:
            out.append(f"CPU lacks {', '.join(sorted(self.cpu_isa - platform.cpu_isa))}")
        missing = sorted(p for p in self.packages if not platform.has_package(p))
        out.extend(f"package {p} not installed" for p in missing)
        return tuple(out)

    def reasons(self, problem: AttentionProblem) -> tuple[str, ...]:
        """Why ``problem`` is outside these capabilities (empty when it is inside)."""
        out: list[str] = []
        s = problem.metadata.structure()
        checks: list[tuple[bool, str]] = [
            (problem.kind in self.kinds, f"kind {problem.kind.value}"),
            (problem.device.type in self.devices, f"device {problem.device.type}"),
            (problem.dtype in self.dtypes, f"dtype {problem.dtype}"),
            (s.query_class in self.query_classes, f"query class {s.query_class.value}"),
            (problem.causal in self.causal, f"causal={problem.causal}"),
            (problem.window is None or self.sliding_window, f"sliding window {problem.window}"),
            (problem.query_layout in self.query_layouts, f"{problem.query_layout.value} query"),
            (self.head_counts is None or problem.num_heads in self.head_counts,
             f"{problem.num_heads} heads"),
            (self.page_sizes is None or s.page_size in self.page_sizes,
             f"page size {s.page_size}"),
        ]  # fmt: skip
        if isinstance(problem.shape, MLAShape) and self.mla_dims is not None:
            dims = (problem.shape.kv_lora_rank, problem.shape.rope_dim)
            checks.append((dims in self.mla_dims, f"MLA dims (r, p)={dims}"))
        out.extend(f"{what} not supported" for ok, what in checks if not ok)
        return tuple(out)


class Decision(enum.Enum):
    """What selection did with one candidate."""

    SELECTED = "selected"
    UNSUPPORTED = "unsupported"
    SLOWER = "slower"  # viable, timed, not the fastest
    NOT_TRIED = "not_tried"  # after the selected one, never examined
    PLATFORM = "platform"  # cannot run on this platform at all: skipped before selection


@dataclass(frozen=True, slots=True)
class TraceEntry:
    """One line of a selection trace: candidate, decision, reason and measured time (if any)."""

    candidate: str
    decision: Decision
    reason: str
    seconds: float | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """A backend's plan for one problem: structural facts plus backend-private ``state``.

    Holds no query or KV data; ``state`` may hold index tensors derived from the metadata.
    ``trace`` is filled in by selection (empty when a backend's ``plan`` is called directly).
    """

    backend: str
    problem: AttentionProblem
    structure: PagedStructure
    state: object = field(compare=False)
    trace: tuple[TraceEntry, ...] = ()

    def require(self, backend: str) -> None:
        if self.backend != backend:
            raise BackendError(f"plan was made by backend {self.backend!r}, not {backend!r}")


def plan_state(plan: Plan, backend: str, kind: type[S]) -> S:
    """The backend-private state of ``plan``; ``BackendError`` if another backend made it."""
    plan.require(backend)
    if not isinstance(plan.state, kind):
        raise BackendError(f"plan state is {type(plan.state).__name__}, expected {kind.__name__}")
    return plan.state


@runtime_checkable
class AttentionBackend(Protocol):
    """See the module docstring for the contract of each member."""

    @property
    def name(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def check(self, problem: AttentionProblem) -> Verdict: ...

    def plan(self, problem: AttentionProblem) -> Plan: ...

    def run(self, plan: Plan, query: object, cache: object) -> AttentionResult: ...


class BackendRegistry:
    """Named backends in registration order (the ``auto`` candidate order)."""

    def __init__(self, backends: Sequence[AttentionBackend] = ()) -> None:
        self._backends: dict[str, AttentionBackend] = {}
        for b in backends:
            self.register(b)

    def register(self, backend: AttentionBackend) -> None:
        if not isinstance(backend, AttentionBackend):
            raise InvalidArgumentError(f"{backend!r} does not implement AttentionBackend")
        if backend.name in self._backends:
            raise InvalidArgumentError(f"backend {backend.name!r} is already registered")
        self._backends[backend.name] = backend

    def get(self, name: str) -> AttentionBackend:
        try:
            return self._backends[name]
        except KeyError:
            raise InvalidArgumentError(
                f"unknown attention backend {name!r}; known: {', '.join(self._backends)}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def candidates(self, kind: AttentionKind) -> tuple[AttentionBackend, ...]:
        """Backends declaring ``kind``, in registration order."""
        return tuple(b for b in self._backends.values() if kind in b.capabilities.kinds)

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def __iter__(self) -> Iterator[AttentionBackend]:
        return iter(self._backends.values())
