"""What ``kvplane bench vllm-pd`` derives from a PD pair's per-request times, and its verdicts.

Pure functions over the records of ``integrations/vllm/pd_harness`` (``time.monotonic()`` of
both processes of a pair, one host): a request's :class:`Sample`, a (connector, mode) row,
paired time ratios, the ``bench all`` rows and the issue's targets. Not a bench of its own. See
docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvplane.apps.bench.spread import Row, spread_of
from kvplane.errors import InvalidArgumentError

TTFT_DEFINITION = (
    "end-to-end TTFT: pull = prefill_ms + decode_ttft_ms (the hand-over of kv_transfer_params "
    "between the processes left out); pipelined and push = the decode's first token minus the "
    "prefill request's add (the decode request was added before it)"
)
EXPOSED_TAIL_DEFINITION = (
    "decode's first token minus the end of the prefill's last step (the step that finished "
    "it), both time.monotonic() on this host: the KV's last hand-over plus the decode engine's "
    "first forward, the same for every connector; transfer_tail_ms (kvplane only) ends instead "
    "at the prefill side's last slice_done timeline event"
)
PIPELINED_MAX = 0.8
"""Target: kvplane pipelined TTFT <= this x kvplane pull TTFT."""
TARGET_DEFINITIONS = {
    "tokens_equal": "every decoded request's tokens equal one engine's (no connector)",
    "kvplane_pull_le_nixl_pull": "median over prompts of kvplane pull ttft_ms / NixlConnector "
    "pull ttft_ms (same prompts) <= 1.0",
    "pipelined_le_0.8x_pull": "median over prompt pairs of kvplane pipelined ttft_ms / kvplane "
    "pull ttft_ms (same lengths, same engine pair, run alternately) <= 0.8",
}


@dataclass(frozen=True, slots=True)
class Sample:
    """One request through one connector: its times (ms) and decoded tokens.

    ``slot`` pairs requests across connectors and modes (same round and position: the same
    prompt for two connectors in one mode family, a prompt of the same length across them);
    ``prompt`` indexes the bench's prompt list (the reference tokens); ``tp`` is both
    engines' tensor-parallel size."""

    connector: str
    mode: str
    slot: int
    prompt: int
    prefill_ms: float
    decode_ttft_ms: float
    ttft_ms: float
    exposed_tail_ms: float
    transfer_tail_ms: float | None
    tokens: tuple[int, ...]
    tp: int = 1


def _at(rec: Mapping[str, Any], key: str, what: str) -> float:
    value = rec.get(key)
    if not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{what} record has no {key!r}: {sorted(rec)}")
    return float(value)


def sample(
    connector: str,
    mode: str,
    slot: int,
    prompt: int,
    *,
    prefill: Mapping[str, Any],
    decode: Mapping[str, Any],
    slice_done_at: float | None = None,
    tp: int = 1,
) -> Sample:
    """A request's :class:`Sample` from its prefill and decode records (``added_at``,
    ``finished_at``; ``added_at``, ``first_at``, ``tokens``) and, for kvplane, when its last
    slice completed (unknown at TP > 1: the ranks' workers are other processes), both engines
    at ``tp``. :class:`InvalidArgumentError` when a time is missing."""
    p_add, p_end = _at(prefill, "added_at", "prefill"), _at(prefill, "finished_at", "prefill")
    d_add, d_first = _at(decode, "added_at", "decode"), _at(decode, "first_at", "decode")
    prefill_ms, decode_ms = (p_end - p_add) * 1e3, (d_first - d_add) * 1e3
    ttft = prefill_ms + decode_ms if mode == "pull" else (d_first - p_add) * 1e3
    transfer = None if slice_done_at is None else (slice_done_at - p_end) * 1e3
    return Sample(
        connector, mode, slot, prompt, prefill_ms, decode_ms, ttft,
        (d_first - p_end) * 1e3, transfer, tuple(int(t) for t in decode.get("tokens", ())), tp,
    )  # fmt: skip


def _median(values: Sequence[float]) -> float:
    return round(statistics.median(values), 2)


def row(
    connector: str,
    mode: str,
    samples: Sequence[Sample],
    reference: Mapping[int, Sequence[int]],
) -> dict[str, Any]:
    """One (connector, mode, TP size) row: medians over ``samples`` (ms), the TTFT range,
    whether every request's tokens equal ``reference[prompt]`` (False where it has none), and
    ``repeats`` (the number of samples). :class:`InvalidArgumentError` for no samples or
    samples of more than one TP size."""
    if not samples:
        raise InvalidArgumentError(f"row {connector}/{mode}: no samples")
    tps = sorted({s.tp for s in samples})
    if len(tps) != 1:
        raise InvalidArgumentError(f"row {connector}/{mode}: samples at TP sizes {tps}")
    ttft = [s.ttft_ms for s in samples]
    tails = [s.transfer_tail_ms for s in samples if s.transfer_tail_ms is not None]
    return {
        "connector": connector,
        "mode": mode,
        "tp": tps[0],
        "ttft_ms": _median(ttft),
        "ttft_range_ms": [round(min(ttft), 2), round(max(ttft), 2)],
        "decode_ttft_ms": _median([s.decode_ttft_ms for s in samples]),
        "prefill_ms": _median([s.prefill_ms for s in samples]),
        "exposed_tail_ms": _median([s.exposed_tail_ms for s in samples]),
        "transfer_tail_ms": _median(tails) if tails else None,
        "tokens_equal": all(
            s.prompt in reference and list(s.tokens) == list(reference[s.prompt]) for s in samples
        ),
        "repeats": len(samples),
    }


def slot_ratios(
    ours: Sequence[Sample], theirs: Sequence[Sample], field: str = "ttft_ms"
) -> list[float]:
    """``ours / theirs`` of ``field`` per shared slot, in ``ours``' order."""
    by_slot = {s.slot: float(getattr(s, field)) for s in theirs}
    return [float(getattr(s, field)) / by_slot[s.slot] for s in ours if s.slot in by_slot]


def time_ratio(
    ours: Sequence[Sample], theirs: Sequence[Sample], field: str = "ttft_ms"
) -> dict[str, Any] | None:
    """``ours / theirs`` of ``field`` per shared slot: the median, the range and the number of
    pairs (lower is better for ours); None when no slot is shared."""
    ratios = slot_ratios(ours, theirs, field)
    if not ratios:
        return None
    return {
        "ratio": round(statistics.median(ratios), 3),
        "range": [round(min(ratios), 3), round(max(ratios), 3)],
        "pairs": len(ratios),
    }


def at_tp(name: str, tp: int) -> str:
    """``name`` of a row, ratio or target measured with both engines at ``tp``: as is at TP 1,
    suffixed ``_tp<n>`` above."""
    return name if tp == 1 else f"{name}_tp{tp}"


Key = tuple[str, str, int]
"""A sample set's key: connector, mode, both engines' TP size."""

RATIOS = (
    ("kvplane_pull_vs_nixl_pull", ("kvplane", "pull"), ("nixl", "pull"), "ttft_ms",
     "NixlConnector pull", 1.0),
    ("pipelined_vs_pull", ("kvplane", "pipelined"), ("kvplane", "pull"), "ttft_ms",
     "kvplane pull", PIPELINED_MAX),
    ("pipelined_vs_nixl_push", ("kvplane", "pipelined"), ("nixl", "push"), "ttft_ms",
     "NixlConnector push", None),
    ("decode_ttft_kvplane_pull_vs_nixl_pull", ("kvplane", "pull"), ("nixl", "pull"),
     "decode_ttft_ms", "NixlConnector pull", None),
    ("prefill_kvplane_pull_vs_nixl_pull", ("kvplane", "pull"), ("nixl", "pull"), "prefill_ms",
     None, None),
)  # fmt: skip
"""The paired ratios: name, ours, theirs (connector, mode), the field, and for a ``bench all``
row the limit's name (None: a ratio only) and the target."""


def ratios_at(samples: Mapping[Key, Sequence[Sample]], tp: int) -> dict[str, Any]:
    """Every :data:`RATIOS` entry (:func:`time_ratio`, None where a side did not run) between
    the samples at ``tp``, named by :func:`at_tp`."""
    return {
        at_tp(name, tp): time_ratio(
            samples.get((*ours, tp), ()), samples.get((*theirs, tp), ()), field
        )
        for name, ours, theirs, field, _limit, _target in RATIOS
    }


def bench_rows(samples: Mapping[Key, Sequence[Sample]], tp: int = 1) -> list[dict[str, object]]:
    """One ``bench all`` row per :data:`RATIOS` entry with a limit whose both sides ran at
    ``tp`` (named by :func:`at_tp`): ours and the limit as medians (ms), the spread of the
    per-slot ratios ``ours / limit`` (lower is better)."""
    out: list[dict[str, object]] = []
    for name, ours, theirs, field, limit_name, target in RATIOS:
        if limit_name is None:
            continue
        a, b = samples.get((*ours, tp), ()), samples.get((*theirs, tp), ())
        ratios = slot_ratios(a, b, field)
        if not ratios:
            continue
        row = Row(
            "vllm_pd", at_tp(name, tp), statistics.median(float(getattr(s, field)) for s in a),
            "ms", statistics.median(float(getattr(s, field)) for s in b),
            limit_name if tp == 1 else f"{limit_name} at TP {tp}", spread_of(ratios), target, False,
        )  # fmt: skip
        out.append(row.as_dict())
    return out


def targets(
    rows: Sequence[Mapping[str, Any]],
    ratios: Mapping[str, dict[str, Any] | None],
    tps: Sequence[int] = (1,),
) -> dict[str, dict[str, Any]]:
    """The issue's targets, each ``met`` (false where it could not be measured, with
    ``why``), its measured ``value`` and the ``limit``: ``tokens_equal`` over every row, and
    the two ratio targets per TP size of ``tps`` (named by :func:`at_tp`); ``ratios`` holds
    ``kvplane_pull_vs_nixl_pull`` and ``pipelined_vs_pull`` per TP size (:func:`ratios_at`)."""
    out: dict[str, dict[str, Any]] = {}
    errors = [at_tp(f"{r['connector']}/{r['mode']}", int(r.get("tp", 1)))
              for r in rows if "error" in r]  # fmt: skip
    equal = all(r.get("tokens_equal") is True for r in rows if "error" not in r)
    out["tokens_equal"] = {"met": equal and not errors, "value": equal, "limit": True}
    if errors:
        out["tokens_equal"]["why"] = f"not run: {', '.join(errors)}"
    for tp in tps:
        for name, key, limit in (
            ("kvplane_pull_le_nixl_pull", "kvplane_pull_vs_nixl_pull", 1.0),
            ("pipelined_le_0.8x_pull", "pipelined_vs_pull", PIPELINED_MAX),
        ):
            got = ratios.get(at_tp(key, tp))
            if got is None:
                out[at_tp(name, tp)] = {
                    "met": False, "value": None, "limit": limit, "why": "not measured",
                }  # fmt: skip
            else:
                out[at_tp(name, tp)] = {
                    "met": got["ratio"] <= limit, "value": got["ratio"], "limit": limit,
                }  # fmt: skip
    return out
