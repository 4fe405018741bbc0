"""L5 attention: typed paged-KV inputs, a negotiated backend contract, and selection.

Describe a call as an :class:`AttentionProblem`, plan it with a :class:`Selector` (a backend
name, ``auto`` or ``measured``), run the plan on the chosen backend. Usage and mechanisms:
docs/attention.md.
"""

from __future__ import annotations

from kvplane.attention.backends import default_registry
from kvplane.attention.base import (
    AttentionBackend,
    BackendRegistry,
    Capabilities,
    Decision,
    Plan,
    TraceEntry,
)
from kvplane.attention.inputs import GQAKVCache, GQAQuery, MLAKVCache, MLAQuery, MLAUpProjection
from kvplane.attention.metadata import (
    CSRPageTable,
    DensePageTable,
    PagedStructure,
    PlanMetadata,
    QueryClass,
)
from kvplane.attention.paged import merge_states
from kvplane.attention.problem import (
    AttentionKind,
    AttentionProblem,
    AttentionResult,
    GQAShape,
    LSEBase,
    MLAShape,
    QueryLayout,
    gqa_problem,
    mla_problem,
)
from kvplane.attention.ranking import RankingCache, WorkloadBucket
from kvplane.attention.selection import AUTO, MEASURED, Selector
from kvplane.attention.timing import PerfCounterTimer, Timer
from kvplane.verdicts import Supported, Unsupported, Verdict

MLAPlanMetadata = PlanMetadata
"""The ARCHITECTURE.md name: the same object serves MLA and GQA batches."""

__all__ = [
    "AUTO",
    "MEASURED",
    "AttentionBackend",
    "AttentionKind",
    "AttentionProblem",
    "AttentionResult",
    "BackendRegistry",
    "CSRPageTable",
    "Capabilities",
    "Decision",
    "DensePageTable",
    "GQAKVCache",
    "GQAQuery",
    "GQAShape",
    "LSEBase",
    "MLAKVCache",
    "MLAPlanMetadata",
    "MLAQuery",
    "MLAShape",
    "MLAUpProjection",
    "PagedStructure",
    "PerfCounterTimer",
    "Plan",
    "PlanMetadata",
    "QueryClass",
    "QueryLayout",
    "RankingCache",
    "Selector",
    "Supported",
    "Timer",
    "TraceEntry",
    "Unsupported",
    "Verdict",
    "WorkloadBucket",
    "default_registry",
    "gqa_problem",
    "merge_states",
    "mla_problem",
]
