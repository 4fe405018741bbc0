"""``triton``: Unsupported (with an install hint) without a GPU or Triton; parity on a GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvplane.attention.backends import TritonMLABackend
from kvplane.attention.backends.triton_mla import INSTALL_HINT
from kvplane.errors import UnsupportedError
from kvplane.verdicts import Unsupported

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_unsupported_without_gpu(mla_inputs) -> None:
    b = TritonMLABackend()
    v = b.check(mla_inputs([1], [5]).problem)
    assert isinstance(v, Unsupported)
    assert "device cpu not supported" in v.reasons
    assert f"no CUDA device is available; {INSTALL_HINT}" in v.reasons
    with pytest.raises(UnsupportedError, match="no CUDA device"):
        b.plan(mla_inputs([1], [5]).problem)


def test_dims_must_be_powers_of_two(mla_inputs) -> None:
    v = TritonMLABackend().check(mla_inputs([1], [5], rank=48, rope=16).problem)
    assert isinstance(v, Unsupported)
    assert "MLA dims (r, p)=(48, 16) must be powers of two >= 16" in v.reasons


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and Triton")
@pytest.mark.parametrize(
    ("q_lens", "kv_lens"),
    [([1, 1, 1], [7, 0, 300]), ([4, 4], [4, 90]), ([1, 5, 2], [33, 5, 64])],
)
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_on_gpu(q_lens, kv_lens, causal, run_backend, assert_close) -> None:
    from kvplane.attention import MLAShape
    from kvplane.attention.synthetic import make_mla_inputs, synthetic_metadata

    for rank, rope, heads in ((64, 16, 4), (512, 64, 16)):
        meta, pages = synthetic_metadata(q_lens, kv_lens, 16, device="cuda", shuffle_seed=3)
        inputs = make_mla_inputs(
            meta, pages, MLAShape(heads, rank, rope), dtype=torch.bfloat16, causal=causal,
            sm_scale=(rank + rope) ** -0.5, device="cuda",
        )  # fmt: skip
        inputs.cache.data[0] = float("nan")  # never-written page 0
        assert_close(
            run_backend("triton", inputs), run_backend("reference", inputs), torch.bfloat16
        )
