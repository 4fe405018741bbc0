"""The shared backend machinery: scratch reuse, the run prologue, grouping knobs, GPU reasons."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention import AttentionKind, LSEBase
from kvplane.attention.backends import GQATorchBackend, MHABackend, SDPABackend, TorchMLABackend
from kvplane.attention.backends.common import Scratch, cuda_package_reasons, torch_capabilities
from kvplane.errors import InvalidArgumentError

CPU = torch.device("cpu")


def test_scratch_is_reused_grown_and_private_to_overlapping_runs() -> None:
    scratch = Scratch()
    with scratch.use() as take:
        first = take("kv", 10, torch.float32, CPU)
        assert first.shape == (10,)
    with scratch.use() as take:
        again = take("kv", 6, torch.float32, CPU)
        assert again.data_ptr() == first.data_ptr() and again.shape == (6,)
        other = take("kv_c", 6, torch.float32, CPU)
        assert other.data_ptr() != first.data_ptr()
        with scratch.use() as nested:  # an overlapping run (another thread) shares nothing
            private = nested("kv", 6, torch.float32, CPU)
            assert private.data_ptr() not in (first.data_ptr(), other.data_ptr())
        grown = take("kv", 11, torch.float32, CPU)
        assert grown.data_ptr() != first.data_ptr() and grown.shape == (11,)
        as_bf16 = take("kv", 4, torch.bfloat16, CPU)
        assert as_bf16.dtype == torch.bfloat16
    with scratch.use() as take:  # the lock was released: the shared buffers are back
        assert take("kv", 4, torch.bfloat16, CPU).data_ptr() == as_bf16.data_ptr()


@pytest.mark.parametrize("name", ["torch", "torch_splitkv", "sdpa", "reference"])
def test_a_batch_without_kv_is_answered_without_attending(name, mla_inputs, run_backend) -> None:
    inputs = mla_inputs([1, 2], [0, 0])
    res = run_backend(name, inputs)
    assert res.out.shape == (3, 4, 64) and res.lse_base is LSEBase.E
    assert torch.equal(res.out, torch.zeros_like(res.out))
    assert bool(torch.isneginf(res.lse).all())


def test_non_absorbed_and_gqa_empty_batches_have_their_value_dims(
    mla_inputs, gqa_inputs, run_backend
) -> None:
    mha = run_backend("mha", mla_inputs([2], [0], nope=24, v_dim=20))
    assert mha.out.shape == (2, 4, 20) and bool(torch.isneginf(mha.lse).all())
    gqa = run_backend("gqa_torch", gqa_inputs([0, 0], [3, 5]))  # KV but no query token
    assert gqa.out.shape == (0, 4, 16) and gqa.lse.shape == (0, 4)


@pytest.mark.parametrize("cls", [TorchMLABackend, SDPABackend, MHABackend, GQATorchBackend])
@pytest.mark.parametrize("bad", [0, -1, True, 1.5])
def test_group_bytes_must_be_a_positive_int(cls, bad) -> None:
    with pytest.raises(
        InvalidArgumentError, match=f"group_bytes must be a positive int, got {bad!r}"
    ):
        cls(group_bytes=bad)


def test_torch_capabilities_and_gpu_reasons() -> None:
    caps = torch_capabilities(AttentionKind.GQA)
    assert caps.kinds == frozenset({AttentionKind.GQA})
    assert caps.devices == frozenset({"cpu", "cuda"}) and caps.lse_base is LSEBase.E
    reasons = cuda_package_reasons("kvplane_no_such_package", "install it")
    assert "the kvplane_no_such_package package is not installed; install it" in reasons
    assert ("no CUDA device is available; install it" in reasons) != torch.cuda.is_available()
