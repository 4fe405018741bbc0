"""A small, validating reader and writer of ``.safetensors`` files (stdlib + torch).

Every structural fault is a :class:`~kvplane.errors.CheckpointError` naming file and tensor;
nothing is read before the header validates. Format: docs/attention.md.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kvplane.errors import CheckpointError
from kvplane.validators import is_int

MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor's bytes lie in its file (absolute offsets)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """The validated header of one ``.safetensors`` file; :meth:`read` loads one tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with self.path.open("rb") as fh:
                head = fh.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: too short for a safetensors header")
                (n,) = struct.unpack("<Q", head)
                if n > min(MAX_HEADER_BYTES, size - 8):
                    raise CheckpointError(f"{self.path}: header length {n} exceeds the file")
                raw = fh.read(n)
        except OSError as exc:
            raise CheckpointError(f"cannot read {self.path}: {exc}") from exc
        try:
            header = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # bad JSON/UTF-8, nesting too deep
            raise CheckpointError(f"{self.path}: header is not valid JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header must be a JSON object")
        base = 8 + n
        self.metadata: dict[str, str] = self._metadata(header.pop("__metadata__", None))
        self.entries: dict[str, TensorEntry] = {
            name: self._entry(name, spec, base, size) for name, spec in header.items()
        }
        self._check_disjoint()

    def _metadata(self, raw: object) -> dict[str, str]:
        if raw is None:
            return {}
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise CheckpointError(
                f"{self.path}: __metadata__ must be a JSON object of strings, got {raw!r:.80}"
            )
        return dict(raw)

    def _check_disjoint(self) -> None:
        """No two tensors share a byte (empty tensors hold none); one pass in start order."""
        spans = sorted(
            (e.begin, e.end, name) for name, e in self.entries.items() if e.end > e.begin
        )
        for (_, end, prev), (begin, stop, name) in itertools.pairwise(spans):
            if begin < end:
                raise CheckpointError(
                    f"{self.path}: tensors {prev!r} and {name!r} overlap (bytes "
                    f"[{begin}, {min(end, stop)}) of the file are in both)"
                )

    def _entry(self, name: str, spec: object, base: int, size: int) -> TensorEntry:
        where = f"{self.path}: tensor {name!r}"
        if not isinstance(spec, dict):
            raise CheckpointError(f"{where}: entry must be an object")
        dtype = _DTYPES.get(str(spec.get("dtype")))
        if dtype is None:
            raise CheckpointError(f"{where}: unsupported dtype {spec.get('dtype')!r}")
        shape, offs = spec.get("shape"), spec.get("data_offsets")
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: bad shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(is_int(o) for o in offs)
            or not 0 <= offs[0] <= offs[1]
            or base + offs[1] > size
        ):
            raise CheckpointError(f"{where}: data_offsets {offs!r} out of bounds")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offs[1] - offs[0] != math.prod(shape) * itemsize:
            raise CheckpointError(
                f"{where}: {offs[1] - offs[0]} bytes cannot hold shape {shape} of {dtype}"
            )
        return TensorEntry(dtype, tuple(shape), base + offs[0], base + offs[1])

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def read(self, name: str) -> torch.Tensor:
        """A fresh CPU tensor holding ``name``'s data (``CheckpointError`` if absent)."""
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        buf = bytearray(entry.end - entry.begin)
        try:
            with self.path.open("rb") as fh:
                fh.seek(entry.begin)
                got = fh.readinto(buf)
        except OSError as exc:
            raise CheckpointError(f"cannot read {name!r} from {self.path}: {exc}") from exc
        if got != len(buf):
            raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
        if not buf:
            return torch.empty(entry.shape, dtype=entry.dtype)
        return torch.frombuffer(buf, dtype=entry.dtype).reshape(entry.shape)


def write_safetensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (any device; copied to contiguous CPU) to ``path``, names sorted."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in _NAMES:
            raise CheckpointError(f"tensor {name!r} has unsupported dtype {t.dtype}")
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with Path(path).open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for blob in blobs:
            fh.write(blob)
