"""``flashinfer``: Unsupported (with an install hint) without a GPU or the package; parity on a
GPU with FlashInfer installed (base-2 LSE converted)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvplane.attention import LSEBase
from kvplane.attention.backends import FlashInferMLABackend
from kvplane.attention.backends.flashinfer_mla import INSTALL_HINT
from kvplane.errors import UnsupportedError
from kvplane.verdicts import Unsupported

HAS_GPU = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_unsupported_without_gpu(mla_inputs) -> None:
    b = FlashInferMLABackend()
    assert b.capabilities.lse_base is LSEBase.TWO
    v = b.check(mla_inputs([1, 1], [5, 0]).problem)
    assert isinstance(v, Unsupported)
    assert v.reasons[:3] == (
        "device cpu not supported",
        "dtype torch.float32 not supported",
        "MLA dims (r, p)=(64, 16) not supported",
    )
    assert "a request with kv_len 0 (left to the CPU backends)" in v.reasons
    assert f"no CUDA device is available; {INSTALL_HINT}" in v.reasons
    with pytest.raises(UnsupportedError, match="no CUDA device"):
        b.plan(mla_inputs([1], [5]).problem)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and flashinfer")
@pytest.mark.parametrize(
    ("q_lens", "kv_lens"), [([1, 1, 1], [7, 1, 300]), ([4, 4], [4, 90]), ([1, 5, 2], [33, 5, 64])]
)
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_on_gpu(q_lens, kv_lens, causal, run_backend, assert_close) -> None:
    from kvplane.attention import MLAShape, QueryLayout
    from kvplane.attention.synthetic import make_mla_inputs, synthetic_metadata

    for layout in (QueryLayout.PACKED, QueryLayout.SPLIT):
        meta, pages = synthetic_metadata(q_lens, kv_lens, 16, device="cuda", shuffle_seed=3)
        inputs = make_mla_inputs(
            meta, pages, MLAShape(16, 512, 64), dtype=torch.bfloat16, causal=causal,
            sm_scale=(128 + 64) ** -0.5, layout=layout, device="cuda",
        )  # fmt: skip
        got = run_backend("flashinfer", inputs)
        assert got.lse_base is LSEBase.TWO
        assert_close(got, run_backend("reference", inputs), torch.bfloat16)
