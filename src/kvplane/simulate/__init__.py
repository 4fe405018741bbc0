"""L5 simulate: a discrete-event model of a PD cluster's KV movement, for capacity planning.

A cluster TOML (:func:`load_cluster`) and requests (a Mooncake trace or Poisson arrivals) go in;
:func:`simulate` returns a :class:`SimResult` (TTFT/TPOT percentiles, tier hits and bytes,
transport figures, utilisations). Pure Python; imports no engine, serving or pipeline module.
See docs/simulate.md.
"""

from kvplane.simulate.parse import load_cluster, parse_cluster
from kvplane.simulate.result import Outcome, Percentiles, SimResult, TierResult
from kvplane.simulate.spec import ClusterSpec
from kvplane.simulate.summary import simulate
from kvplane.simulate.workload import Request, poisson_requests, read_trace

__all__ = [
    "ClusterSpec",
    "Outcome",
    "Percentiles",
    "Request",
    "SimResult",
    "TierResult",
    "load_cluster",
    "parse_cluster",
    "poisson_requests",
    "read_trace",
    "simulate",
]
