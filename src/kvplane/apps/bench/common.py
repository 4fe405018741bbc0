"""What the benchmark modules of ``kvplane bench`` share beyond :mod:`.spread` (whose settle
pause and paired ratio it re-exports): a second limit's fields, and the streaming memcpy that
is a second memory-copy limit."""

import statistics
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvplane.apps.bench.spread import SETTLE_S, paired_ratio
from kvplane.transports.native_copy import copy_runs_native, kernel

__all__ = ["SETTLE_S", "limit_fields", "paired_ratio", "stream_fields", "stream_memcpy"]


def limit_fields(
    kind: str, nbytes: int, ours_s: Sequence[float], limit_s: Sequence[float]
) -> dict[str, float]:
    """A row's ``{kind}_limit_gbps`` (median) and ``{kind}_ratio`` (paired) for a second limit
    timed beside the row's main one, ``nbytes`` moved per repeat; nothing when that limit was
    not timed (``limit_s`` empty)."""
    if not limit_s:
        return {}
    return {
        f"{kind}_limit_gbps": round(nbytes / statistics.median(limit_s) / 1e9, 3),
        f"{kind}_ratio": round(paired_ratio(ours_s, limit_s), 3),
    }


def stream_fields(
    nbytes: int, ours_s: Sequence[float], stream_s: Sequence[float]
) -> dict[str, float]:
    """A row's ``stream_limit_gbps`` and ``stream_ratio`` (:func:`limit_fields`) against the
    streaming memcpy of :func:`stream_memcpy`."""
    return limit_fields("stream", nbytes, ours_s, stream_s)


def stream_memcpy(src: torch.Tensor, dst: torch.Tensor) -> Callable[[], None] | None:
    """A thunk copying all of ``src`` into ``dst`` (contiguous CPU tensors of equal byte size)
    as one run of the C run copier on the calling thread -- one ``memcpy`` with streaming
    stores, the fastest copy of a large buffer measured on this project's machines (torch
    ``copy_`` writes through the caches and, after a pause, ran at 5-9 GB/s against 10-14).
    Nothing is copied until it is called. None where the kernel cannot be built or a tensor is
    not a contiguous CPU tensor. Reported beside the benches' torch ``copy_`` limits, which the
    issues name, so that neither a weak limit nor a strong one hides the other."""
    usable = kernel().library is not None and all(
        t.device.type == "cpu" and t.is_contiguous() for t in (src, dst)
    )
    if not usable:
        return None
    a, b = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
    if a.numel() != b.numel():
        return None
    run = np.array([a.numel()], dtype=np.int64)
    zero = np.zeros(1, dtype=np.int64)

    def copy() -> None:
        copy_runs_native(a, zero, b, zero, run, workers=None)

    return copy
