"""The synthetic producer's whole-block write by a small C kernel (``native/synthetic_kv.c``).

Theory of operation
-------------------
:class:`~kvplane.serving.producers.synthetic_kv.SyntheticKV` stands in for model compute, which
on a real
deployment runs on an accelerator and leaves the host's cores and memory bandwidth to the KV
transfer. On a CPU-only host its write of a step's KV competes with the transfer's copy of the
previous slice for the same memory bandwidth: torch's broadcast XOR stores through the caches,
so every destination line is read before it is written (measured, 36 MB step of 61 MLA layers,
one thread: 2.2-2.5 ms alone, 2.9-3.7 ms beside a 36 MB copy, which itself slowed from 2.3 to
4.6-5.1 ms). :func:`xor_blocks` writes the same words with non-temporal stores (1.5 ms alone,
2.0 ms beside the copy, the copy 3.7 ms): the values are read later by the transfer, never by
the writing thread, so nothing is lost by bypassing the caches.

The kernel is built once per machine by :mod:`kvplane.native`; where it cannot be (no C
compiler), or the tensors are not contiguous CPU int64 words, :func:`xor_blocks` returns False
and the caller's torch path writes the values.
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
