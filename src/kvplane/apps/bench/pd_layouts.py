"""The layout rows of ``kvplane bench pd``: the pipelined/non-pipelined comparison with the
prefill split over two TP ranks (``tp2->1``) or two pipeline stages (``pp2->1``) feeding one
decode process, beside the same model's ``1->1`` pair, so the rows compare.

The tiny GQA Llama is the producer of every layout row (two KV heads and two layers: TP 2
splits its heads, PP 2 its layers); the synthetic producer has no ranks. The layout's targets
are the 1->1 ones (:func:`~.pd_metrics.targets`) plus "hold as for 1->1"
(:data:`LAYOUT_TARGET_DEFINITIONS`). Owns the layout rows' spec, assembly and verdicts; the
processes are :mod:`.pd_ranks`'s, the request loop :mod:`.pd_pair`'s. See docs/benchmarks.md.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvplane.apps.bench.pd_metrics import bench_rows, targets
from kvplane.apps.bench.pd_model import model_spec, pair_head
from kvplane.apps.bench.pd_pair import (
    FIXED_MODES,
    Group,
    Interleaved,
    compare_modes,
    mode_rows,
)
from kvplane.apps.bench.pd_ranks import BASE_LAYOUT, LAYOUTS, Ranks
from kvplane.apps.bench.spread import paired_ratio
from kvplane.errors import InvalidArgumentError
from kvplane.models import TINY_LLAMA, tiny_config

MODEL = TINY_LLAMA
RATIO_SLACK = 1.1
"""Target: a layout's pipelined TTFT ratio at most this × the 1->1 row's (10%: this host's
noise, as for ``--pipelining auto``)."""
OVERLAP_SLACK = 0.1
"""Target: a layout's pipelined overlap at least the 1->1 row's minus this."""
RATIO_KEY = "ttft_ratio_le_1.1x_1->1"
OVERLAP_KEY = "overlap_ge_1->1_minus_0.1"
LAYOUT_TARGET_DEFINITIONS = {
    RATIO_KEY: "pipelined ttft_ratio <= 1.1 * the 1->1 layout row's (the same model, prompts, "
    "transport and run); false when either is null",
    OVERLAP_KEY: "pipelined overlap_ratio >= the 1->1 layout row's - 0.1; false when either is "
    "null",
}
"""The "hold as for 1->1" targets of a layout row, beside :data:`~.pd_metrics.TARGET_DEFINITIONS`
(whose TTFT target needs a calibrated step: the tiny model's slices are small against its
steps, so its 0.7 is reported, not expected)."""
Times = dict[str, tuple[list[dict[str, float | None]], int]]


def _number(row: Mapping[str, object], key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def layout_targets(pipelined: Mapping[str, object], base: Mapping[str, object]) -> dict[str, bool]:
    """A layout's pipelined mode row judged as the 1->1 rows are (:func:`~.pd_metrics.targets`)
    and against the 1->1 layout's pipelined row ``base`` (:data:`LAYOUT_TARGET_DEFINITIONS`);
    each false where a number it needs is missing."""
    out = targets(pipelined)
    ratio, base_ratio = _number(pipelined, "ttft_ratio"), _number(base, "ttft_ratio")
    overlap, base_overlap = _number(pipelined, "overlap_ratio"), _number(base, "overlap_ratio")
    out[RATIO_KEY] = (
        ratio is not None and base_ratio is not None and (ratio <= RATIO_SLACK * base_ratio)
    )
    out[OVERLAP_KEY] = (
        overlap is not None
        and base_overlap is not None
        and (overlap >= base_overlap - OVERLAP_SLACK)
    )
    return out


def layout_entry(
    layout: str,
    transport: str,
    served: Interleaved,
    times: Times,
    base: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One layout's result from its comparison: the mode rows and ``bench all`` rows (each
    with ``layout``), the paired ``ttft_ratio``, ``requests`` and the targets judged against
    ``base``, the 1->1 layout's entry (None: this is it). The TTFT row's target is the 1->1
    row's ratio × :data:`RATIO_SLACK` (none for 1->1 itself)."""
    modes = mode_rows(transport, served, times, layout=layout)
    ttft = served.ttft_ms
    ratio = round(paired_ratio(ttft["non_pipelined"], ttft["pipelined"]), 4)
    modes[0]["ttft_ratio"] = ratio
    modes[0]["requests"] = len(served.rids)
    target = None if base is None else round(RATIO_SLACK * base["ttft_ratio"], 4)
    rows = bench_rows(
        f"{MODEL}_{layout}", ttft, times["pipelined"][0], ttft_target=target,
        layout=layout,
    )  # fmt: skip
    judged = layout_targets(modes[0], modes[0] if base is None else base["modes"][0])
    return {"layout": layout, "ranks": len(LAYOUTS[layout]), "modes": modes, "rows": rows,
            "ttft_ratio": ratio, "requests": len(served.rids), "targets": judged}  # fmt: skip


def tokens_equal(decoded: Sequence[Mapping[str, tuple[int, ...]]]) -> bool:
    """Whether every group decoded the same tokens for each request id they all served."""
    common = set.intersection(*(set(d) for d in decoded)) if decoded else set()
    return all(len({d[rid] for d in decoded}) == 1 for rid in common)


def layout_result(
    transport: str,
    tokens: int,
    step: int,
    repeats: tuple[int, int],
    cap_s: float,
    *,
    layouts: Sequence[str] = tuple(LAYOUTS),
) -> dict[str, Any]:
    """Serve the same prompts through each layout of ``layouts`` (1->1 first, then its
    ``--tp``/``--pp`` groups), pipelined and not, one layout's processes at a time:
    ``{"model", "dtype", "transport", "tokens", "step", "layouts", "rows", "tokens_equal",
    "target_definitions"}`` (``tokens_equal``: every layout and mode decoded the same first
    tokens for the requests they share). ``InvalidArgumentError`` unless ``layouts`` starts
    with 1->1 (the others are judged against it)."""
    if not layouts or layouts[0] != BASE_LAYOUT:
        raise InvalidArgumentError(f"layout rows start with {BASE_LAYOUT}, got {list(layouts)}")
    spec = model_spec(transport, tokens, step, MODEL)
    vocab = tiny_config(MODEL).vocab_size
    entries: list[dict[str, Any]] = []
    groups: list[Group] = []
    for layout in layouts:

        def start(at: Path, mode: str, layout: str = layout) -> Group:
            group = Ranks(at, spec, layout, mode=mode, wait=False)
            groups.append(group)
            return group

        with tempfile.TemporaryDirectory(prefix="kvplane-bench-pd-layout-") as work:
            served, times, _same = compare_modes(
                Path(work), spec, repeats, cap_s, vocab, modes=FIXED_MODES, start=start
            )
        entries.append(
            layout_entry(layout, transport, served, times, entries[0] if entries else None)
        )
    return {
        **pair_head(spec, MODEL),
        "layouts": entries,
        "rows": [r for e in entries for r in e["rows"]],
        "tokens_equal": tokens_equal([g.tokens for g in groups]),
        "target_definitions": LAYOUT_TARGET_DEFINITIONS,
    }
