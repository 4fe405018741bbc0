"""Platform filtering: a backend that cannot run here at all is skipped before selection and
traced, never a fallback; a backend that cannot run this problem is (issue 35)."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from kvplane.attention import AUTO, MEASURED, BackendRegistry, Decision, QueryLayout, Selector
from kvplane.attention.backends import (
    FlashInferMLABackend,
    ReferenceBackend,
    SDPABackend,
    TorchMLABackend,
)
from kvplane.attention.base import Capabilities
from kvplane.attention.platform import Platform, platform_of
from kvplane.attention.problem import AttentionKind, LSEBase
from kvplane.metrics import MetricsRegistry
from kvplane.models import TINY_MODELS, load_model

CAPS = Capabilities(
    kinds=frozenset({AttentionKind.MLA}), devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16}), lse_base=LSEBase.E,
)  # fmt: skip


def test_platform_reasons_cover_device_arch_isa_and_packages() -> None:
    cpu = Platform("cpu", None, frozenset({"avx2"}), "x86_64")
    assert CAPS.platform_reasons(cpu) == ("device cpu not supported",)
    sm80 = Platform("cuda", (8, 0))
    assert CAPS.platform_reasons(sm80) == ()
    hopper_only = dataclasses.replace(CAPS, min_cuda_arch=(9, 0))
    assert hopper_only.platform_reasons(sm80) == ("CUDA arch sm80 < sm90",)
    assert hopper_only.platform_reasons(Platform("cuda", (9, 0))) == ()
    wide = dataclasses.replace(
        CAPS, devices=frozenset({"cpu"}), cpu_isa=frozenset({"avx512f", "avx2"})
    )
    assert wide.platform_reasons(cpu) == ("CPU lacks avx512f",)
    engine = dataclasses.replace(CAPS, packages=frozenset({"kvplane_no_such_engine", "numpy"}))
    assert engine.platform_reasons(sm80) == ("package kvplane_no_such_engine not installed",)


def test_the_platform_of_the_cpu_is_read_once() -> None:
    here = platform_of(torch.device("cpu"))
    assert here.device == "cpu" and here.cuda_arch is None
    assert platform_of(torch.device("cpu")) is here


def test_a_platform_skip_is_traced_and_not_a_fallback(mla_inputs) -> None:
    metrics = MetricsRegistry()
    reg = BackendRegistry([FlashInferMLABackend(), SDPABackend(), TorchMLABackend()])
    sel = Selector(reg, metrics=metrics)
    plan = sel.plan(mla_inputs([1], [5]).problem, AUTO)
    skip = "device cpu not supported"
    if importlib.util.find_spec("flashinfer") is None:
        skip += "; package flashinfer not installed"
    assert [(e.candidate, e.decision, e.reason) for e in plan.trace] == [
        ("flashinfer", Decision.PLATFORM, skip),
        ("sdpa", Decision.SELECTED, "first supported candidate"),
        ("torch", Decision.NOT_TRIED, "after the selected candidate"),
    ]
    assert (sel.plans, sel.fallbacks) == (1, 0)
    # a problem the first runnable candidate cannot run (split query) is a fallback
    split = sel.plan(mla_inputs([1], [5], layout=QueryLayout.SPLIT).problem, AUTO)
    assert [(e.candidate, e.decision) for e in split.trace] == [
        ("flashinfer", Decision.PLATFORM),
        ("sdpa", Decision.UNSUPPORTED),
        ("torch", Decision.SELECTED),
    ]
    assert (sel.plans, sel.fallbacks, sel.fallback_ratio) == (2, 1, 0.5)
    assert metrics.value("attention_fallback_ratio") == 0.5


def test_only_a_later_candidate_supports_float64(registry, mla_inputs) -> None:
    sel = Selector(registry)
    plan = sel.plan(mla_inputs([1, 2], [5, 9], dtype=torch.float64).problem, AUTO)
    assert plan.backend == "reference"  # the oracle: every fast CPU backend refuses float64
    assert (sel.plans, sel.fallbacks, sel.fallback_ratio) == (1, 1, 1.0)


def test_measured_traces_platform_skips_too(mla_inputs) -> None:
    reg = BackendRegistry([FlashInferMLABackend(), TorchMLABackend(), ReferenceBackend()])
    sel = Selector(reg, timer=lambda thunks: {name: 1.0 for name in thunks})
    plan = sel.plan(mla_inputs([1], [5]).problem, MEASURED)
    assert [(e.candidate, e.decision) for e in plan.trace] == [
        ("flashinfer", Decision.PLATFORM),
        ("torch", Decision.SELECTED),
        ("reference", Decision.NOT_TRIED),
    ]
    assert sel.fallbacks == 0


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_models_on_cpu_with_auto_never_fall_back(name: str) -> None:
    """tiny-swa included: gqa_torch honours its sliding window."""
    metrics = MetricsRegistry()
    model = load_model(name, metrics=metrics)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, model.vocab_size, 40)]
    model.generate(prompt, 4, 16, block_size=16)
    assert model.selector.plans > 0
    assert (model.selector.fallbacks, model.selector.fallback_ratio) == (0, 0.0)
    assert metrics.value("attention_fallback_ratio") == 0.0
