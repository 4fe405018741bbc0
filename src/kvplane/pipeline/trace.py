"""Chrome/Perfetto trace export of the workers' timelines, and its reader.

Spans per step, slice, load, store, decode and a decode worker's order accept; a pid per
worker, a tid per request. See docs/pipeline.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.errors import InvalidArgumentError
from kvplane.pipeline.timeline import Mark, TimelineEvent

SPANS: dict[str, tuple[str, tuple[str, ...]]] = {
    Mark.STEP_START.value: ("prefill step", (Mark.STEP_END.value,)),
    Mark.SLICE_SUBMIT.value: ("slice transfer", (Mark.SLICE_DONE.value, Mark.SLICE_FAILED.value)),
    Mark.LOAD_START.value: ("offload load", (Mark.LOAD_DONE.value,)),
    Mark.STORE_START.value: ("offload store", (Mark.STORE_DONE.value,)),
    Mark.DECODE_READY.value: ("decode", (Mark.DECODE_DONE.value,)),
    Mark.ACCEPT_START.value: ("order accept", (Mark.ACCEPT_DONE.value,)),
}
"""Start mark → (span name, the marks that end it)."""

_ENDS = {end: start for start, (_n, ends) in SPANS.items() for end in ends}


@dataclass(frozen=True, slots=True)
class Span:
    """One complete span: worker, request, name, slice id (None: not a slice), start and end (s)."""

    worker: str
    request_id: str
    name: str
    slice_id: int | None
    start: float
    end: float
    detail: str = ""


def events_from_dicts(rows: Iterable[Mapping[str, Any]]) -> list[TimelineEvent]:
    """Timeline events from their ``as_dict`` form (``InvalidArgumentError`` if malformed)."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(
                TimelineEvent(
                    t=float(row["t"]),
                    worker=str(row["worker"]),
                    mark=str(row["mark"]),
                    request_id=str(row["request_id"]),
                    slice_id=_optional_int(row.get("slice_id")),
                    nbytes=int(row.get("nbytes", 0)),
                    detail=str(row.get("detail", "")),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"timeline event {i} is malformed ({exc}): {row!r}"
            ) from None
    return sorted(out, key=lambda e: e.t)


def spans(events: Iterable[TimelineEvent]) -> tuple[list[Span], list[TimelineEvent]]:
    """Pair start/end events per (worker, request, kind, slice); the rest are instants."""
    open_: dict[tuple[str, str, str, int | None], TimelineEvent] = {}
    done: list[Span] = []
    instants: list[TimelineEvent] = []
    for e in sorted(events, key=lambda e: e.t):
        if e.mark in SPANS:
            open_[(e.worker, e.request_id, e.mark, e.slice_id)] = e
            continue
        start_mark = _ENDS.get(e.mark)
        key = (e.worker, e.request_id, start_mark or "", e.slice_id)
        if start_mark is None or key not in open_:
            instants.append(e)
            continue
        s = open_.pop(key)
        name = SPANS[start_mark][0]
        detail = e.detail or s.detail
        done.append(Span(e.worker, e.request_id, name, e.slice_id, s.t, e.t, detail))
    instants.extend(open_.values())
    return done, sorted(instants, key=lambda e: e.t)


def chrome_trace(
    events: Iterable[TimelineEvent], other: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The Trace Event Format object (``traceEvents`` + ``otherData``) of ``events``."""
    evs = sorted(events, key=lambda e: e.t)
    t0 = evs[0].t if evs else 0.0
    workers = sorted({e.worker for e in evs})
    requests = sorted({e.request_id for e in evs})
    pid = {w: i + 1 for i, w in enumerate(workers)}
    tid = {r: i + 1 for i, r in enumerate(requests)}
    out: list[dict[str, Any]] = []
    for w in workers:
        out.append({"ph": "M", "name": "process_name", "pid": pid[w], "args": {"name": w}})
        for r in sorted({e.request_id for e in evs if e.worker == w}):
            out.append(
                {
                    "ph": "M",
                    "name": "thread_name",
                    "pid": pid[w],
                    "tid": tid[r],
                    "args": {"name": r},
                }
            )
    done, instants = spans(evs)
    for s in done:
        label = f"{s.name} {s.slice_id}" if s.slice_id is not None else s.name
        out.append({
            "ph": "X", "name": label, "cat": s.name, "pid": pid[s.worker], "tid": tid[s.request_id],
            "ts": round((s.start - t0) * 1e6, 3), "dur": round((s.end - s.start) * 1e6, 3),
            "args": {"request": s.request_id, "slice": s.slice_id, "detail": s.detail},
        })  # fmt: skip
    for e in instants:
        out.append({
            "ph": "i", "s": "t", "name": e.mark, "cat": "event", "pid": pid[e.worker],
            "tid": tid[e.request_id], "ts": round((e.t - t0) * 1e6, 3),
            "args": {"request": e.request_id, "slice": e.slice_id, "detail": e.detail},
        })  # fmt: skip
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"t0": t0, **(other or {})},
    }


def write_trace(path: Path, trace: Mapping[str, Any]) -> None:
    """Write ``trace`` as JSON (atomically: a temp file renamed into place)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(trace, separators=(",", ":")))
    tmp.replace(path)


def read_trace(path: Path) -> tuple[list[Span], dict[str, Any]]:
    """The spans and ``otherData`` of a saved trace (times in seconds since its start);
    ``InvalidArgumentError`` naming the problem for a missing or malformed file."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgumentError(f"no trace at {path}") from None
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"{path} is not a JSON trace: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise InvalidArgumentError(f"{path} has no traceEvents list")
    names: dict[int, str] = {}
    rows = data["traceEvents"]
    for ev in rows:
        if isinstance(ev, dict) and ev.get("ph") == "M" and ev.get("name") == "process_name":
            names[int(ev["pid"])] = str(ev.get("args", {}).get("name", ev["pid"]))
    out: list[Span] = []
    for i, ev in enumerate(rows):
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        try:
            args = ev.get("args", {})
            start = float(ev["ts"]) / 1e6
            out.append(
                Span(
                    names.get(int(ev["pid"]), str(ev["pid"])),
                    str(args.get("request", ev["tid"])),
                    str(ev.get("cat", ev["name"])),
                    _optional_int(args.get("slice")),
                    start,
                    start + float(ev["dur"]) / 1e6,
                    str(args.get("detail", "")),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{path}: trace event {i} is malformed ({exc})") from None
    other = data.get("otherData")
    return out, dict(other) if isinstance(other, dict) else {}


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
