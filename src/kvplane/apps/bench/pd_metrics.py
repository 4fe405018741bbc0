"""What ``kvplane bench pd`` derives from the workers' timelines, and the verdicts it reports.

Pure functions over :class:`~kvplane.pipeline.timeline.RequestTimes` and the bench's rows (a
field is ``None``, never 0, when its events are missing), and the memcpy limit
(:func:`memcpy_slice_ms`). Not a bench of its own. See docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch

from kvplane.apps.bench.spread import Row, spread_of
from kvplane.errors import InvalidArgumentError
from kvplane.metrics import overlap_ratio
from kvplane.pipeline.timeline import RequestTimes, TimelineEvent, request_times

TIME_FIELDS = (
    "exposed_tail_ms",
    "overlap_ratio",
    "slice_transfer_ms",
    "slice_submit_to_done_ms",
    "step_compute_ms",
)
"""The per-request fields of :func:`request_fields`, in row order."""
TAIL_FACTOR = 1.5
"""Target: pipelined exposed tail <= this × one slice's own (busy) transfer time."""
TTFT_RATIO_MAX = 0.7
OVERLAP_MIN = 0.8
CALIBRATION_TOLERANCE = 0.25
"""``calibration_ok``: the measured pipelined step compute within ±25% of a slice's busy
transfer time (the issue's regime: per-step compute ≈ per-step transfer)."""
TARGET_DEFINITIONS = {
    "exposed_tail_le_1.5x_slice": "pipelined exposed_tail_ms <= 1.5 * slice_transfer_ms, "
    "where slice_transfer_ms is a slice's own (busy) transfer time, queueing behind earlier "
    "slices excluded (slice_submit_to_done_ms, the queue-inclusive latency, is not used); "
    "false when either is null",
    "ttft_le_0.7x_non_pipelined": "pipelined ttft_ratio <= 0.7; meaningful only where "
    "calibration[transport].calibration_ok is true (per-step compute within ±25% of the "
    "per-slice busy transfer, the regime the issue's target is stated for)",
    "overlap_ge_0.8": "pipelined overlap_ratio >= 0.8; false when null",
}
"""What each boolean of the bench's ``targets`` compares, reported in its JSON."""


def bench_rows(
    prefix: str,
    ttft_ms: Mapping[str, Sequence[float]],
    pipelined: Sequence[Mapping[str, float | None]],
    *,
    ttft_target: float | None,
    layout: str = "1->1",
) -> list[dict[str, object]]:
    """The ``bench all`` rows of one pipelined/non-pipelined comparison named ``prefix``
    (lower is better in both): the pipelined TTFT against the non-pipelined one, paired request
    by request (``ttft_ms[mode]``, ms), with ``ttft_target``; and the pipelined exposed tail
    against one slice's busy transfer, per request (``pipelined``: :func:`request_fields` of
    each), target :data:`TAIL_FACTOR` -- left out when no request has both (positive). Each
    row names its parallel ``layout`` (``"1->1"``, ``"tp2->1"``, ``"pp2->1"``)."""
    p, n = ttft_ms["pipelined"], ttft_ms["non_pipelined"]
    ratios = spread_of([a / b for a, b in zip(p, n, strict=True)])
    rows = [
        Row("pd", f"{prefix}_ttft_pipelined_vs_non_pipelined", statistics.median(p), "ms",
            statistics.median(n), "non-pipelined", ratios, ttft_target, False),
    ]  # fmt: skip
    pairs = [(f["exposed_tail_ms"], f["slice_transfer_ms"]) for f in pipelined]
    tails = [(t, s) for t, s in pairs if t is not None and s is not None and t > 0 and s > 0]
    if tails:
        rows.append(Row(
            "pd", f"{prefix}_exposed_tail_vs_slice", statistics.median(t for t, _ in tails), "ms",
            statistics.median(s for _, s in tails), "one slice's busy transfer",
            spread_of([t / s for t, s in tails]), TAIL_FACTOR, False,
        ))  # fmt: skip
    return [{**r.as_dict(), "layout": layout} for r in rows]


def _ms(x: float) -> float:
    return x * 1e3


def request_fields(t: RequestTimes, *, truncated: bool) -> dict[str, float | None]:
    """One request's :data:`TIME_FIELDS` from its times (see the module doc); every field is
    ``None`` when ``truncated`` (the timeline it came from lost events)."""
    if truncated:
        return dict.fromkeys(TIME_FIELDS)
    has_slices = bool(t.slice_busy_s)
    tail = t.exposed_tail_s  # None when the last step end or decode-ready event is missing
    return {
        "exposed_tail_ms": _ms(tail) if has_slices and tail is not None else None,
        "overlap_ratio": t.overlap_ratio if has_slices else None,
        "slice_transfer_ms": _ms(statistics.mean(t.slice_busy_s)) if has_slices else None,
        "slice_submit_to_done_ms": _ms(statistics.mean(t.slice_transfer_s))
        if t.slice_transfer_s
        else None,
        "step_compute_ms": _ms(t.compute_s / t.steps) if t.steps > 0 else None,
    }


def gather_times(senders: Sequence[Iterable[TimelineEvent]]) -> RequestTimes:
    """One request's times when several ranks fed it: ``senders`` holds, per rank, that rank's
    events of the request with the decode side's (each rank's slice ids and steps are its own,
    so the ranks' events are never mixed). Compute, transfer and hidden times, slices and
    steps add up over the ranks (the overlap is the hidden share of all their transfer time);
    the prefill ends at the last rank's last step, the exposed tail runs from there to decode
    ready. With one rank it is :func:`~kvplane.pipeline.timeline.request_times` of its
    events. ``InvalidArgumentError`` for no ranks."""
    if not senders:
        raise InvalidArgumentError("a request's times need at least one sender's events")
    each = [request_times(events) for events in senders]
    if len(each) == 1:
        return each[0]
    ends = [t.prefill_end for t in each]
    readies = [t.decode_ready for t in each if t.decode_ready is not None]
    end = None if any(e is None for e in ends) else max(e for e in ends if e is not None)
    ready = max(readies) if readies else None
    transfer, hidden = sum(t.transfer_s for t in each), sum(t.hidden_s for t in each)
    return RequestTimes(
        compute_s=sum(t.compute_s for t in each),
        transfer_s=transfer,
        hidden_s=hidden,
        overlap_ratio=overlap_ratio(hidden, transfer),
        prefill_end=end,
        decode_ready=ready,
        exposed_tail_s=None if end is None or ready is None else max(0.0, ready - end),
        slice_transfer_s=tuple(s for t in each for s in t.slice_transfer_s),
        slice_busy_s=tuple(s for t in each for s in t.slice_busy_s),
        steps=sum(t.steps for t in each),
    )


def median_or_none(values: Sequence[float | None]) -> float | None:
    """The median of ``values`` rounded to 4 places; ``None`` if it is empty or any is None."""
    if not values or any(v is None for v in values):
        return None
    return round(statistics.median(v for v in values if v is not None), 4)


def _within(a: float | None, b: float | None, tolerance: float) -> bool:
    return a is not None and b is not None and b > 0 and abs(a / b - 1.0) <= tolerance


def calibration(pipelined: Mapping[str, object], calibrated_ms: float) -> dict[str, object]:
    """The calibration check of one transport from its pipelined row: the calibrated step
    compute, the measured ``step_compute_ms`` and ``slice_transfer_ms`` (busy), and
    ``calibration_ok`` -- the two measured numbers within :data:`CALIBRATION_TOLERANCE` of each
    other (false when either is missing)."""
    step, busy = pipelined.get("step_compute_ms"), pipelined.get("slice_transfer_ms")
    ok = (
        isinstance(step, float)
        and isinstance(busy, float)
        and _within(step, busy, CALIBRATION_TOLERANCE)
    )
    return {
        "calibrated_step_compute_ms": round(calibrated_ms, 4),
        "step_compute_ms": step,
        "slice_transfer_ms": busy,
        "calibration_ok": ok,
    }


def targets(pipelined: Mapping[str, object]) -> dict[str, bool]:
    """The issue's targets for a pipelined row (:data:`TARGET_DEFINITIONS`): each false where a
    number it needs is missing."""
    tail, busy = pipelined.get("exposed_tail_ms"), pipelined.get("slice_transfer_ms")
    ratio, overlap = pipelined.get("ttft_ratio"), pipelined.get("overlap_ratio")
    return {
        "exposed_tail_le_1.5x_slice": isinstance(tail, float)
        and isinstance(busy, float)
        and tail <= TAIL_FACTOR * busy,
        "ttft_le_0.7x_non_pipelined": isinstance(ratio, float) and ratio <= TTFT_RATIO_MAX,
        "overlap_ge_0.8": isinstance(overlap, float) and overlap >= OVERLAP_MIN,
    }


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op pool at one thread (as the bench's workers run), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def filled(nbytes: int, seed: int = 0) -> torch.Tensor:
    """``nbytes`` of seeded random bytes, every page written (an ``empty`` tensor never written
    reads the kernel's zero page, a copy from it far faster than from real memory)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def memcpy_slice_ms(slice_bytes: int, block_bytes: int, reps: int = 9) -> tuple[float, float]:
    """The physical limit of one slice, ms: the median of ``reps`` torch ``copy_`` s of
    ``slice_bytes`` on one torch thread (as the workers run) from written memory, contiguous,
    and as the slice's blocks (``block_bytes`` each, ``slice_bytes`` a positive multiple)
    copied one by one between seeded random blocks of two pools twice the slice's size -- the
    scatter of a paged pool. Each copy is warmed up once first (first touch)."""
    if block_bytes <= 0 or slice_bytes <= 0 or slice_bytes % block_bytes or reps <= 0:
        raise InvalidArgumentError(
            f"need positive reps and slice_bytes a positive multiple of block_bytes, got "
            f"{slice_bytes}, {block_bytes}, {reps}"
        )
    n = slice_bytes // block_bytes
    src, dst = filled(2 * slice_bytes, 1), torch.zeros(2 * slice_bytes, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(2)
    src_ids = torch.randperm(2 * n, generator=gen)[:n].tolist()
    dst_ids = torch.randperm(2 * n, generator=gen)[:n].tolist()
    a, b = src[:slice_bytes], dst[:slice_bytes]
    blocks_src = src.view(2 * n, block_bytes)
    blocks_dst = dst.view(2 * n, block_bytes)
    pairs = [(blocks_src[s], blocks_dst[d]) for s, d in zip(src_ids, dst_ids, strict=True)]

    def contiguous() -> None:
        b.copy_(a)

    def scattered() -> None:
        for s, d in pairs:
            d.copy_(s)

    out = []
    with one_torch_thread():
        for fn in (contiguous, scattered):
            fn()
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            out.append(round(statistics.median(times) * 1e3, 4))
    return out[0], out[1]
