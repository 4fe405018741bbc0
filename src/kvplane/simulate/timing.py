"""The simulator's cost model: FIFO lanes, chunked-prefill slice times and the PD transfer.

Pure arithmetic on the specs' numbers; the engine calls it once per prefill. A :class:`Lane` is
one FIFO resource (a tier's bandwidth, a worker's link): work reserved on it starts when both the
work is ready and the lane is free. :func:`transfer_pieces` is the one home of pipelining:
each slice sent as it is computed (only the last one exposed) or the whole KV after prefill.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.simulate.spec import DecodeSpec, PrefillSpec, TransportSpec


class Lane:
    """A FIFO server: ``reserve`` books work behind everything booked before it."""

    __slots__ = ("busy_s", "free_at")

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_s = 0.0

    def reserve(self, ready: float, hold: float) -> float:
        """Book ``hold`` seconds starting at ``max(ready, free_at)``; return the end time."""
        end = max(ready, self.free_at) + hold
        self.free_at = end
        self.busy_s += hold
        return end


def batch_s(ops: int, nbytes: int, op_overhead_s: float, bandwidth_bytes_s: float) -> float:
    """Seconds a lane is held by ``ops`` operations moving ``nbytes`` in all."""
    return ops * op_overhead_s + nbytes / bandwidth_bytes_s


def compute_s(spec: PrefillSpec, start: int, end: int) -> float:
    """Prefill seconds of prompt tokens ``[start, end)`` with ``[0, start)`` already in KV:
    ``step_s + token_s * n + pair_s * (start + ... + end - 1)``."""
    n = end - start
    return spec.step_s + spec.token_s * n + spec.pair_s * (start + end - 1) * n / 2


def prefill_slices(
    spec: PrefillSpec, hit_tokens: int, input_tokens: int, t0: float
) -> list[tuple[int, int, float]]:
    """The slices ``(start, end, end_time)`` that compute ``[hit_tokens, input_tokens)`` from
    ``t0`` on, ``slice_tokens`` at a time (the last one shorter)."""
    out = []
    t = t0
    for s in range(hit_tokens, input_tokens, spec.slice_tokens):
        e = min(s + spec.slice_tokens, input_tokens)
        t += compute_s(spec, s, e)
        out.append((s, e, t))
    return out


def tpot_s(spec: DecodeSpec, context_tokens: int) -> float:
    """Seconds per decoded token beside ``context_tokens`` tokens of batch context."""
    return spec.token_s + spec.ctx_token_s * context_tokens


def transfer_pieces(
    pieces: Sequence[tuple[float, int]], prefill_end: float, pipelined: bool
) -> list[tuple[float, int]]:
    """The ops of one PD transfer as (ready time, bytes): ``pieces`` as they are when
    ``pipelined`` (each slice sent as it is computed), else all bytes at ``prefill_end``."""
    if pipelined:
        return list(pieces)
    return [(prefill_end, sum(n for _, n in pieces))]


def book_op(
    transport: TransportSpec, ready: float, nbytes: int, send: Lane, recv: Lane
) -> tuple[float, float]:
    """Book one op of ``nbytes`` ready at ``ready``: it holds both lanes for ``op_overhead_s +
    nbytes / bandwidth`` from when both are free, and lands ``rtt_s`` after. Returns (start,
    landed). Ops must be booked in time order (the engine books each when it is ready)."""
    start = max(ready, send.free_at, recv.free_at)
    hold = transport.op_overhead_s + nbytes / transport.bandwidth_bytes_s
    send.reserve(start, hold)
    recv.reserve(start, hold)
    return start, start + hold + transport.rtt_s
