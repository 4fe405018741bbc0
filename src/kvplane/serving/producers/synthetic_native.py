"""The synthetic producer's whole-block write by a C kernel (``native/synthetic_kv.c``).

Streaming stores leave memory bandwidth to the transfer beside it; :func:`xor_blocks` returns
False where the kernel cannot run. See docs/serving.md.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from kvplane.native import KernelBuild, load_kernel

SOURCE = Path(__file__).parent / "native" / "synthetic_kv.c"

_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def kernel() -> KernelBuild:
    """The loaded kernel, built on first use (once per process; a memo of a constant)."""
    return load_kernel(SOURCE, {"kvp_xor_blocks": ([_P, _P, _P, _I, _I, _I, _I], None)})


def _words(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.int64 and t.is_contiguous()


def xor_blocks(dst: torch.Tensor, row: torch.Tensor, cols: torch.Tensor) -> bool:
    """``dst[n, l, c, t, h, x] = row[n, 0, 0, t, 0, 0] ^ cols[0, l, c, 0, h, x]``: the broadcast
    XOR of whole blocks, written into ``dst`` (int64 words ``[n, L, C, Tb, H, X]``, ``row``
    ``[n, 1, 1, Tb, 1, 1]``, ``cols`` ``[1, L, C, 1, H, X]``). False (nothing written) when the
    kernel is unavailable or a tensor is not a contiguous CPU int64 tensor of those shapes.
    Mutates ``dst`` only; the words are visible to other threads when it returns."""
    build = kernel()
    if build.library is None or not (_words(dst) and _words(row) and _words(cols)):
        return False
    if dst.dim() != 6 or row.dim() != 6 or cols.dim() != 6:
        return False
    n, layers, comps, tokens, heads, width = dst.shape
    if tuple(row.shape) != (n, 1, 1, tokens, 1, 1):
        return False
    if tuple(cols.shape) != (1, layers, comps, 1, heads, width):
        return False
    if dst.numel() == 0:
        return True
    build.library.kvp_xor_blocks(
        dst.data_ptr(), row.data_ptr(), cols.data_ptr(), n, layers * comps, tokens, heads * width
    )
    return True
