"""What a simulation reports, as frozen values: per-request :class:`Outcome` records and the
:class:`SimResult` summary (latency percentiles, tier hits and bytes, transport figures,
utilisations, failures).

Ratios use :mod:`kvplane.metrics`' one definition of transfer amplification and overlap ratio.
``SimResult.to_dict()`` is the ``--json`` document. Must not import the engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ascending ``sorted_values`` by linear interpolation
    between closest ranks (NumPy's default); 0.0 for no values."""
    n = len(sorted_values)
    if n == 0:
        return 0.0
    pos = (n - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Percentiles:
    """p50, p90, p99, mean and max of one latency, in seconds (all 0.0 with no samples)."""

    p50: float
    p90: float
    p99: float
    mean: float
    max: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        v = sorted(values)
        if not v:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0)
        return cls(
            percentile(v, 50), percentile(v, 90), percentile(v, 99), math.fsum(v) / len(v), v[-1],
            len(v),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request's final attempt, in simulated seconds: arrival, prefill start (after its
    queue), compute start (after prefix loads), prefill end, KV landed at decode (the first
    token), decode start (after the decode queue), done."""

    rid: int
    output_tokens: int
    arrival_s: float
    prefill_start_s: float
    compute_start_s: float
    prefill_end_s: float
    ready_s: float
    decode_start_s: float
    done_s: float
    hit_tokens: int
    attempts: int

    @property
    def ttft_s(self) -> float:
        return self.ready_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        return self.prefill_start_s - self.arrival_s

    @property
    def exposed_tail_s(self) -> float:
        return self.ready_s - self.prefill_end_s

    @property
    def tpot_s(self) -> float | None:
        """Seconds per token after the first (decode queueing included); None for one token."""
        if self.output_tokens < 2:
            return None
        return (self.done_s - self.ready_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class TierResult:
    """One tier over all its instances: the share of prompt tokens it served, bytes loaded,
    stored (written), evicted and resident at the end, and its lanes' mean busy fraction."""

    name: str
    instances: int
    hit_rate: float
    hit_bytes: int
    stored_bytes: int
    evicted_bytes: int
    resident_bytes: int
    utilisation: float


@dataclass(frozen=True, slots=True)
class FailureResult:
    """One killed worker: how many requests it re-routed, and the time from its death to the
    release of the memory its sessions held on the survivors."""

    role: str
    index: int
    at_s: float
    rerouted: int
    release_latency_s: float


@dataclass(frozen=True, slots=True)
class SimResult:
    """The summary of one run. Utilisations are busy fractions of the makespan (decode: of
    its batch slots); ``prefix_hit_rate`` is prompt tokens served from any tier over prompt
    tokens looked up."""

    requests: int
    completed: int
    events: int
    makespan_s: float
    ttft_s: Percentiles
    tpot_s: Percentiles
    queue_s: Percentiles
    exposed_tail_s: Percentiles
    prefix_hit_rate: float
    tiers: tuple[TierResult, ...]
    transport_bytes: int
    logical_bytes: int
    transfer_amplification: float
    overlap_ratio: float
    prefill_utilisation: float
    decode_utilisation: float
    transport_utilisation: float
    failures: tuple[FailureResult, ...]

    def to_dict(self) -> dict[str, Any]:
        """The result as plain JSON-ready data (nested dicts and lists)."""
        return dataclasses.asdict(self)
