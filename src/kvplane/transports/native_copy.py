"""Byte-run copies by a small C kernel (``native/run_copy.c``) that releases the GIL.

One window per copy thread, streaming stores for large moves; False where the kernel cannot be
built. See docs/transports.md.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
import torch

from kvplane.errors import InvalidArgumentError
from kvplane.native import KernelBuild, load_kernel
from kvplane.transports.descriptors import Int64Array
from kvplane.transports.workers import CopyWorkers

SOURCE = Path(__file__).parent / "native" / "run_copy.c"
STREAM_MIN = 1 << 20
"""Moves of at least this many bytes are written with non-temporal stores."""
SPLIT_MIN = 1 << 20
"""Smallest window worth handing to a helper thread: waking one costs ~50-100 us on a loaded
host, about what copying 1 MiB takes (a 1 MiB move split in two took 250 us, whole 150 us)."""

_P = ctypes.c_void_p
_I = ctypes.c_int64
_SIGNATURE: list[type[ctypes.c_void_p | ctypes.c_int64 | ctypes.c_int]] = [
    _P, _P, _P, _P, _P, _I, _I, _I, _I, ctypes.c_int,
]  # fmt: skip


@functools.cache
def kernel() -> KernelBuild:
    """The loaded kernel, built on first use (once per process; a memo of a constant)."""
    return load_kernel(SOURCE, {"kvp_copy_window": (_SIGNATURE, None)})


def _flat_bytes(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous()


def _check_inside(offsets: Int64Array, lengths: Int64Array, size: int, side: str) -> None:
    """Every run ``[offset, offset + length)`` inside ``[0, size)``; lengths are >= 0 (checked
    first), so ``size - lengths`` cannot wrap where ``offsets + lengths`` could."""
    if int(offsets.min()) < 0 or bool((offsets > size - lengths).any()):
        raise InvalidArgumentError(f"a {side} run falls outside its {size}-byte buffer")


def copy_runs_native(
    src: torch.Tensor, src_offsets: Int64Array, dst: torch.Tensor, dst_offsets: Int64Array,
    lengths: Int64Array, *, workers: CopyWorkers | None,
) -> bool:  # fmt: skip
    """Copy ``lengths[i]`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]`` for
    every i; False (nothing copied) when the kernel is unavailable or a buffer is not a flat,
    contiguous CPU ``uint8`` tensor.

    The caller guarantees that no two destination runs overlap and that no destination run
    overlaps a source run; every run is checked against its buffer here (InvalidArgumentError,
    nothing copied) because the kernel trusts its offsets. Mutates ``dst`` only. ``workers``
    (optional) copy windows of the move in parallel with the calling thread.
    """
    build = kernel()
    if build.library is None or not (_flat_bytes(src) and _flat_bytes(dst)):
        return False
    n = len(lengths)
    if n == 0:
        return True
    so = np.ascontiguousarray(src_offsets, dtype=np.int64)
    do = np.ascontiguousarray(dst_offsets, dtype=np.int64)
    ln = np.ascontiguousarray(lengths, dtype=np.int64)
    shortest, length = int(ln.min()), int(ln.max())
    if shortest < 0:
        raise InvalidArgumentError("a run length is negative")
    _check_inside(so, ln, src.numel(), "source")
    _check_inside(do, ln, dst.numel(), "destination")
    ends = None if shortest == length else np.cumsum(ln)
    total = length * n if ends is None else int(ends[-1])
    if total == 0:
        return True
    fn = build.library.kvp_copy_window
    stream = int(total >= STREAM_MIN)
    s_ptr, d_ptr = src.data_ptr(), dst.data_ptr()
    so_ptr, do_ptr = so.ctypes.data, do.ctypes.data
    ends_ptr = None if ends is None else ends.ctypes.data

    def window(a: int, b: int) -> None:  # bytes [a, b) of the runs laid end to end
        fn(s_ptr, d_ptr, so_ptr, do_ptr, ends_ptr, length, n, a, b, stream)

    if workers is None or total < 2 * SPLIT_MIN:
        window(0, total)
    else:
        workers.run(window, total, min_part=SPLIT_MIN)
    return True
