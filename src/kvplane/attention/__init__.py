"""L5 attention: typed paged-KV inputs, a negotiated backend contract, and selection.

Typical use::

    meta = PlanMetadata.from_dense(page_size, block_table, kv_len, q_len)
    problem = mla_problem(MLAQuery.packed(q, r), MLAKVCache(pool, r), meta,
                          sm_scale=(qk_nope + qk_rope) ** -0.5, causal=True)
    selector = Selector(default_registry(), metrics=registry)
    plan = selector.plan(problem, "auto")            # or "measured", or a backend name
    result = selector.registry.get(plan.backend).run(plan, query, cache)
"""

from __future__ import annotations

from kvplane.attention.backends import default_registry
from kvplane.attention.base import (
    AttentionBackend,
    BackendRegistry,
    Capabilities,
    Decision,
    Plan,
    Supported,
    TraceEntry,
    Unsupported,
    Verdict,
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
