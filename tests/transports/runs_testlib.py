"""Byte-run test helpers shared by the copier and run-copier tests: disjoint random runs and a
plain slice-by-slice reference move."""

from __future__ import annotations

import numpy as np
import torch

RUN_SLACK = 128
"""Bytes of buffer to allow per run beyond its length (gaps are < 97, the start < 31)."""


def disjoint_runs(rng: np.random.Generator, lengths: np.ndarray, space: int) -> np.ndarray:
    """Offsets of ``lengths`` runs laid in shuffled order with odd gaps (and an odd start) in a
    buffer of ``space >= lengths.sum() + RUN_SLACK * len(lengths)`` bytes: pairwise disjoint."""
    order = rng.permutation(len(lengths))
    offsets = np.zeros(len(lengths), dtype=np.int64)
    at = int(rng.integers(0, 31))
    for i in order:
        offsets[i] = at
        at += int(lengths[i]) + int(rng.integers(0, 97))
    assert at <= space
    return offsets


def reference_runs(
    src: torch.Tensor, so: np.ndarray, dst: torch.Tensor, do: np.ndarray, ln: np.ndarray
) -> torch.Tensor:
    """``dst`` after copying run ``i`` (``ln[i]`` bytes, ``src[so[i]:]`` to ``dst[do[i]:]``),
    one slice assignment per run, on a clone."""
    out = dst.clone()
    for s, d, n in zip(so.tolist(), do.tolist(), ln.tolist(), strict=True):
        out[d : d + n] = src[s : s + n]
    return out
