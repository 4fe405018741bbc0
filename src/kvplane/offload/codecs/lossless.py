"""Lossless codecs: zstd and lz4 over byte planes (``zstandard``, ``lz4``; extra ``codecs``).

A float's high bytes (sign, exponent) repeat far more than its low mantissa bytes, so with
``shuffle`` the chunk is first split into byte planes (byte ``j`` of every element, plane after
plane, as Blosc does) and the planes are compressed. The engines are imported here only; without
one, ``check`` says how to install it.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvplane.errors import CorruptChunkError
from kvplane.offload.codecs.base import ChunkFormat, CodecPlan, byte_view, make_plan
from kvplane.validators import require_int
from kvplane.verdicts import Verdict, verdict

_INSTALL = "pip install 'kvplane[codecs]'"


def engine_support(module: str) -> str | None:
    """``None`` when ``module`` is importable, else why a codec that needs it is unsupported."""
    if importlib.util.find_spec(module) is None:
        return f"the {module} package is not installed: {_INSTALL}"
    return None


def shuffle(chunk: torch.Tensor, esize: int) -> npt.NDArray[np.uint8]:
    """The byte planes of ``chunk`` (1-D uint8) read as elements of ``esize`` bytes."""
    src = chunk.numpy().reshape(-1, esize)
    planes = np.empty((esize, src.shape[0]), dtype=np.uint8)
    np.copyto(planes, src.T)
    return planes


def unshuffle(planes: bytes | memoryview, esize: int, out: torch.Tensor) -> None:
    """Inverse of :func:`shuffle`: ``planes`` (``out``'s length) back into ``out``."""
    flat = np.frombuffer(planes, dtype=np.uint8)
    np.copyto(out.numpy().reshape(-1, esize), flat.reshape(esize, -1).T)


@dataclass(frozen=True, slots=True)
class _Compressor:
    """A byte compressor over (optionally shuffled) chunks; subclasses name the engine."""

    shuffle: bool = True
    _local: threading.local = field(
        default_factory=threading.local, init=False, repr=False, compare=False
    )

    name = ""
    module = ""

    @property
    def ident(self) -> str:
        return f"{self.name}:{self._params()}:shuffle={int(self.shuffle)}"

    def _params(self) -> str:
        return ""

    def check(self, fmt: ChunkFormat) -> Verdict:
        why = engine_support(self.module)
        return verdict([why] if why is not None else [])

    def plan(self, fmt: ChunkFormat) -> CodecPlan:
        return make_plan(self, fmt, lossless=True)

    def _esize(self, plan: CodecPlan) -> int:
        return plan.fmt.dtype.itemsize if self.shuffle else 1

    def encode(self, plan: CodecPlan, chunk: torch.Tensor) -> memoryview:
        esize = self._esize(plan)
        src: Any = shuffle(chunk, esize) if esize > 1 else chunk.numpy()
        return memoryview(self._compress(src))

    def decode(self, plan: CodecPlan, payload: memoryview, out: torch.Tensor) -> None:
        n = plan.fmt.nbytes
        try:
            raw = self._decompress(payload, n)
        except CorruptChunkError:
            raise
        except Exception as exc:  # the engines' own error types
            raise CorruptChunkError(f"{self.name} payload does not decode: {exc}") from exc
        if len(raw) != n:
            raise CorruptChunkError(f"{self.name} payload decodes to {len(raw)} bytes, not {n}")
        esize = self._esize(plan)
        if esize > 1:
            unshuffle(raw, esize, out)
        else:
            byte_view(out)[:] = raw

    def _engine(self) -> Any:
        return importlib.import_module(self.module)

    def _compress(self, src: Any) -> bytes:
        raise NotImplementedError

    def _decompress(self, payload: memoryview, n: int) -> bytes:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ZstdCodec(_Compressor):
    """zstd at ``level`` (1: fastest of the standard levels)."""

    level: int = 1
    name = "zstd"
    module = "zstandard"

    def __post_init__(self) -> None:
        require_int("ZstdCodec.level", self.level, min=1, max=22)

    def _params(self) -> str:
        return f"level={self.level}"

    def _compress(self, src: Any) -> bytes:
        c = getattr(self._local, "c", None)  # contexts are per thread (not thread-safe)
        if c is None:
            c = self._local.c = self._engine().ZstdCompressor(level=self.level)
        return bytes(c.compress(src))

    def _decompress(self, payload: memoryview, n: int) -> bytes:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = self._engine().ZstdDecompressor()
        return bytes(d.decompress(payload, max_output_size=n))


@dataclass(frozen=True, slots=True)
class LZ4Codec(_Compressor):
    """lz4 block format (the fastest decoder of the two, the lighter compression)."""

    name = "lz4"
    module = "lz4"

    def _params(self) -> str:
        return "block"

    def _compress(self, src: Any) -> bytes:
        return bytes(importlib.import_module("lz4.block").compress(src, store_size=False))

    def _decompress(self, payload: memoryview, n: int) -> bytes:
        block = importlib.import_module("lz4.block")
        return bytes(block.decompress(payload, uncompressed_size=n))
