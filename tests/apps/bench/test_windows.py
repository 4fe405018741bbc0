"""``kvplane bench windows --quick``: the exact bytes and blocks it reports for a 256-token
prompt of its mixed-window Qwen2 (they are deterministic: no timed assertion), its JSON shape,
and its refusals. Expected figures are worked out here from the model's shape, not read back
from kvplane."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvplane.apps.bench import windows
from kvplane.apps.bench.windows_model import MixedModel
from kvplane.errors import InvalidArgumentError

CELL = 2 * 2 * 16 * 4
"""One position of one layer: K and V x 2 KV heads x head_dim 16 x float32."""
TAIL = 32
W, B, CHUNK, N = 128, 16, 32, 256
"""Window, block, chunk tokens, the quick prompt."""


def test_quick_run_reports_the_exact_bytes_and_blocks() -> None:
    out: dict[str, Any] = windows.run(True, argparse.Namespace(lengths=None, transport="shm"))
    json.dumps(out)  # one JSON object
    assert set(out) == {"rows", "workload", "lengths", "tokens_equal", "host_load"}
    [entry] = out["lengths"]
    # full layers 1, 3: every position; window layers 0, 2: the W - 1 before the next token
    minimum = (2 * N + 2 * (W - 1)) * CELL + TAIL
    assert entry["minimum_bytes"] == minimum == 196_128
    assert entry["pd_bytes"] == {"on": minimum, "off": minimum}
    assert entry["pd_logical_bytes"] == {"on": minimum, "off": minimum}
    assert entry["amplification"] == {"on": 1.0, "off": 1.0}
    # decode side, groups on: window group from position N + 1 - W = 129 (block 8) on, 8 blocks
    # of 2 layers; full group 16 blocks of 2 layers. Off: 16 blocks of all 4 layers
    assert entry["decode_blocks"] == {"on": [(N - (N + 1 - W) // B * B) // B, N // B], "off": [16]}
    assert entry["decode_blocks"]["on"] == [8, 16]
    assert entry["decode_block_layers"] == {"on": 8 * 2 + 16 * 2, "off": 16 * 4}
    # the prefix store keeps every full chunk of both groups: the same bytes either way
    assert entry["store_chunks"] == {"on": [N // CHUNK] * 2, "off": [N // CHUNK]}
    assert entry["store_bytes"] == {"on": N * 4 * CELL, "off": N * 4 * CELL}
    # the prefill side's peak: a window group holds a step and its window (128 + 127
    # positions) and a store unit in flight, which at 256 tokens is every block: no saving yet
    assert entry["prefill_peak_blocks"] == {"on": [N // B, N // B], "off": [N // B]}
    assert entry["prefill_peak_block_layers"] == {"on": 16 * 2 + 16 * 2, "off": 16 * 4}
    assert entry["tokens_equal"] is True and out["tokens_equal"] is True
    assert entry["ttft_ms"]["on"] > 0 and entry["ttft_ms"]["off"] > 0
    assert entry["ttft_on_vs_off"]["repeats"] == 3
    rows = out["rows"]
    assert [r["row"] for r in rows] == [
        "pd_bytes_256_groups_on_vs_minimum",
        "ttft_256_groups_on_vs_off",
    ]
    bytes_row = rows[0]
    assert (bytes_row["ratio_median"], bytes_row["ratio_max"], bytes_row["met"]) == (1.0, 1.0, True)
    assert bytes_row["repeats"] == 4  # the measured request and the three timed ones
    assert rows[1]["target"] is None and rows[1]["ratio_median"] > 0
    assert len(out["host_load"]["before"]) == 3


def test_minimum_of_a_prompt_inside_the_window_is_every_position(tmp_path: Path) -> None:
    model = MixedModel.write(tmp_path / "ckpt")
    assert model.minimum_bytes(100) == 4 * 100 * CELL + TAIL
    assert model.minimum_bytes(W) == (2 * W + 2 * (W - 1)) * CELL + TAIL
    assert [p.layer_ids for p in model.pools(True)] == [(0, 2), (1, 3)]
    assert [p.layer_ids for p in model.pools(False)] == [(0, 1, 2, 3)]
    assert model.block_layers(True, {0: 3, 1: 5}) == 16
    assert model.chunk_bytes(False, {0: 2}) == 2 * CHUNK * 4 * CELL


@pytest.mark.parametrize("text", ["", "0", "64,abc", "4096"])
def test_bad_lengths_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError, match="--lengths"):
        windows.run(True, argparse.Namespace(lengths=text, transport="shm"))


def test_an_unknown_transport_is_skipped_without_starting_workers() -> None:
    out = windows.run(True, argparse.Namespace(lengths="64", transport="nope"))
    assert out["skipped"] == "unknown transport" and out["rows"] == []
