"""``kvplane bench windows``: what KV cache groups save on a model mixing sliding-window and
full-attention layers, measured against the minimum the decode side needs.

Serves the tiny mixed-window Qwen2 of :mod:`.windows_model` through two real prefill/decode
worker pairs (:mod:`.windows_pair`, shm), ``--kv-groups on`` and ``off``, and reports per prompt
length: PD bytes against the minimum (amplification), the decode side's block-layers at the end,
prefix-store bytes (host tier on), TTFT on vs off paired request by request, and whether both
decoded the same tokens. Measures nothing itself beyond calling the pairs; docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvplane.apps.bench.pd_pair import prompt
from kvplane.apps.bench.spread import Row, repeat_until_stable, spread, spread_of
from kvplane.apps.bench.windows_model import BLOCK_SIZE, VOCAB, WINDOW, MixedModel
from kvplane.apps.bench.windows_pair import STORE_COUNTERS, Served, WindowPair, WindowPairSpec
from kvplane.errors import InvalidArgumentError
from kvplane.transports.registry import available

NAME = "windows"
HELP = "KV cache groups on vs off (mixed-window model): PD bytes vs minimum, blocks, TTFT."
LENGTHS = {True: (256,), False: (256, 512, 1024, 2048)}
"""Prompt lengths per ``--quick`` (tokens; at most 2048, positions end at 4096)."""
REPEATS = {True: (3, 3), False: (5, 12)}
"""TTFT requests per length, (at least, at most), per ``--quick``."""
CAP_S = {True: 5.0, False: 30.0}
"""Seconds one length's TTFT requests may keep repeating for a stable ratio, per ``--quick``."""
STEP = 128
"""Prefill step, tokens (a window's worth: the prefill drops window blocks after each step)."""
NEW_TOKENS = 8
"""Tokens each TTFT request decodes (the decode side's model runs on its groups' pages)."""
HOST_SLOTS = 256
"""The prefill's host-tier chunk slots (a 2048-token prompt stores 64 chunks per pool)."""
MODES = {"on": True, "off": False}
"""The pairs by ``--kv-groups``; the rows' ratios are on / off."""
MEASURED = ("first_token", "pd_logical_bytes", "decode_blocks", "decode_block_layers",
            "store_chunks", "store_bytes", "prefill_peak_blocks",
            "prefill_peak_block_layers")  # fmt: skip
"""What :func:`_measure` reads per mode."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths", default=None,
        help="comma-separated prompt lengths (default: 256,512,1024,2048; with --quick 256)",
    )  # fmt: skip
    parser.add_argument("--transport", default="shm", help="PD transport (default: shm)")


def _lengths(text: str | None, quick: bool) -> tuple[int, ...]:
    if text is None:
        return LENGTHS[quick]
    try:
        got = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise InvalidArgumentError(f"--lengths must be integers, got {text!r}") from None
    if not got or any(not 1 <= n <= 2048 for n in got):
        raise InvalidArgumentError(f"--lengths must be 1..2048 tokens, got {text!r}")
    return tuple(sorted(set(got)))  # ascending: a pool's peak so far is the latest length's


class _Prompts:
    """Prompts no earlier one shares a first token with (no prefix hit in any cache or store)."""

    def __init__(self) -> None:
        self.served = 0

    def next(self, length: int) -> list[int]:
        self.served += 1
        return prompt(self.served, length, VOCAB)


def _measure(
    pairs: dict[str, WindowPair], model: MixedModel, length: int, tokens: list[int]
) -> dict[str, Any]:
    """One request of one new token (the decode side runs no step: what it took is what it
    holds at the end) through each pair, each pair idle before and after: kvplane's logical
    bytes, the decode side's blocks per pool and the prefix-store chunks per pool, as deltas;
    and the prefill side's peak blocks per pool since start (lengths ascend, and the full
    group's peak grows with the prompt, so it is this length's; a window group's is flat)."""
    rid = f"m{length}"
    got: dict[str, Any] = {key: {} for key in MEASURED}
    for mode, pair in pairs.items():
        groups = MODES[mode]
        before, taken_before = pair.wait_idle(), pair.allocated("decode")
        got["first_token"][mode] = pair.run(rid, tokens, STEP, 1).tokens
        after, taken_after = pair.wait_idle(), pair.allocated("decode")
        pools = range(len(model.pools(groups)))
        blocks = {g: taken_after.get(g, 0) - taken_before.get(g, 0) for g in pools}
        chunks = {g: after[k] - before[k] for g, k in zip(pools, STORE_COUNTERS, strict=False)}
        got["pd_logical_bytes"][mode] = after["pd_logical_bytes"] - before["pd_logical_bytes"]
        got["decode_blocks"][mode] = [blocks[g] for g in pools]
        got["decode_block_layers"][mode] = model.block_layers(groups, blocks)
        got["store_chunks"][mode] = [chunks[g] for g in pools]
        got["store_bytes"][mode] = model.chunk_bytes(groups, chunks)
        peaks = pair.peak_used("prefill")
        got["prefill_peak_blocks"][mode] = [peaks.get(g, 0) for g in pools]
        got["prefill_peak_block_layers"][mode] = model.block_layers(groups, peaks)
    return got


def _ttft(
    pairs: dict[str, WindowPair], length: int, prompts: _Prompts, quick: bool
) -> tuple[list[str], dict[str, list[float]], bool]:
    """Requests of ``length`` tokens through the on pair and at once the off pair until their
    paired TTFT ratio is stable (:func:`~.spread.repeat_until_stable`); the request ids, the
    TTFTs (ms) per mode and whether both decoded the same :data:`NEW_TOKENS` every time."""
    rids: list[str] = []
    ttft: dict[str, list[float]] = {mode: [] for mode in pairs}
    same = [True]

    def both() -> tuple[float, float]:
        rid, tokens = f"t{length}.{len(rids)}", prompts.next(length)
        rids.append(rid)
        served: dict[str, Served] = {
            mode: pair.run(rid, tokens, STEP, NEW_TOKENS) for mode, pair in pairs.items()
        }
        for mode, s in served.items():
            ttft[mode].append(s.ttft_ms)
        same[0] = same[0] and served["on"].tokens == served["off"].tokens
        return served["on"].ttft_ms / 1e3, served["off"].ttft_ms / 1e3

    low, high = REPEATS[quick]
    repeat_until_stable(both, min_repeats=low, max_repeats=high, cap_s=CAP_S[quick])
    return rids, ttft, same[0]


def _length(
    pairs: dict[str, WindowPair], model: MixedModel, length: int, prompts: _Prompts, quick: bool
) -> tuple[dict[str, Any], list[dict[str, object]]]:
    """One prompt length's entry and its two ``bench all`` rows."""
    minimum = model.minimum_bytes(length)
    got = _measure(pairs, model, length, prompts.next(length))
    rids, ttft, same = _ttft(pairs, length, prompts, quick)
    rids.append(f"m{length}")
    moved = {mode: pair.slice_bytes(rids) for mode, pair in pairs.items()}
    ratios = {mode: [moved[mode][r] / minimum for r in rids] for mode in pairs}
    ttft_spread = spread(ttft["on"], ttft["off"], higher_is_better=False)
    first = got.pop("first_token")
    entry: dict[str, Any] = {
        "tokens": length,
        "minimum_bytes": minimum,
        "pd_bytes": {mode: moved[mode][f"m{length}"] for mode in pairs},
        "amplification": {mode: round(statistics.median(r), 4) for mode, r in ratios.items()},
        **got,
        "ttft_ms": {mode: round(statistics.median(t), 3) for mode, t in ttft.items()},
        "ttft_on_vs_off": ttft_spread.fields(),
        "tokens_equal": same and first["on"] == first["off"],
    }
    rows = [
        Row(NAME, f"pd_bytes_{length}_groups_on_vs_minimum", entry["pd_bytes"]["on"], "B",
            minimum, "decode side's minimum", spread_of(ratios["on"]), 1.0, False).as_dict(),
        Row(NAME, f"ttft_{length}_groups_on_vs_off", entry["ttft_ms"]["on"], "ms",
            entry["ttft_ms"]["off"], "groups off", ttft_spread, None, False).as_dict(),
    ]  # fmt: skip
    return entry, rows


def _pairs(work: Path, model: MixedModel, transport: str, longest: int) -> dict[str, WindowPair]:
    """Both pairs started at once, then connected (their imports overlap)."""
    blocks = 2 * -(-longest // BLOCK_SIZE) + 8
    made: dict[str, WindowPair] = {}
    try:
        for mode, groups in MODES.items():
            spec = WindowPairSpec(model.path, groups, transport, STEP, blocks, HOST_SLOTS)
            made[mode] = WindowPair(work / mode, spec)
        for pair in made.values():
            pair.connect()
    except BaseException:
        for pair in made.values():
            pair.close()
        raise
    return made


def serve_lengths(
    work: Path, transport: str, lengths: tuple[int, ...], quick: bool
) -> tuple[list[dict[str, Any]], list[dict[str, object]]]:
    """Every length through both pairs of a checkpoint written under ``work``: the per-length
    entries and their rows. :class:`KVPlaneError` when a worker ends holding memory or with
    broken integrity."""
    model = MixedModel.write(work / "checkpoint")
    pairs = _pairs(work, model, transport, max(lengths))
    prompts = _Prompts()
    entries: list[dict[str, Any]] = []
    rows: list[dict[str, object]] = []
    try:
        for pair in pairs.values():
            pair.run("warm", prompt(-1, STEP, VOCAB), STEP, 1)
        for length in lengths:
            entry, got = _length(pairs, model, length, prompts, quick)
            entries.append(entry)
            rows.extend(got)
        for pair in pairs.values():
            pair.wait_idle()  # every pool and ledger balanced, or it raises
    finally:
        for pair in pairs.values():
            pair.close()
    return entries, rows


def _load() -> list[float]:
    """This host's 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def run(quick: bool, args: argparse.Namespace) -> dict[str, object]:
    lengths = _lengths(getattr(args, "lengths", None), quick)
    transport = getattr(args, "transport", None) or "shm"
    workload: dict[str, object] = {
        "model": "Qwen2 4 layers (sliding, full, sliding, full), 2 KV heads x 16, float32",
        "window": WINDOW, "block_size": BLOCK_SIZE, "step": STEP, "new_tokens": NEW_TOKENS,
        "transport": transport, "lengths": list(lengths), "host_slots": HOST_SLOTS,
    }  # fmt: skip
    reason = available().get(transport, "unknown transport")
    if reason is not None:
        return {"rows": [], "workload": workload, "skipped": reason}
    load_before = _load()
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-windows-") as work:
        entries, rows = serve_lengths(Path(work), transport, lengths, quick)
    return {
        "rows": rows,
        "workload": workload,
        "lengths": entries,
        "tokens_equal": all(e["tokens_equal"] for e in entries),
        "host_load": {"before": load_before, "after": _load()},
    }
