"""Capabilities as data, verdicts, plans tied to their backend, and the registry."""

from __future__ import annotations

import pytest
import torch

from kvplane.attention import (
    AttentionKind,
    BackendRegistry,
    Capabilities,
    LSEBase,
    QueryClass,
    QueryLayout,
    default_registry,
)
from kvplane.attention.backends import TorchMLABackend
from kvplane.errors import BackendError, InvalidArgumentError
from kvplane.verdicts import Supported, Unsupported, verdict


def test_capability_reasons_name_every_mismatch(mla_inputs) -> None:
    inputs = mla_inputs([1, 2], [5, 9], heads=4, page_size=4, layout=QueryLayout.SPLIT)
    caps = Capabilities(
        kinds=frozenset({AttentionKind.GQA}),
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.bfloat16}),
        lse_base=LSEBase.TWO,
        query_classes=frozenset({QueryClass.SINGLE}),
        causal=frozenset({False}),
        query_layouts=frozenset({QueryLayout.PACKED}),
        head_counts=frozenset({128}),
        page_sizes=frozenset({1, 64}),
        mla_dims=frozenset({(512, 64)}),
    )
    assert caps.reasons(inputs.problem) == (
        "kind mla not supported",
        "device cpu not supported",
        "dtype torch.float32 not supported",
        "query class varlen not supported",
        "causal=True not supported",
        "split query not supported",
        "4 heads not supported",
        "page size 4 not supported",
        "MLA dims (r, p)=(64, 16) not supported",
    )
    assert TorchMLABackend().capabilities.reasons(inputs.problem) == ()


def test_verdicts() -> None:
    assert verdict([]) == Supported()
    assert verdict(["a", "b"]) == Unsupported(("a", "b"))
    with pytest.raises(InvalidArgumentError, match="at least one reason"):
        Unsupported(())


def test_plan_is_bound_to_its_backend(mla_inputs, registry) -> None:
    inputs = mla_inputs([1], [5])
    plan = registry.get("torch").plan(inputs.problem)
    assert plan.backend == "torch" and plan.trace == ()
    with pytest.raises(BackendError, match="made by backend 'torch', not 'sdpa'"):
        registry.get("sdpa").run(plan, inputs.query, inputs.cache)
    with pytest.raises(BackendError, match="needs MLAQuery"):
        registry.get("torch").run(plan, "not a query", inputs.cache)


def test_registry_order_and_errors() -> None:
    reg = default_registry()
    assert reg.names() == (
        "flashinfer", "triton", "torch", "torch_splitkv", "sdpa", "cpu_fused", "mha",
        "reference", "gqa_torch", "gqa_reference",
    )  # fmt: skip
    assert [b.name for b in reg.candidates(AttentionKind.MLA)] == [
        "flashinfer", "triton", "torch", "torch_splitkv", "sdpa", "cpu_fused", "reference",
    ]  # fmt: skip
    assert [b.name for b in reg.candidates(AttentionKind.MLA_MHA)] == ["mha", "reference"]
    assert [b.name for b in reg.candidates(AttentionKind.GQA)] == ["gqa_torch", "gqa_reference"]
    with pytest.raises(InvalidArgumentError, match="already registered"):
        reg.register(TorchMLABackend())
    with pytest.raises(InvalidArgumentError, match="unknown attention backend 'nope'"):
        reg.get("nope")
    with pytest.raises(InvalidArgumentError, match="does not implement"):
        BackendRegistry([object()])
    assert "torch" in reg and "nope" not in reg
