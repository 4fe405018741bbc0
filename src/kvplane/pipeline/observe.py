"""The PD pipeline's Prometheus metrics (``kvplane_pd_*``), in an injected registry.

One :class:`RuntimeMetrics` per worker. See docs/pipeline.md.
"""

from __future__ import annotations

from kvplane.metrics import COUNT_BUCKETS, MetricsRegistry, transfer_amplification
from kvplane.transfer import TransferPlan

RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
AMPLIFICATION_BUCKETS = (1.0, 1.01, 1.1, 1.5, 2.0, 4.0)


class RuntimeMetrics:
    """Collectors of one worker (``role`` label: prefill, decode or router)."""

    def __init__(self, registry: MetricsRegistry, role: str) -> None:
        self.role = role
        self.requests = registry.counter(
            "pd_requests", "Requests by role and terminal state", ["role", "state"]
        )
        self.slices = registry.counter(
            "pd_slices", "Pipelined slices by result (submitted, done, failed, ...)", ["result"]
        )
        self.bytes = registry.counter("pd_bytes_moved", "Bytes moved by completed slice plans")
        self.logical = registry.counter(
            "pd_logical_bytes", "Bytes the receivers needed (planner coverage)"
        )
        self.failures = registry.counter("pd_failures", "Request failures by reason", ["reason"])
        self.sessions = registry.gauge("pd_sessions", "Live PD sessions by state", ["state"])
        self.live = registry.gauge("pd_requests_live", "Requests holding memory on this worker")
        self.overlap = registry.histogram(
            "pd_overlap_ratio",
            "Transfer time hidden under prefill compute / transfer time",
            buckets=RATIO_BUCKETS,
        )
        self.tail = registry.histogram(
            "pd_exposed_tail_seconds", "Last prefill step end to decode-ready (sender's view)"
        )
        self.slice_seconds = registry.histogram(
            "pd_slice_transfer_seconds", "Wall time of one slice transfer"
        )
        self.amplification = registry.histogram(
            "pd_transfer_amplification",
            "Bytes moved / logical bytes per slice",
            buckets=AMPLIFICATION_BUCKETS,
        )
        self.blocks_per_op = registry.histogram(
            "pd_blocks_per_op", "Destination blocks touched per transfer op", buckets=COUNT_BUCKETS
        )
        self.release_latency = registry.histogram(
            "pd_release_latency_seconds", "Failure (peer loss/abort/timeout) to memory released"
        )

    def finished(self, state: str, reason: str = "") -> None:
        self.requests.labels(self.role, state).inc()
        if state != "success":
            self.failures.labels(_reason_class(reason)).inc()

    def planned(self, plans: list[tuple[TransferPlan, int]]) -> None:
        """Amplification of a slice and the destination blocks each op touches; ``plans`` pairs
        each plan with its destination block size (1 for whole-only pools)."""
        moved = sum(p.num_bytes for p, _ in plans)
        logical = sum(p.logical_bytes for p, _ in plans)
        if logical:
            self.amplification.observe(transfer_amplification(moved, logical))
        for plan, bs in plans:
            for op in plan.ops:
                first, last = op.tokens.start // bs, -(-op.tokens.end // bs)
                self.blocks_per_op.observe(max(1, last - first))

    def moved(self, plans: list[TransferPlan]) -> None:
        self.bytes.inc(sum(p.num_bytes for p in plans))
        self.logical.inc(sum(p.logical_bytes for p in plans))


def _reason_class(reason: str) -> str:
    """A bounded label for a failure reason (free text would explode the label set)."""
    low = reason.lower()
    for key in (
        "peer lost",
        "peer restarted",
        "deadline",
        "cancel",
        "abort",
        "timeout",
        "in doubt",
        "slice",
    ):
        if key in low:
            return key.replace(" ", "_")
    return "other"
