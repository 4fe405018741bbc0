"""The read-only streaming pass: the attention bench's bandwidth limit.

Decode attention only reads its KV bytes, so its limit is a pass that reads the same bytes once
and writes nothing. Several such passes are offered -- NumPy reductions, a torch ``sum`` and a
C XOR fold (``native/read_pass.c``) on one thread and on torch's thread count -- and
:func:`fastest` keeps the one that ran fastest here, so the limit is the hardest of them.
Owns no timing policy beyond that choice; the caller times the chosen pass against its own.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvplane.attention import Timer
from kvplane.errors import InvalidArgumentError
from kvplane.native import KernelBuild, load_kernel

SOURCE = Path(__file__).parent / "native" / "read_pass.c"
_SIGNATURE = ((ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32), ctypes.c_uint64)

Pass = Callable[[], object]
"""One read of every byte of a buffer; its result is the fold (kept so nothing is elided)."""


@functools.cache
def kernel() -> KernelBuild:
    """The loaded C read kernel, built on first use (once per process; a memo of a constant);
    no library, with the reason, where its source was not installed."""
    if not SOURCE.is_file():
        return KernelBuild(None, f"{SOURCE} is not installed")
    return load_kernel(SOURCE, {"kvp_read_pass": _SIGNATURE})


def _flat(buf: torch.Tensor) -> torch.Tensor:
    """``buf``'s bytes as a flat uint8 view; an empty, non-contiguous or non-CPU tensor is
    refused."""
    if buf.device.type != "cpu" or not buf.is_contiguous() or not buf.numel():
        raise InvalidArgumentError(
            f"a read pass needs a non-empty contiguous CPU tensor, got {tuple(buf.shape)} on "
            f"{buf.device}, {'contiguous' if buf.is_contiguous() else 'strided'}"
        )
    return buf.reshape(-1).view(torch.uint8)


def c_fold(buf: torch.Tensor, threads: int) -> int | None:
    """The C kernel's XOR fold of ``buf``'s bytes on ``threads`` threads: the XOR of its
    little-endian 64-bit words over whole 64-byte lines, XORed with each byte after them.
    None where the kernel cannot be built."""
    library = kernel().library
    if library is None:
        return None
    flat = _flat(buf)
    return int(library.kvp_read_pass(flat.data_ptr(), flat.numel(), threads))


def passes(buf: torch.Tensor) -> dict[str, Pass]:
    """Every read-only pass over ``buf``'s bytes (a non-empty contiguous CPU tensor), by name. A
    NumPy ``maximum`` over the bytes always; a NumPy ``add`` over 64-bit words and a torch
    ``sum`` over float32 words when the size allows; the C fold on one thread and on
    ``torch.get_num_threads()`` threads where the kernel builds. None of them writes."""
    flat = _flat(buf)
    u8 = flat.numpy()
    found: dict[str, Pass] = {"numpy_max_u8": lambda: np.maximum.reduce(u8)}
    if u8.size % 8 == 0:
        u64 = u8.view(np.uint64)
        found["numpy_add_u64"] = lambda: np.add.reduce(u64)
    if flat.numel() % 4 == 0:
        found["torch_sum_f32"] = flat.view(torch.float32).sum
    if kernel().library is not None:
        for threads in sorted({1, max(1, torch.get_num_threads())}):
            found[f"c_xor_{threads}t"] = functools.partial(c_fold, flat, threads)
    return found


def fastest(buf: torch.Tensor, timer: Timer) -> str:
    """The name of the pass of :func:`passes` over ``buf`` with the least time by ``timer``
    (a :class:`~kvplane.attention.PerfCounterTimer`: interleaved rounds, best of each)."""
    times = timer(passes(buf))
    return min(times, key=lambda name: times[name])
