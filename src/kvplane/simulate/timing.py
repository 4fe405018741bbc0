"""The simulator's cost model: FIFO lanes, chunked-prefill slice times and the PD transfer.

Pure arithmetic on the specs' numbers; the engine calls it once per prefill. A :class:`Lane` is
one FIFO resource (a tier's bandwidth, a worker's link): work reserved on it starts when both the
work is ready and the lane is free. :func:`transfer_pieces` is the one home of pipelining:
each slice sent as it is computed (only the last one exposed) or the whole KV after prefill.
:func:`choose_pipelining` asks the same model which mode and slice size a request should use:
the simulator's engine and the runtime's ``--pipelining auto`` prefill worker both call it.
A request replayed from a measured run takes its own step and op seconds instead
(:func:`step_hold_s`, :func:`replayed_op`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvplane.simulate.spec import DecodeSpec, PrefillSpec, TransportSpec
from kvplane.simulate.workload import Replayed


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


def contention_of(busy_step_s: float, quiet_step_s: float, steps: int) -> float:
    """The ``[prefill] contention`` that makes ``steps`` pipelined steps, the first quiet and
    the rest stretched, average ``busy_step_s`` when a quiet one takes ``quiet_step_s``:
    ``(busy / quiet - 1) * steps / (steps - 1)``, never below 0; 0 for one step."""
    if steps < 2 or quiet_step_s <= 0:
        return 0.0
    return max(0.0, (busy_step_s / quiet_step_s - 1.0) * steps / (steps - 1))


def prefill_slices(
    spec: PrefillSpec, hit_tokens: int, input_tokens: int, t0: float
) -> list[tuple[int, int, float]]:
    """The slices ``(start, end, end_time)`` that compute ``[hit_tokens, input_tokens)`` from
    ``t0`` on, ``slice_tokens`` at a time (the last one shorter), each :func:`slice_s` long."""
    out = []
    t = t0
    for s in range(hit_tokens, input_tokens, spec.slice_tokens):
        e = min(s + spec.slice_tokens, input_tokens)
        t += slice_s(spec, s, e)
        out.append((s, e, t))
    return out


def slice_s(spec: PrefillSpec, start: int, end: int) -> float:
    """One slice's seconds: :func:`compute_s`, times ``1 + spec.contention`` when pipelined and
    KV is already being sent beside it (``start`` > 0: a loaded prefix or an earlier slice)."""
    stretch = 1.0 + spec.contention if spec.pipelined and start > 0 else 1.0
    return compute_s(spec, start, end) * stretch


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


def replayed_op(replayed: Replayed, piece: int, pieces: int) -> tuple[float, float]:
    """``(submission delay, span)`` of op ``piece`` of a request's ``pieces`` ops from its
    measured ``replayed.submit_s`` and ``op_s``, each aligned to its last ops: an op before
    them (a loaded prefix the run did not send: its decode worker held it) takes 0 s."""

    def aligned(values: Sequence[float]) -> float:
        i = piece - (pieces - len(values))
        return values[i] if 0 <= i < len(values) else 0.0

    return aligned(replayed.submit_s), aligned(replayed.op_s or ())


def step_hold_s(
    spec: PrefillSpec, start: int, end: int, step: int, replayed: Replayed | None
) -> tuple[float, float]:
    """``(step seconds, the worker's seconds after it)`` of a request's ``step``-th computed
    step, tokens ``[start, end)``: its measured ones where ``replayed`` has them, else
    :func:`slice_s` and 0."""
    if replayed is None:
        return slice_s(spec, start, end), 0.0
    rs, ra = replayed.step_s, replayed.after_s
    held = rs[step] if step < len(rs) else slice_s(spec, start, end)
    return held, ra[step] if step < len(ra) else 0.0


def kv_pieces(
    spec: PrefillSpec, hit_tokens: int, input_tokens: int, t0: float, bytes_per_token: int
) -> tuple[list[tuple[float, int]], float]:
    """One request's PD transfer ops as (ready time, bytes) and its prefill end, compute
    starting at ``t0`` with ``hit_tokens`` already loaded: the loaded prefix (ready at ``t0``)
    and each slice, as :func:`transfer_pieces` sends them for ``spec.pipelined``."""
    slices = prefill_slices(spec, hit_tokens, input_tokens, t0)
    end = slices[-1][2]
    pieces = [(t0, hit_tokens * bytes_per_token)] if hit_tokens else []
    pieces.extend((t, (e - s) * bytes_per_token) for s, e, t in slices)
    return transfer_pieces(pieces, end, spec.pipelined), end


def alone_ttft_s(
    spec: PrefillSpec,
    transport: TransportSpec,
    bytes_per_token: int,
    input_tokens: int,
    hit_tokens: int = 0,
) -> float:
    """Seconds from compute start to the KV landed for one request on idle workers and an idle
    link (``hit_tokens`` already loaded): the engine's arithmetic without queueing."""
    pieces, _ = kv_pieces(spec, hit_tokens, input_tokens, 0.0, bytes_per_token)
    send, recv = Lane(), Lane()
    landed = 0.0
    for at, nbytes in pieces:
        landed = book_op(transport, at, nbytes, send, recv)[1]
    return landed


def choose_pipelining(
    spec: PrefillSpec,
    transport: TransportSpec,
    bytes_per_token: int,
    input_tokens: int,
    hit_tokens: int = 0,
) -> PrefillSpec:
    """``spec`` with the ``pipelined`` and ``slice_tokens`` of the fastest
    :func:`alone_ttft_s` for this request: pipelined slices of 1, 2, 4... times
    ``spec.slice_tokens`` (shorter than the computed part), else one transfer after the
    prefill (which pays no ``contention``). A tie goes to the smaller slice, pipelined before
    not. The candidates differ only in slicing, so with ``step_s`` > 0 a longer slice also
    saves steps."""
    rest = max(input_tokens - hit_tokens, 1)
    size = spec.slice_tokens
    candidates = [dataclasses.replace(spec, pipelined=True)]
    while 2 * size < rest:
        size *= 2
        candidates.append(dataclasses.replace(spec, slice_tokens=size, pipelined=True))
    candidates.append(dataclasses.replace(spec, pipelined=False))
    return min(
        candidates,
        key=lambda c: alone_ttft_s(c, transport, bytes_per_token, input_tokens, hit_tokens),
    )
