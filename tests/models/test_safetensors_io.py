"""The safetensors reader/writer: exact round trips, interop, and every structural fault."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from kvplane.errors import CheckpointError
from kvplane.models.safetensors_io import SafetensorsFile, write_safetensors

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"t.{d}": (torch.randn(3, 5, generator=g) * 4).to(d) for d in DTYPES}
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(0, 7)
    out["strided"] = torch.arange(12.0).view(3, 4).t()  # non-contiguous input
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_round_trip_is_bit_exact(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    tensors = _tensors()
    write_safetensors(path, tensors, {"format": "pt"})
    f = SafetensorsFile(path)
    assert sorted(f.names()) == sorted(tensors)
    assert f.metadata == {"format": "pt"}
    for name, t in tensors.items():
        got = f.read(name)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(_bytes(got), _bytes(t))
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert header_len % 8 == 0


def test_interop_with_the_safetensors_package(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    tensors = {k: v.contiguous() for k, v in _tensors().items() if "float8" not in k}
    theirs = tmp_path / "theirs.safetensors"
    st.save_file(tensors, str(theirs))
    f = SafetensorsFile(theirs)
    for name, t in tensors.items():
        assert torch.equal(f.read(name), t)
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors)
    loaded = st.load_file(str(ours))
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t)


def _raw(tmp_path: Path, header: object, data: bytes = b"", length: int | None = None) -> Path:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path = tmp_path / "bad.safetensors"
    n = len(raw) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def _entry(
    dtype: str = "F32", shape: list[int] | None = None, offs: list[int] | None = None
) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape or [2], "data_offsets": offs or [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "length", "words"),
    [
        (b"", b"", 500, "exceeds the file"),
        (b"{not json", b"", None, "not valid JSON"),
        ([1, 2], b"", None, "JSON object"),
        ({"w": 5}, b"", None, "'w': entry must be an object"),
        ({"w": _entry(dtype="Q4")}, bytes(8), None, "unsupported dtype 'Q4'"),
        ({"w": _entry(shape=[-1])}, bytes(8), None, "bad shape"),
        ({"w": _entry(offs=[0, 16])}, bytes(8), None, "out of bounds"),
        ({"w": _entry(offs=[8, 0])}, bytes(8), None, "out of bounds"),
        ({"w": _entry(shape=[3])}, bytes(8), None, "cannot hold shape"),
        (b"[" * 200000 + b"]" * 200000, b"", None, "not valid JSON"),
        (b'{"w": {"shape": [' + b"9" * 5000 + b"]}}", b"", None, "not valid JSON"),
        ({"__metadata__": "xy"}, b"", None, "__metadata__ must be a JSON object of strings"),
        ({"__metadata__": [["a", "b"]]}, b"", None, "__metadata__ must be a JSON object"),
        ({"__metadata__": {"a": 1}}, b"", None, "__metadata__ must be a JSON object of strings"),
        (
            {"a": _entry(), "b": _entry()},
            bytes(8),
            None,
            r"tensors 'a' and 'b' overlap \(bytes \[\d+, \d+\)",
        ),
        (
            {"a": _entry(shape=[4], offs=[0, 16]), "b": _entry(offs=[12, 20])},
            bytes(20),
            None,
            "tensors 'a' and 'b' overlap",
        ),
        (
            {"a": _entry(shape=[6], offs=[0, 24]), "c": _entry(offs=[28, 36]), "b": _entry()},
            bytes(36),
            None,
            "tensors 'b' and 'a' overlap",
        ),
    ],
)
def test_structural_faults_are_checkpoint_errors(
    tmp_path: Path, header: object, data: bytes, length: int | None, words: str
) -> None:
    path = _raw(tmp_path, header, data, length)
    with pytest.raises(CheckpointError, match=words):
        SafetensorsFile(path)


def test_short_missing_and_absent(tmp_path: Path) -> None:
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        SafetensorsFile(short)
    with pytest.raises(CheckpointError, match="cannot read"):
        SafetensorsFile(tmp_path / "nope.safetensors")
    path = tmp_path / "ok.safetensors"
    write_safetensors(path, {"a": torch.ones(2)})
    with pytest.raises(CheckpointError, match="no tensor 'b'"):
        SafetensorsFile(path).read("b")


def test_file_truncated_after_the_header_was_read(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    write_safetensors(path, {"a": torch.arange(4.0)})
    f = SafetensorsFile(path)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match="truncated"):
        f.read("a")


def test_unsupported_dtype_is_refused_on_write(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="complex64"):
        write_safetensors(tmp_path / "c.safetensors", {"c": torch.zeros(2, dtype=torch.complex64)})
    assert not (tmp_path / "c.safetensors").exists()


def test_overlap_messages_give_the_shared_bytes(tmp_path: Path) -> None:
    path = _raw(
        tmp_path, {"a": _entry(shape=[4], offs=[0, 16]), "b": _entry(offs=[12, 20])}, bytes(20)
    )
    base = 8 + len(json.dumps({"a": _entry(shape=[4], offs=[0, 16]), "b": _entry(offs=[12, 20])}))
    with pytest.raises(CheckpointError, match=rf"bytes \[{base + 12}, {base + 16}\) of the file"):
        SafetensorsFile(path)


def test_adjacent_empty_and_null_metadata_entries_are_accepted(tmp_path: Path) -> None:
    header = {
        "__metadata__": None,
        "a": _entry(offs=[0, 8]),
        "e": _entry(shape=[0], offs=[4, 4]),  # empty: holds no byte, overlaps nothing
        "f": _entry(shape=[0], offs=[4, 4]),
        "b": _entry(offs=[8, 16]),
    }
    f = SafetensorsFile(_raw(tmp_path, header, struct.pack("<4f", 1, 2, 3, 4)))
    assert f.metadata == {} and sorted(f.names()) == ["a", "b", "e", "f"]
    assert f.read("b").tolist() == [3.0, 4.0] and f.read("e").shape == (0,)
