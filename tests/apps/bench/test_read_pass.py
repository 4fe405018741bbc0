"""The read-only passes: each reads every byte and writes none; the C fold's exact value."""

from __future__ import annotations

from functools import reduce

import numpy as np
import pytest
import torch

from kvplane.apps.bench import read_pass
from kvplane.apps.bench.read_pass import c_fold, fastest, passes
from kvplane.errors import InvalidArgumentError


def _reference(data: bytes) -> int:
    """The documented fold: XOR of the 64-bit words of whole 64-byte lines, then the bytes."""
    whole = len(data) // 64 * 64
    words = np.frombuffer(data[:whole], dtype="<u8")
    fold = reduce(lambda a, b: a ^ b, (int(w) for w in words), 0)
    return reduce(lambda a, b: a ^ b, data[whole:], fold)


@pytest.mark.parametrize("size", [1, 63, 64, 1000, (3 << 20) + 5])
def test_c_fold_is_the_documented_xor_on_any_thread_count(size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    buf = torch.randint(0, 256, (size + 1,), dtype=torch.uint8, generator=gen)[1:]  # unaligned
    if read_pass.kernel().library is None:
        assert c_fold(buf, 1) is None
        return
    want = _reference(buf.numpy().tobytes())
    assert [c_fold(buf, t) for t in (1, 2, 3)] == [want] * 3


def test_every_pass_reads_and_none_writes() -> None:
    buf = torch.arange(1 << 16, dtype=torch.float32)
    before = buf.clone()
    found = passes(buf)
    c_names = {f"c_xor_{t}t" for t in {1, max(1, torch.get_num_threads())}}
    kernel = read_pass.kernel().library is not None
    assert set(found) == {"numpy_max_u8", "numpy_add_u64", "torch_sum_f32"} | (
        c_names if kernel else set()
    )
    assert int(found["numpy_max_u8"]()) == int(buf.view(torch.uint8).max())  # type: ignore[call-overload]
    assert float(found["torch_sum_f32"]()) == float(buf.sum())  # type: ignore[arg-type]
    for run in found.values():
        run()
    assert torch.equal(buf, before)
    # Odd sizes keep only the passes whose word size divides them.
    assert set(passes(torch.zeros(6, dtype=torch.uint8))) == {"numpy_max_u8"} | (
        c_names if kernel else set()
    )


def test_fastest_is_the_least_time_and_bad_buffers_are_refused() -> None:
    buf = torch.zeros(64, dtype=torch.uint8)
    order = {"numpy_max_u8": 3.0, "numpy_add_u64": 1.0}
    assert fastest(buf, lambda found: {n: order.get(n, 2.0) for n in found}) == "numpy_add_u64"
    for bad in (torch.zeros(0), torch.zeros(8, 2)[:, 0]):
        with pytest.raises(InvalidArgumentError):
            passes(bad)
